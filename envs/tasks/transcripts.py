"""Agent transcripts for continual pre-training: oracle episodes of the repository suite.

Pre-training on transcripts teaches the tiny model the agent format before RL (tool calls, test
output, fixes, submissions, summaries), as production coding-agent training does. Each
transcript is a real episode: `envs.harness.agent_loop.run_episode` drives an oracle
`ScriptedPolicy` through the task in a sandbox, and each context segment's token ids are decoded
into one document, so the documents are exactly what the harness renders for the model (system
prompt, tool responses, summary requests) and every one ends in reward 1 (checked).

The oracle follows the task's plan (`envs.tasks.suite_repo` metadata) and reacts to what it is
shown: before each step it checks that the previous observation shows what the step relies on
(the expected value, the helper's name, the module in the listing), and when the loop asks for
a summary it writes one from what it has seen so far and carries on from there in the fresh
context. Variants:

  direct       read the files that hold the information, fix, submit
  tests_first  run the visible tests, read the failure (and a file), fix, submit
  wrong_first  a wrong first fix, then the failing test output, the right fix, submit
  summarised   the direct or wrong_first plan under a context so small that the loop asks for
               a summary before the fix

Only train-split tasks are used; held-out tasks are refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import statistics
from typing import Mapping, Sequence

from envs.harness import agent_loop
from envs.harness import policy as policy_lib
from envs.harness import toolcall
from envs.harness import trajectory as traj_lib
from envs.sandbox import pool as pool_lib
from envs.tasks import task_format

log = logging.getLogger(__name__)

_INFRA_ATTEMPTS = 3
VARIANTS = ("direct", "tests_first", "wrong_first", "summarised")
DEFAULT_MIX = {"direct": 0.3, "tests_first": 0.4, "wrong_first": 0.3}


class OracleError(RuntimeError):
  """The oracle did not see what its plan relies on, or its episode did not earn reward 1."""


def _call(tool: str, args: Mapping) -> str:
  body = json.dumps({"name": tool, "arguments": dict(args)}, separators=(",", ":"))
  return f"{toolcall.CALL_OPEN}\n{body}\n{toolcall.CALL_CLOSE}"


def plan(task: task_format.Task, variant: str) -> list[dict]:
  """The oracle's steps for `variant` ("summarised" uses wrong_first's, or direct's).

  Each step: {"tool", "args", "expect" (its observation must show this; "" for none),
  "fact" (what it taught, for summaries)}.
  """
  meta = task.metadata
  fix = meta["fix"]
  edit = {"tool": "edit_file", "args": {k: fix[k] for k in ("path", "old", "new")},
          "expect": f"edited {fix['path']}", "fact": f"changed {fix['old']} to {fix['new']}"}
  submit = {"tool": "submit", "args": {}, "expect": "", "fact": ""}
  if variant == "summarised":
    variant = "wrong_first" if meta.get("wrong") else "direct"
  if variant in ("direct", "tests_first"):
    return [dict(s) for s in meta[variant]] + [edit, submit]
  if variant != "wrong_first":
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
  wrong = meta.get("wrong")
  if not wrong:
    raise ValueError(f"{task.task_id} has no wrong first attempt")
  bad = {"tool": "edit_file", "args": {k: wrong[k] for k in ("path", "old", "new")},
         "expect": f"edited {wrong['path']}", "fact": ""}
  tests = {"tool": "run_tests", "args": {}, "expect": wrong["shows"], "fact": wrong["fact"]}
  # From the wrong state: the wrong edit's text is what is there now.
  right = dict(edit, args={"path": fix["path"], "old": wrong["new"], "new": fix["new"]},
               fact=f"changed {wrong['new']} to {fix['new']}")
  return [dict(s) for s in meta["wrong_first"]] + [bad, tests, right, submit]


def _next_action(step: dict) -> str:
  args = step["args"]
  if step["tool"] == "edit_file":
    return f"in {args['path']} change {args['old']} to {args['new']}"
  if step["tool"] == "read_file":
    return f"read {args['path']}"
  return {"run_tests": "run the tests", "list_files": "list the files",
          "submit": "submit"}[step["tool"]]


class Oracle:
  """The scripted side of an oracle episode: `ScriptedPolicy(Oracle(...), tokenizer)`.

  Called with each prompt (the whole context as text); returns the next step's tool call, or a
  summary when the loop asks for one. When the last observation lacks what the step about to be
  taken relies on, it sets `error` and raises PolicyError, which ends the episode.
  """

  def __init__(self, task: task_format.Task, steps: Sequence[dict],
               tokenizer: policy_lib.Tokenizer, summary_max_tokens: int,
               summary_request: str = agent_loop.SUMMARY_REQUEST,
               end_of_turn: str = toolcall.IM_END):
    self.task = task
    self.summary_request = summary_request
    self.tokenizer = tokenizer
    self.summary_max_tokens = summary_max_tokens
    self.end_of_turn = end_of_turn  # the turn format's (a chat template's, e.g. <|im_end|>)
    self.steps = list(steps)
    self.done = 0
    self.checked = 0
    self.summaries = 0
    self.last: str | None = None  # the oracle's last turn, as the prompts show it
    self.error: str | None = None

  def summary(self) -> str:
    """What the steps so far showed and the next action; the oldest facts go first if it
    would not fit in summary_max_tokens (with the end-of-turn marker)."""
    facts = [s["fact"] for s in self.steps[:self.done] if s["fact"]]
    while True:
      text = (f"Found: {'; '.join(facts) if facts else 'nothing'}. "
              f"Next: {_next_action(self.steps[self.done])}.")
      if len(self.tokenizer.encode(text + self.end_of_turn)) <= self.summary_max_tokens:
        return text
      if not facts:
        self._fail(f"{self.task.task_id}: no summary fits summary_max_tokens "
                   f"{self.summary_max_tokens}: {text!r}")
      facts.pop(0)

  def _fail(self, why: str) -> None:
    # A PolicyError ends the episode cleanly (the loop closes the sandbox); `error` tells it
    # apart from a real infrastructure failure.
    self.error = why
    raise policy_lib.PolicyError(why)

  def _check_last_observation(self, observation: str) -> None:
    """The observation of the step just taken must show what the next step relies on."""
    if not self.done or self.checked == self.done:
      return
    self.checked = self.done
    expect = self.steps[self.done - 1]["expect"]
    if expect not in observation:
      self._fail(f"{self.task.task_id}: step {self.done} ({self.steps[self.done - 1]['tool']}) "
                 f"should show {expect!r}; it showed {observation!r}")

  def __call__(self, prompt: str, index: int) -> str:
    del index
    # What the loop wrote after the oracle's last turn: the observation of the step just taken,
    # then the summary request when it asks for one. Read after the turn's own text, not by a
    # template's tags, so every turn format reads alike (a chat template writes tool results
    # and the request as tool messages, and a checkpoint's tokenizer decodes its tags to
    # nothing). A fresh context (after a summary) holds no observation: the summary carries
    # what it showed, and it was checked when the request came.
    at = prompt.rfind(self.last) if self.last else -1
    after = prompt[at + len(self.last):] if at >= 0 else ""
    asked = self.summary_request in after
    if after:
      self._check_last_observation(after.split(self.summary_request, 1)[0])
    if asked:
      self.summaries += 1
      self.last = self.summary()
      return self.last + self.end_of_turn
    if self.done >= len(self.steps):
      self._fail(f"{self.task.task_id}: asked for a step after submitting")
    step = self.steps[self.done]
    self.done += 1
    self.last = _call(step["tool"], step["args"])
    return self.last


@dataclasses.dataclass
class Transcript:
  """One oracle episode: its documents (one per context segment) and how it went."""
  task_id: str
  variant: str
  documents: list[str]
  segment_tokens: list[int]
  reward: float | None
  status: str
  summaries: int
  num_turns: int
  max_context_tokens: int


def _prompt_lengths(seg: traj_lib.Segment) -> list[int]:
  """Context length at each of the segment's completions (where a model run starts)."""
  return [i for i, m in enumerate(seg.model_mask) if m and (i == 0 or not seg.model_mask[i - 1])]


