"""Scores a model on a task suite: pass@1 and pass@k with the training harness and sandboxes.

`evaluate(model_or_engine, tasks, *, n, k_list, temperature, max_tokens, seed, pool, ...)` runs
every task through exactly the code RL trains with -- `envs.harness.attempts.run_attempts` (the
single-turn case for tasks with a prompt, the multi-turn agent loop for repository and SWE
tasks) with `envs.harness.inprocess_policy.InProcessPolicy` over the sampler, grading with
hidden tests in fresh sandboxes from an `envs.sandbox.pool.WarmPool` -- so an evaluation number
and a training reward mean the same thing.

Speed: all tasks are in flight at once (up to `max_concurrency` requests): each task's episode
runs in its own thread, so every prompt is queued on the engine together and its continuous
batching decodes them side by side, while finished samples are graded in parallel in the pool.

A sample passes when its episode ended normally ("ok") with full test reward and no hack penalty.
Infrastructure failures (sandbox or sampler broke) are not the model's: they are left out of
that task's n and counted in its flags; a task left with fewer than k good samples has no pass@k
and is left out of the mean (the report counts how many tasks each mean covers).

Prompt style (`prompt_style`, single-turn tasks): "completion" continues each task's prompt (a
base model's task), "chat" asks for it in a user message rendered with the tokenizer's chat template
and grades the code in the answer (`envs.harness.chat_style`: a chat model's task). Either way a
completion also ends at `eos_token_ids` (a checkpoint's EOS list: a chat model ends its turn with
a token, such as Qwen3's `<|im_end|>`, that is not its tokenizer's EOS).

Agent tasks of a model with a chat template are written in that template
(`envs.harness.turn_format.chat_turns`, unless `loop_config` says otherwise): the system and
user messages, the model's turns, each tool result a tool message, each turn ending at the
template's end-of-turn token.

Per-task results go to a JSONL file (task id, suite, n, c, pass@k, every sample's completion,
reward and flags) and the summary next to it (`<out>.summary.json`). Seeds are derived from
(seed, task id), so results do not depend on task order or concurrency.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Callable, Optional, Sequence

from envs import reward as reward_lib
from envs.harness import agent_loop
from envs.harness import attempts as attempts_lib
from envs.harness import chat_style
from envs.harness import inprocess_policy
from envs.harness import single_turn
from envs.harness import trajectory as traj_lib
from envs.harness import turn_format
from envs.tasks import task_format
from evaluation import passk
from evaluation import sources

PROMPT_STYLES = ("completion", "chat")


@dataclasses.dataclass
class TaskResult:
  """One task's outcome. n counts good samples (infra failures excluded), c the passing ones."""
  task_id: str
  suite: str
  split: str
  mode: str
  n: int
  c: int
  pass_at_k: dict  # k -> float, or None when n < k
  samples: list  # per sample: index, completion, passed, reward, test_reward, status, ...
  flags: dict  # infra_errors, hacked, truncated sample counts

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
    return d


