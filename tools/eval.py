"""Scores a checkpoint on a task suite: pass@1 / pass@k with the training harness and sandboxes.

Usage:

  bazel run //tools:eval -- --checkpoint=/path/to/ckpt --n=8 --k_list='(1, 4, 8)' --temperature=0.8
  bazel run //tools:eval -- --hf_checkpoint=/path/to/hf_dir --suite=swe --mode=agent
  bazel run //tools:eval -- --hf_checkpoint=/path/to/hf_dir --suite=humaneval --max_tokens=512
  bazel run //tools:eval -- --hf_checkpoint=/path/to/chat_model --suite=humaneval \
      --prompt_style=chat --n=10 --k_list='(1, 10)' --temperature=0.8 --max_tokens=1024
  .venv/bin/python -m tools.eval --gin_file=moe/configs/tiny.gin --random_init=True --limit=5

Every parameter of `eval_run` is a flag (`--n=4`) or a gin binding (`--gin.eval_run.n=4`);
`--gin_file` adds gin files (a model size file for --random_init). `--suite` picks the tasks:
pyfunc (the generated tiny-function suite), swe (SWE-style repository tasks), humaneval (OpenAI's
164 HumanEval problems, all split "test", single-turn completion of the prompt graded by the
official check program in a sandbox; HumanEval bodies need far more than the default
--max_tokens=96) or file (--task_file=PATH). `--prompt_style` says how single-turn tasks are put
to the model: `completion` (default; a base model continues the prompt) or `chat` (a chat model
is asked in a user message rendered with the checkpoint's chat template, and the code in its
answer is graded: envs.harness.chat_style); a model with an EOS list in its checkpoint
(generation_config.json) stops at every id of it. Agent tasks (`--mode=agent`, or swe and file
tasks without a prompt) of a checkpoint with a chat template are written in that template, each
turn ending at its end-of-turn token (envs.harness.turn_format.chat_turns).
Per-task results go to `--out` (JSONL) and the summary to `<out stem>.summary.json`; the last
lines printed are the summary table.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import gin

from envs.sandbox import pool as pool_lib
from envs.tasks import suite_humaneval
from envs.tasks import suite_pyfunc
from envs.tasks import suite_swe
from envs.tasks import task_format
from evaluation import evaluate as evaluate_lib
from evaluation import sources
from tools import configs

SUITES = ("pyfunc", "swe", "humaneval", "file")


def load_suite(suite: str, split: Optional[str], task_file: Optional[str],
               limit: Optional[int]) -> list[task_format.Task]:
  """The tasks of `suite` ("pyfunc", "swe", "humaneval" or "file" = task_file), filtered by
  split (humaneval's are all "test")."""
  if suite == "pyfunc":
    tasks = suite_pyfunc.generate()
  elif suite == "swe":
    tasks = suite_swe.generate()
  elif suite == "humaneval":
    tasks = suite_humaneval.generate()
  elif suite == "file":
    if not task_file:
      raise configs.ConfigError("--suite=file needs --task_file=PATH (JSONL or task directories)")
    loaded = task_format.load_tasks(configs.workspace_path(task_file))
    for r in loaded.rejected:
      print(f"rejected task {r.task_id or r.source}: {'; '.join(r.reasons)}", file=sys.stderr)
    tasks = loaded.tasks
  else:
    raise configs.ConfigError(f"--suite must be one of {SUITES}, got {suite!r}")
  if split:
    tasks = [t for t in tasks if t.split == split]
  if limit is not None:
    tasks = tasks[:limit]
  if not tasks:
    raise configs.ConfigError(f"no tasks in suite {suite!r} with split {split!r}")
  return tasks


def _prompt_style(prompt_style: str, tokenizer, directory: Optional[str]):
  """The harness's single-turn style for --prompt_style (a flag error when the checkpoint has no
  chat template for "chat")."""
  if prompt_style == "chat" and tokenizer.chat_template is None:
    raise configs.ConfigError(
        f"--prompt_style=chat needs the checkpoint's chat template, and "
        f"{directory or 'a model without a directory'} has none (no chat_template.jinja or "
        "tokenizer_config.json 'chat_template'): evaluate it with --prompt_style=completion")
  return evaluate_lib.single_turn_style(prompt_style, tokenizer)


def _check_fits(tasks, tokenizer, max_seq_len: int, *, max_tokens: int, mode: str,
                style) -> None:
  """A flag error, before any engine is built, when a single-turn prompt (as `style` sends it:
  with BOS, or through the chat template) plus `max_tokens` exceeds the model's context: which
  task, how many positions, what to change."""
  from envs.harness import attempts as attempts_lib  # pylint: disable=g-import-not-at-top
  bos = tokenizer.bos_id is not None
  single = [t for t in tasks if attempts_lib.mode_of(t, mode) == "single_turn"]
  if not single:
    return
  lengths = {}
  for t in single:
    try:
      lengths[t.task_id] = len(evaluate_lib.prompt_ids(t, style, tokenizer, bos))
    except ValueError as e:  # the chat template refused the message (moe.chat_template)
      raise configs.ConfigError(f"task {t.task_id}'s prompt: {e}") from e
  longest = max(single, key=lambda t: lengths[t.task_id])
  need = lengths[longest.task_id] + max_tokens
  if need > max_seq_len:
    raise configs.ConfigError(
        f"task {longest.task_id}'s prompt and --max_tokens={max_tokens} need {need} positions, "
        f"more than the model's max_seq_len of {max_seq_len}: lower --max_tokens, leave the "
        "long tasks out (--limit, --task_file) or use a model with a longer context")


@gin.configurable
def eval_run(checkpoint: Optional[str] = None, hf_checkpoint: Optional[str] = None,
             random_init: bool = False, model_seed: int = 0, suite: str = "pyfunc",
             split: Optional[str] = "test", task_file: Optional[str] = None,
             limit: Optional[int] = None, n: int = 1, k_list: Sequence[int] = (1,),
             temperature: float = 0.0, max_tokens: int = 96, seed: int = 0,
             out: str = "/tmp/eval/results.jsonl", mode: str = "auto",
             prompt_style: str = "completion", pool_size: int = 4,
             allow_degraded: bool = False, max_concurrency: int = 64) -> evaluate_lib.EvalReport:
  """Loads the model (exactly one of checkpoint, hf_checkpoint, random_init) and its tokenizer,
  runs the eval.

  The tokenizer is the checkpoint's own (`moe.tokenizer.for_model`: its tokenizer.json; bytes only
  for a byte vocabulary, and a random-init model must have one); BOS starts each prompt when the
  tokenizer has one (the project's models; not Qwen's). `prompt_style` "chat" renders each
  single-turn prompt with the checkpoint's chat template instead (its own BOS, if any), and a
  Hugging Face checkpoint's EOS list (generation_config.json) ends completions in either style.
  """
  if sum([checkpoint is not None, hf_checkpoint is not None, bool(random_init)]) != 1:
    raise configs.ConfigError("give exactly one of --checkpoint, --hf_checkpoint or "
                           "--random_init=True (with a model gin file)")
  if prompt_style not in evaluate_lib.PROMPT_STYLES:
    raise configs.ConfigError(f"--prompt_style must be one of {evaluate_lib.PROMPT_STYLES}, got "
                              f"{prompt_style!r}")
  tasks = load_suite(suite, split, task_file, limit)
  from moe import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from rollout import loading  # pylint: disable=g-import-not-at-top  (imports jax)
  directory = configs.workspace_path(checkpoint or hf_checkpoint) if not random_init else None
  try:
    model = loading.load_model(
        checkpoint=directory if checkpoint else None,
        hf_checkpoint=directory if hf_checkpoint else None,
        config=configs.model_config() if random_init else None, seed=model_seed)
    tokenizer = tokenizer_lib.for_model(directory, model.config.vocab_size)
    eos = (sources.checkpoint_eos_ids(directory) if hf_checkpoint else ())
  except ValueError as e:  # moe.tokenizer.TokenizerError, moe.hf.CheckpointError too
    raise configs.ConfigError(str(e)) from e
  style = _prompt_style(prompt_style, tokenizer, directory)
  _check_fits(tasks, tokenizer, model.config.max_seq_len, max_tokens=max_tokens, mode=mode,
              style=style)
  print(f"evaluating on {len(tasks)} {suite} task(s), n={n}, k={tuple(k_list)}, "
        f"{prompt_style} prompts", flush=True)

  def progress(done, total):
    if done == total or done % max(1, total // 10) == 0:
      print(f"  {done}/{total} tasks", flush=True)

  with pool_lib.WarmPool(size=pool_size, allow_degraded=allow_degraded) as pool:
    return evaluate_lib.evaluate(model, tasks, n=n, k_list=k_list, temperature=temperature,
                                 max_tokens=max_tokens, seed=seed, pool=pool,
                                 out_path=configs.workspace_path(out), tokenizer=tokenizer,
                                 add_bos=tokenizer.bos_id is not None, mode=mode,
                                 prompt_style=prompt_style, eos_token_ids=eos,
                                 max_concurrency=max_concurrency, progress=progress)


def main(argv: Sequence[str]) -> int:
  try:
    files, bindings, _ = configs.split_flags(argv, eval_run)
    configs.parse(files, bindings)
    report = eval_run()
  except configs.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"per-task results: {report.out_path}")
  print(report.table())
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