def _episode(task, steps, variant, *, pool, config, tokenizer
             ) -> tuple[Transcript, traj_lib.Trajectory]:
  for attempt in range(_INFRA_ATTEMPTS):
    oracle = Oracle(task, steps, tokenizer, config.summary_max_tokens, config.summary_request,
                    config.turns.end_of_turn)
    tr = agent_loop.run_episode(task, policy_lib.ScriptedPolicy(oracle, tokenizer), pool=pool,
                                config=config)
    if oracle.error:
      raise OracleError(oracle.error)
    if tr.status != traj_lib.INFRA:
      break
    # A sandbox that did not start (a loaded host) says nothing about the oracle: run again.
    if attempt + 1 == _INFRA_ATTEMPTS:
      raise RuntimeError(f"{task.task_id}: the sandbox failed {_INFRA_ATTEMPTS} times: "
                         f"{tr.infra_error}")
  # Special tokens kept: a checkpoint's tokenizer holds a chat template's tags (<|im_start|>)
  # as special tokens, which a plain decode drops. (The oracle's contexts hold no BOS or EOS:
  # ScriptedPolicy starts none and writes none.)
  docs = [tokenizer.decode(s.token_ids, skip_special=False) for s in tr.segments]
  return Transcript(task.task_id, variant, docs, [len(s.token_ids) for s in tr.segments],
                    tr.reward, tr.status, sum(s.ended_by_summary for s in tr.segments),
                    tr.num_turns, config.max_context_tokens), tr


