"""Training only: the experiment's pre-training and RL phases, no held-out evaluation.

  bazel run //tools:train -- --gin_file=tools/configs/experiments/default.gin [--gin.X=V ...]

Which phases run follows the gin files (a phase runs when its run file is included, see
tools/configs/runs/). The final model is saved to <run_dir>/final_model (moe.checkpoint), ready
for `//tools:serve -- --checkpoint=...` and `//tools:eval -- --checkpoint=...`.
"""

from __future__ import annotations

import sys

from tools import main as main_lib


def main(argv=None) -> int:
  return main_lib.main(argv, evaluate=False)


if __name__ == "__main__":
  sys.exit(main())
