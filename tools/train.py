"""Training only: the experiment's pre-training and RL phases, no held-out evaluation.

  bazel run //tools:train -- --gin_file=tools/configs/experiments/default.gin [--gin.X=V ...]

  bazel run //tools:train -- --hf_checkpoint=DIR --gin_file=tools/configs/experiments/hf_rl.gin \
      [--task_file=tasks.jsonl] [--hf_export=OUT]

Which phases run follows the gin files (a phase runs when its run file is included, see
tools/configs/runs/). The final model is saved to <run_dir>/final_model (moe.checkpoint), ready
for `//tools:serve -- --checkpoint=...` and `//tools:eval -- --checkpoint=...`. A run from a
Hugging Face checkpoint (`--hf_checkpoint`, its own tokenizer) also exports it as one, to
<run_dir>/hf_export or `--hf_export`, ready for `//tools:serve -- --hf_checkpoint=...` and
transformers. The flags are tools/main.py's.
"""

from __future__ import annotations

import sys

from tools import main as main_lib


def main(argv=None) -> int:
  return main_lib.main(argv, evaluate=False)


if __name__ == "__main__":
  sys.exit(main())