def _check(t: Transcript, tr: traj_lib.Trajectory) -> None:
  if t.status != "ok" or t.reward != 1.0 or tr.finish_reason != "submitted":
    raise OracleError(f"{t.task_id} ({t.variant}): oracle episode ended {tr.finish_reason} with "
                      f"status {t.status}, reward {t.reward}: {tr.infra_error}")


def oracle_transcript(task: task_format.Task, variant: str, *, pool: pool_lib.WarmPool,
                      loop_config: agent_loop.LoopConfig, tokenizer: policy_lib.Tokenizer
                      ) -> Transcript:
  """Runs one oracle episode of `task` (train split only); raises OracleError unless reward 1.

  "summarised" first runs the plan with `loop_config`, then again with `max_context_tokens`
  just small enough that the loop asks for a summary before the fix (found from the first run's
  context lengths, then moved until the episode summarises and still succeeds).
  """
  if task.split != "train":
    raise ValueError(f"{task.task_id} is a {task.split!r} task; transcripts use train tasks only")
  steps = plan(task, variant)
  too_long = [s for s in steps if len(tokenizer.encode(_call(s["tool"], s["args"]))) >
              loop_config.max_tokens_per_turn]
  if too_long:
    raise ValueError(f"{task.task_id}: a tool call is longer than max_tokens_per_turn "
                     f"{loop_config.max_tokens_per_turn}: {too_long[0]}")
  t, tr = _episode(task, steps, variant, pool=pool, config=loop_config, tokenizer=tokenizer)
  _check(t, tr)
  if variant != "summarised" or t.summaries:
    return t
  # The context before the fix (the third step from the end) must no longer leave room for a
  # turn (agent_loop.room_for_a_turn).
  before_fix = _prompt_lengths(tr.segments[0])[len(steps) - 2]
  ctx = before_fix + agent_loop.room_for_a_turn(tokenizer.encode, loop_config) - 1
  for _ in range(8):
    config = dataclasses.replace(loop_config, max_context_tokens=ctx)
    try:
      t, tr = _episode(task, steps, variant, pool=pool, config=config, tokenizer=tokenizer)
    except OracleError:
      t = None
    if t is not None and t.summaries and t.reward == 1.0 and tr.finish_reason == "submitted":
      return t
    # No summary: the window is still too large; one that never let the episode finish: too
    # small (the fresh context must hold the instructions, the summary and the last turns).
    ctx += 24 if t is None or t.summaries else -24
  raise OracleError(f"{task.task_id}: found no context size that summarises and succeeds")