@dataclasses.dataclass
class EvalReport:
  """The suite's scores.

  pass_at_k: k -> mean pass@k over the tasks that have it; tasks_scored: k -> how many.
  solved: tasks with at least one passing sample. pass1_count: sum over tasks of c/n, i.e. the
  expected number of tasks solved by one sample ("12/200" style), rounded to 2 decimals.
  """
  num_tasks: int
  n: int
  k_list: tuple
  temperature: float
  max_tokens: int
  seed: int
  pass_at_k: dict
  tasks_scored: dict
  solved: int
  pass1_count: float
  infra_errors: int
  results: list
  wall_s: float
  samples_per_s: float
  out_path: Optional[str] = None
  prompt_style: str = "completion"

  def summary(self) -> dict:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "results"}
    d["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
    d["tasks_scored"] = {str(k): v for k, v in self.tasks_scored.items()}
    d["k_list"] = list(self.k_list)
    return d

  def table(self) -> str:
    lines = [f"tasks: {self.num_tasks}   samples/task: {self.n}   temperature: "
             f"{self.temperature}   seed: {self.seed}   infra errors: {self.infra_errors}"]
    for k in self.k_list:
      v = self.pass_at_k.get(k)
      lines.append(f"pass@{k}: " + ("n/a" if v is None else f"{v:.4f}") +
                   f"   ({self.tasks_scored[k]} tasks)")
    lines.append(f"solved (any sample): {self.solved}/{self.num_tasks}   "
                 f"pass@1 count: {self.pass1_count:g}/{self.num_tasks}   "
                 f"wall: {self.wall_s:.1f}s")
    return "\n".join(lines)


def task_seed(seed: int, task_id: str) -> int:
  """A 31-bit seed from (seed, task id): independent of task order."""
  h = hashlib.sha256(f"{seed}:{task_id}".encode()).digest()
  return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def single_turn_style(prompt_style: str, tokenizer):
  """The harness's single-turn style for `prompt_style` (see the module docstring): "chat"
  renders with `tokenizer.chat_template` (`moe.chat_template`, as transformers'
  apply_chat_template with add_generation_prompt=True) and encodes with `tokenizer`.

  Raises:
    ValueError: an unknown style, or "chat" with a tokenizer that has no chat template.
  """
  if prompt_style == "completion":
    return single_turn.COMPLETION
  if prompt_style != "chat":
    raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
  template = getattr(tokenizer, "chat_template", None)
  if template is None:
    raise ValueError("prompt_style 'chat' needs a chat template, and this tokenizer has none "
                     "(its checkpoint has no chat_template.jinja or tokenizer_config.json "
                     "'chat_template'); evaluate it with prompt_style 'completion'")

  def render_ids(messages):
    return tokenizer.encode(template.render(messages, add_generation_prompt=True))

  return chat_style.ChatStyle(render_ids)


def prompt_ids(task: task_format.Task, style, tokenizer, add_bos: bool) -> list:
  """The ids a single-turn `task`'s prompt is sent as under `style` (`single_turn_style`)."""
  return style.prompt_ids(task, inprocess_policy.InProcessPolicy(None, tokenizer,
                                                                 add_bos=add_bos))


def _passed(t: traj_lib.Trajectory) -> bool:
  return (t.status == reward_lib.OK and (t.test_reward or 0.0) >= 1.0
          and (t.reward or 0.0) >= 1.0)


def _sample_record(i: int, t: traj_lib.Trajectory) -> dict:
  return {"index": i, "completion": t.completion_text, "passed": _passed(t),
          "reward": t.reward, "test_reward": t.test_reward, "status": t.status,
          "finish_reason": t.finish_reason, "hack_flags": sorted(t.hack_flags),
          "infra_error": t.infra_error, "num_turns": t.num_turns,
          "model_tokens": t.num_model_tokens, "test_outcomes": dict(t.test_outcomes)}


def _task_result(task: task_format.Task, mode: str, trajs: Sequence[traj_lib.Trajectory],
                 k_list: Sequence[int]) -> TaskResult:
  good = [t for t in trajs if t.status != traj_lib.INFRA]
  n, c = len(good), sum(_passed(t) for t in good)
  return TaskResult(
      task_id=task.task_id, suite=task.suite, split=task.split, mode=mode, n=n, c=c,
      pass_at_k={k: (passk.pass_at_k(n, c, k) if n >= k else None) for k in k_list},
      samples=[_sample_record(i, t) for i, t in enumerate(trajs)],
      flags={"infra_errors": len(trajs) - n,
             "hacked": sum(bool(t.hack_flags) for t in good),
             "truncated": sum(t.flags["truncated"] for t in good)})


def evaluate(model_or_engine: Any, tasks: Sequence[task_format.Task], *, n: int = 1,
             k_list: Sequence[int] = (1,), temperature: float = 0.0, max_tokens: int = 96,
             seed: int = 0, pool, out_path: Optional[str] = None, tokenizer=None,
             add_bos: bool = True, mode: str = "auto", prompt_style: str = "completion",
             eos_token_ids: Sequence[int] = (),
             reward_config: reward_lib.RewardConfig = reward_lib.RewardConfig(),
             loop_config: Optional[agent_loop.LoopConfig] = None,
             engine_config=None, max_concurrency: int = 64,
             progress: Optional[Callable[[int, int], None]] = None) -> EvalReport:
  """Scores `model_or_engine` on `tasks`; see the module docstring.

  Args:
    model_or_engine: a rollout Engine, a MoEDecoder, a checkpoint path or a generate callable
      (evaluation.sources).
    tasks: the suite (e.g. suite_pyfunc.split(suite_pyfunc.generate(), "test"), from
      envs.tasks.suite_pyfunc).
    n: samples per task.
    k_list: the k of pass@k to report; each must be <= n.
    temperature: sampling temperature (0 = greedy; pass@k for k > 1 wants sampling).
    max_tokens: tokens per completion (per turn in agent mode).
    seed: base seed; each task's seed is task_seed(seed, task_id).
    pool: an envs.sandbox.pool.WarmPool for grading (the caller owns it).
    out_path: where to write the per-task JSONL (and `<stem>.summary.json`); None writes nothing.
    tokenizer: the model's tokenizer (default: the source's own, `sources.with_tokenizer`: a
      checkpoint's tokenizer.json, an engine's tokenizer, bytes for a byte vocabulary).
    add_bos: prepend BOS to prompts (how the project's models are pre-trained); the tokenizer
      must have one.
    mode: "auto" (single-turn when the task has a prompt, else the agent loop), "single_turn"
      or "agent".
    prompt_style: how single-turn tasks are put to the model: "completion" (the prompt is
      continued) or "chat" (a user message through the tokenizer's chat template; the code in
      the answer is graded); see `single_turn_style`. The agent loop has its own format.
    eos_token_ids: ids that also end a completion in an engine built here, besides the
      tokenizer's EOS: a checkpoint's EOS list (`sources.checkpoint_eos_ids`, the default for a
      checkpoint path).
    reward_config: grading settings, as in training.
    loop_config: agent-loop settings for agent mode (temperature, seed and max_tokens_per_turn
      are set from the arguments above). None: the defaults, with the tokenizer's chat template
      for agent turns when it has one (`turn_format.chat_turns`).
    engine_config: EngineConfig for an engine built from a model or checkpoint.
    max_concurrency: most tasks in flight at once.
    progress: called as progress(tasks_done, num_tasks) after each task.

  Raises:
    ValueError: no tasks, bad n / k_list / mode / prompt_style, a context the model cannot hold,
      no tokenizer for a vocabulary that is not bytes (moe.tokenizer.TokenizerError), add_bos
      with a tokenizer that has no BOS, or prompt_style "chat" with one that has no chat
      template (or whose template refuses a task's message: moe.chat_template.ChatTemplateError),
      or agent tasks with a chat template the agent loop cannot use (`turn_format.chat_turns`).
  """
  if not tasks:
    raise ValueError("no tasks to evaluate")
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"n must be a positive integer, got {n!r}")
  ks = passk.check_k_list(k_list, n)
  if mode not in attempts_lib.MODES:
    raise ValueError(f"mode must be auto, single_turn or agent, got {mode!r}")
  ids = [t.task_id for t in tasks]
  if len(set(ids)) != len(ids):
    raise ValueError("task ids must be unique")
  modes = [attempts_lib.mode_of(t, mode) for t in tasks]
  if isinstance(model_or_engine, str) and not eos_token_ids:
    eos_token_ids = sources.checkpoint_eos_ids(model_or_engine)
  model_or_engine, tokenizer = sources.with_tokenizer(model_or_engine, tokenizer)
  if add_bos and tokenizer.bos_id is None:
    raise ValueError("add_bos=True but the tokenizer has no BOS token; pass add_bos=False")
  style = single_turn_style(prompt_style, tokenizer)
  longest = max((len(prompt_ids(t, style, tokenizer, add_bos))
                 for t, m in zip(tasks, modes) if m == "single_turn"), default=0)
  loop = loop_config or agent_loop.LoopConfig(
      chat=turn_format.chat_turns(tokenizer, eos_token_ids) if "agent" in modes else None)
  if "agent" in modes:
    context = loop.max_context_tokens
  else:
    context = longest + max_tokens

  t0 = time.monotonic()
  with sources.open_sampler(model_or_engine, context=context, engine_config=engine_config,
                            tokenizer=tokenizer, eos_token_ids=eos_token_ids) as sampler:
    policy = inprocess_policy.InProcessPolicy(sampler.generate, tokenizer, add_bos=add_bos,
                                              stop_strings=sampler.stop_strings)
    in_flight = max_concurrency
    if sampler.max_queue is not None:  # never overflow the engine's queue (QueueFull)
      in_flight = max(1, min(in_flight, sampler.max_queue // n))

    settings = attempts_lib.AttemptSettings(
        mode=mode, max_tokens=max_tokens, temperature=temperature, reward=reward_config,
        grade_threads=n, single_turn_style=style,
        loop=dataclasses.replace(loop, max_tokens_per_turn=max_tokens))

    slots = attempts_lib.episode_slots(pool, reserved=n)

    def run_task(i: int) -> list:
      return attempts_lib.run_attempts(tasks[i], policy, pool=pool, n=n,
                                       seed=task_seed(seed, tasks[i].task_id), settings=settings,
                                       slots=slots)

    trajs: list = [None] * len(tasks)
    done = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, min(in_flight, len(tasks))),
                                               thread_name_prefix="eval") as ex:
      futures = {ex.submit(run_task, i): i for i in range(len(tasks))}
      for fut in concurrent.futures.as_completed(futures):
        trajs[futures[fut]] = fut.result()
        done += 1
        if progress is not None:
          progress(done, len(tasks))
  wall = time.monotonic() - t0

  results = [_task_result(t, m, tr, ks) for t, m, tr in zip(tasks, modes, trajs)]
  mean, scored = {}, {}
  for k in ks:
    vals = [r.pass_at_k[k] for r in results if r.pass_at_k[k] is not None]
    mean[k] = sum(vals) / len(vals) if vals else None
    scored[k] = len(vals)
  report = EvalReport(
      num_tasks=len(tasks), n=n, k_list=ks, temperature=float(temperature),
      max_tokens=max_tokens, seed=seed, pass_at_k=mean, tasks_scored=scored,
      solved=sum(r.c > 0 for r in results),
      pass1_count=round(sum(r.c / r.n for r in results if r.n), 2),
      infra_errors=sum(r.flags["infra_errors"] for r in results), results=results,
      wall_s=wall, samples_per_s=len(tasks) * n / wall if wall > 0 else 0.0, out_path=out_path,
      prompt_style=prompt_style)
  if out_path:
    write(report, out_path)
  return report


def summary_path(out_path: str) -> str:
  return os.path.splitext(out_path)[0] + ".summary.json"


def write(report: EvalReport, out_path: str) -> None:
  """Per-task JSONL at out_path, the summary at summary_path(out_path)."""
  d = os.path.dirname(os.path.abspath(out_path))
  os.makedirs(d, exist_ok=True)
  with open(out_path, "w", encoding="utf-8") as f:
    for r in report.results:
      f.write(json.dumps(r.to_json(), sort_keys=True) + "\n")
  with open(summary_path(out_path), "w", encoding="utf-8") as f:
    json.dump(report.summary(), f, indent=1, sort_keys=True)


def read_results(out_path: str) -> list[dict]:
  with open(out_path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