def transcript_records(tasks: Sequence[task_format.Task], pool: pool_lib.WarmPool, *,
                       loop_config: agent_loop.LoopConfig, tokenizer: policy_lib.Tokenizer,
                       seed: int = 0, mix: Mapping[str, float] = DEFAULT_MIX,
                       summarised_share: float = 0.25) -> list[Transcript]:
  """Oracle transcripts of the train tasks among `tasks` (held-out ones are skipped).

  Each train task gets one transcript of a variant drawn from `mix`, and with probability
  `summarised_share` a second, summarised one where one succeeds under `loop_config` (skipped,
  and logged, where none does). A variant the task has no plan for, or that
  cannot succeed under `loop_config` (say an observation the oracle needs is clipped to fit a
  small context), gives way to the others in VARIANTS order; if none succeeds, OracleError.
  Deterministic in `seed`.
  """
  unknown = set(mix) - {"direct", "tests_first", "wrong_first"}
  if unknown or not mix or any(w < 0 for w in mix.values()) or not sum(mix.values()):
    raise ValueError(f"mix must weigh direct, tests_first, wrong_first; got {dict(mix)}")
  if not 0 <= summarised_share <= 1:
    raise ValueError(f"summarised_share must be in [0, 1], got {summarised_share}")
  names, weights = zip(*sorted(mix.items()))
  out = []
  for task in tasks:
    if task.split != "train":
      continue
    rng = random.Random(f"{seed}-{task.task_id}")
    drawn = rng.choices(names, weights)[0]
    order = [drawn] + [v for v in VARIANTS[:3] if v != drawn]
    order = [v for v in order if v != "wrong_first" or task.metadata.get("wrong")]
    errors = []
    for variant in order:
      try:
        out.append(oracle_transcript(task, variant, pool=pool, loop_config=loop_config,
                                     tokenizer=tokenizer))
        break
      except OracleError as e:
        errors.append(f"{variant}: {e}")
    else:
      raise OracleError(f"{task.task_id}: no oracle variant succeeds under this loop config: "
                        + " | ".join(errors))
    if rng.random() < summarised_share:
      try:
        out.append(oracle_transcript(task, "summarised", pool=pool, loop_config=loop_config,
                                     tokenizer=tokenizer))
      except OracleError as e:  # the extra, summarised copy is best effort under this config
        log.info("%s: no summarised transcript under this loop config (%s)", task.task_id, e)
  return out


def stats(records: Sequence[Transcript]) -> dict:
  """Sizes of a transcript set: documents, tokens per segment (median, max), summarised
  episodes, transcripts per variant."""
  sizes = sorted(n for t in records for n in t.segment_tokens)
  variants: dict[str, int] = {}
  for t in records:
    variants[t.variant] = variants.get(t.variant, 0) + 1
  return {"transcripts": len(records), "documents": len(sizes),
          "median_segment_tokens": statistics.median(sizes) if sizes else 0,
          "max_segment_tokens": sizes[-1] if sizes else 0,
          "summarised_episodes": sum(t.summaries > 0 for t in records),
          "variants": variants}


def agent_transcripts(tasks: Sequence[task_format.Task], pool: pool_lib.WarmPool, *,
                      loop_config: agent_loop.LoopConfig, tokenizer: policy_lib.Tokenizer,
                      seed: int = 0, mix: Mapping[str, float] = DEFAULT_MIX,
                      summarised_share: float = 0.25) -> list[str]:
  """Pre-training documents: every segment of `transcript_records(...)`, decoded.

  Use the loop configuration of the RL run (tools, observation_max_chars, max_context_tokens,
  max_tokens_per_turn), so the documents are what the model will see there.
  """
  return [d for t in transcript_records(tasks, pool, loop_config=loop_config,
                                        tokenizer=tokenizer, seed=seed, mix=mix,
                                        summarised_share=summarised_share)
          for d in t.documents]
