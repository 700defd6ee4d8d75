"""The multi-turn agent loop: model text -> tool calls -> observations, until submit or a limit.

The context is kept as token ids: harness text is tokenized once and the model's own tokens are
appended exactly as sampled, so the trajectory holds precisely the tokens the sampler saw, with
no re-tokenization drift. The harness text is written in a turn format (`turn_format`): the
project's template by default, or the model's own chat template (`LoopConfig.chat`).

Limits: turns, generated tokens, wall time (task limits unless the config overrides them), plus
the context window, handled by self-summarisation: when the next turn might not fit, the model is
asked to summarise its progress, and the episode continues in a fresh context (system prompt,
instructions and the summary). Each context is one `Segment`.

Failures of the fleet (the sandbox breaks, the sampler errors) end the episode with status
"infra_error" and reward None. Malformed tool calls are the model's: they get an error
observation and the episode goes on.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from envs import hacks
from envs import reward as reward_lib
from envs import sandbox as sandbox_lib
from envs.harness import agent_tools
from envs.harness import policy as policy_lib
from envs.harness import toolcall
from envs.harness import trajectory as traj_lib
from envs.harness import turn_format
from envs.sandbox import pool as pool_lib
from envs.sandbox import slot as slot_lib
from envs.tasks import task_format

SUMMARY_REQUEST = (
    "The context is full. Summarise your progress so far for yourself: what the task is, what "
    "you found, what you changed, and what is left. Do not call tools.")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """Agent loop settings; None means "take it from the task's limits"."""
  max_turns: int | None = None
  max_total_tokens: int | None = None
  wall_s: float | None = None
  max_tokens_per_turn: int = 1024
  max_context_tokens: int = 8192
  max_calls_per_turn: int = 4
  summary_max_tokens: int = 512
  max_summaries: int = 3
  temperature: float = 1.0
  top_p: float = 1.0
  seed: int | None = None
  observation_max_chars: int = 4000
  reward: reward_lib.RewardConfig = reward_lib.RewardConfig()
  # The tools the system prompt lists (None: all of toolcall.TOOL_SPECS). Small models with
  # small context windows get a short list.
  tools: tuple[str, ...] | None = None
  # The user turn that asks for the summary when the context is full (small windows want a
  # short one: the loop keeps room for it in every context).
  summary_request: str = SUMMARY_REQUEST
  # The model's chat template (`turn_format.ChatTurns`, built by the caller from the model's
  # checkpoint): agent turns are written in it, tool results as its tool messages, and each
  # model turn ends at its end-of-turn token. None: the project's template (`toolcall`), for
  # models without one.
  chat: turn_format.ChatTurns | None = None

  @property
  def turns(self) -> turn_format.TurnFormat:
    """The turn format episodes are written in."""
    return self.chat if self.chat is not None else turn_format.PROJECT


def chat_for(tasks, tokenizer, eos_token_ids=()) -> turn_format.ChatTurns | None:
  """`LoopConfig.chat` for the agent episodes of `tasks` by the model whose tokenizer is
  `tokenizer`: the turns of its chat template when it has one (`turn_format.chat_turns`, its
  turns ending at the end-of-turn token among `eos_token_ids`, the checkpoint's EOS list), else
  None (the project's template, the one the project's own models are pre-trained on).

  Where a run decides it (experiment.run: its transcripts, evaluations and RL; the multi-process
  controller, pipeline.processes), so every part writes a model's episodes alike. None as well
  when no task of `tasks` runs as an agent episode (each has a single-turn prompt): the loop is
  not used, and a template it could not use must not stop such a run.

  Raises:
    turn_format.ChatTemplateUnfit (a ValueError): agent tasks and a chat template the loop
      cannot write episodes in exactly.
  """
  if all(t.prompt for t in tasks):
    return None
  return turn_format.chat_turns(tokenizer, eos_token_ids)


_OMITTED = "[output omitted: the context is full]"


def _budget(encode: Callable[[str], list], config: "LoopConfig") -> tuple[int, int]:
  """(reserve, turn slack) in tokens.

  reserve: room kept free in every context so the summary request, the summary and its closing
    template tokens always fit.
  turn slack: what a turn may add besides the model's tokens: its closing template tokens and at
    least the shortest observation.
  A turn starts only with room for max_tokens_per_turn, the slack and the reserve, so no context
  grows past max_context_tokens.
  """
  fmt = config.turns
  closing = len(encode(fmt.closing(False))) + max((len(encode(s)) for s in fmt.turn_stop),
                                                  default=0)
  summary = encode(fmt.summary_request((), config.summary_request))
  omitted = encode(fmt.observations([_OMITTED]) + fmt.header([_OMITTED]))
  return len(summary) + config.summary_max_tokens + closing, closing + len(omitted)


def room_for_a_turn(encode: Callable[[str], list], config: "LoopConfig") -> int:
  """Free tokens a context needs for the loop to give the model another turn (else it
  summarises): max_tokens_per_turn plus the turn's slack and the summary reserve."""
  reserve, slack = _budget(encode, config)
  return config.max_tokens_per_turn + slack + reserve


class _Budget(Exception):
  def __init__(self, reason):
    super().__init__(reason)
    self.reason = reason


def initial_prompt(instructions: str, config: LoopConfig) -> str:
  """The text that opens every context: system prompt (tool list), instructions, assistant."""
  return config.turns.opening(toolcall.system_prompt(config.tools), instructions)


def run_episode(task: task_format.Task, policy: policy_lib.Policy, *, pool: pool_lib.WarmPool,
                config: LoopConfig = LoopConfig(),
                grade_fn: Callable[..., reward_lib.Grade] = reward_lib.grade
                ) -> traj_lib.Trajectory:
  """Runs one episode of `task` with `policy`; always returns a Trajectory.

  Every context (segment) starts with `policy.start_ids()` (in the project's template; a chat
  template writes its own start) and is sent to the policy whole, so the segment's tokens are
  exactly the tokens the sampler saw and wrote. `grade_fn` grades the final files
  (envs.reward.grade's signature; the RL controller passes a memoised one).

  Raises:
    ValueError: the opening prompt leaves no room for a turn, or a chat template's end of turn
      is not one token of the policy's tokenizer (checked before any sandbox starts).
  """
  t0 = time.monotonic()
  timings = {"sandbox_start_s": 0.0, "generate_s": 0.0, "tools_s": 0.0, "grade_s": 0.0}
  max_turns = config.max_turns or task.limits.max_turns
  max_total = config.max_total_tokens or task.limits.max_tokens
  wall_s = config.wall_s or task.limits.wall_s
  fmt = config.turns
  segments = [traj_lib.Segment()]
  records: list[traj_lib.ToolCallRecord] = []
  state = {"generated": 0, "turns": 0, "malformed": 0, "summaries": 0}

  def opening(instructions: str) -> list[int]:
    start = policy.start_ids() if fmt.uses_start_ids else []
    return start + policy.encode(initial_prompt(instructions, config))

  initial = opening(task.instructions)
  end_ids = policy.encode(fmt.end_of_turn) if fmt.end_is_token else []
  if fmt.end_is_token and len(end_ids) != 1:
    raise ValueError(f"the chat template's end of turn {fmt.end_of_turn!r} is {len(end_ids)} "
                     "tokens of the policy's tokenizer, not one: turns cannot stop at it")

  def fail(reason: str, finish: str = "error") -> traj_lib.Trajectory:
    timings["total_s"] = time.monotonic() - t0
    return traj_lib.Trajectory(
        task_id=task.task_id, segments=segments, tool_calls=records, status=traj_lib.INFRA,
        reward=None, test_reward=None, hack_flags={}, finish_reason=finish,
        num_turns=state["turns"], timings=timings, infra_error=reason,
        malformed_calls=state["malformed"])

  def generate(seg, max_tokens, stop):
    left = max_total - state["generated"]
    if left <= 0:
      raise _Budget("max_tokens")
    if time.monotonic() - t0 > wall_s:
      raise _Budget("wall_time")
    t = time.monotonic()
    seed = None if config.seed is None else config.seed + state["generated"]
    # The end-of-turn id is asked for only when there is one: policies written for the
    # project's template need not take the keyword.
    ends = {"stop_token_ids": end_ids} if end_ids else {}
    comp = policy.complete(seg.token_ids, max_tokens=min(max_tokens, left), stop=stop,
                           temperature=config.temperature, seed=seed, top_p=config.top_p,
                           **ends)[0]
    timings["generate_s"] += time.monotonic() - t
    state["generated"] += len(comp.token_ids)
    seg.add_completion(comp)
    return comp

  def close_turn(seg, comp):
    """Template tokens that end the model's turn: what the model did not write of its close
    (all of it when the turn stopped at </tool_call> or ran out of tokens)."""
    if comp.stop_appended:
      seg.add_text_tokens(policy.encode(comp.stop_appended))
      comp.text += comp.stop_appended
    ended = (comp.text.rstrip().endswith(fmt.end_of_turn) or
             bool(end_ids) and comp.token_ids[-1:] == end_ids)
    closing = fmt.closing(ended)
    if closing:
      seg.add_text_tokens(policy.encode(closing))

  reserve, turn_slack = _budget(policy.encode, config)
  closing_max = len(policy.encode(fmt.closing(False)))
  header_len = len(policy.encode(fmt.header([_OMITTED])))

  def clip(observations, make, room):
    """(observations, make(observations)) with each observation cut to one length so that
    the tokens fit in `room`; [_OMITTED] when not even 64 characters of each fit (the next
    turn will summarise)."""
    ids = make(observations)
    limit = max(len(o) for o in observations)
    cut = list(observations)
    while len(ids) > room and limit > 64:
      limit //= 2
      cut = [o if len(o) <= limit else o[:limit] + "\n...[clipped to fit the context]"
             for o in observations]
      ids = make(cut)
    if len(ids) > room:
      cut = [_OMITTED]
      ids = make(cut)
    return cut, ids

  def observation_ids(observations):
    return policy.encode(fmt.observations(observations))

  def fits_a_turn(n: int) -> bool:
    return n + config.max_tokens_per_turn + turn_slack + reserve <= config.max_context_tokens

  if not fits_a_turn(len(initial)):
    raise ValueError(
        f"task {task.task_id}: the opening prompt takes {len(initial)} tokens, which leaves no "
        f"room in max_context_tokens={config.max_context_tokens} for one turn "
        f"({config.max_tokens_per_turn} tokens + {turn_slack} of template and observation) and "
        f"the summary reserve ({reserve}); raise max_context_tokens or shorten the prompt")

  t = time.monotonic()
  try:
    sb = sandbox_lib.Sandbox(task.files, pool=pool)
  except (slot_lib.SlotError, OSError) as e:
    return fail(f"sandbox did not start: {e}")
  timings["sandbox_start_s"] = time.monotonic() - t
  box = agent_tools.ToolBox(sb, task, observation_max_chars=config.observation_max_chars,
                            tool_names=config.tools)
  segments[0].add_text_tokens(initial)
  finish = "max_turns"
  # The tool results of the last turn, clipped, and their ids: added to the context when the
  # next step is known. Then the header that opens the model's next turn follows them, or the
  # summary request does (a chat template may write the request into the results' message), so
  # no empty assistant turn is left open before a summary request.
  pending, pending_ids = None, []
  try:
    while state["turns"] < max_turns:
      seg = segments[-1]
      header = policy.encode(fmt.header(pending)) if pending else []
      if not fits_a_turn(len(seg) + len(pending_ids) + len(header)):
        if state["summaries"] >= config.max_summaries or not any(seg.model_mask):
          # Out of summaries, or a fresh context (instructions + summary) with no room for a
          # turn: summarising again would only grow it.
          finish = "context"
          break

        def request(observations):
          return policy.encode(fmt.summary_request(observations, config.summary_request))

        ids = request(pending or ())
        room = config.max_context_tokens - len(seg) - config.summary_max_tokens - closing_max
        if pending and len(ids) > room:  # a template that writes the request longer after them
          ids = clip(pending, request, room)[1]
        seg.add_text_tokens(ids)
        pending, pending_ids = None, []
        comp = generate(seg, config.summary_max_tokens, fmt.summary_stop)
        close_turn(seg, comp)
        seg.ended_by_summary = True
        state["summaries"] += 1
        summary = comp.text.replace(fmt.end_of_turn, "").strip()
        fresh = traj_lib.Segment()
        fresh.add_text_tokens(opening(
            f"{task.instructions}\n\nSummary of your progress so far:\n{summary}"))
        segments.append(fresh)
        continue
      seg.add_text_tokens(pending_ids + header)
      pending, pending_ids = None, []
      comp = generate(seg, config.max_tokens_per_turn, fmt.turn_stop)
      state["turns"] += 1
      close_turn(seg, comp)
      parsed = toolcall.parse(comp.text)
      observations = []
      if not parsed.order:
        state["malformed"] += 1
        observations.append(
            "error: no tool call found. Call a tool like <tool_call>\n{\"name\": \"run_tests\", "
            "\"arguments\": {}}\n</tool_call>, or call submit when done.")
      for kind, i in parsed.order[:config.max_calls_per_turn]:
        if kind == "error":
          state["malformed"] += 1
          observations.append("error: " + parsed.errors[i])
          continue
        call = parsed.calls[i]
        t = time.monotonic()
        obs, ok = box.call(call.name, call.arguments)
        dt = time.monotonic() - t
        timings["tools_s"] += dt
        records.append(traj_lib.ToolCallRecord(state["turns"], call.name, call.arguments, ok,
                                               obs[:1000], dt))
        observations.append(obs)
        if box.submitted:
          break
      if box.submitted:
        finish = "submitted"
        break
      # Clipped so the context keeps room for the summary (and the next turn's header).
      pending, pending_ids = clip(
          observations, observation_ids,
          config.max_context_tokens - reserve - len(seg) - header_len)
    # The episode ends with the last turn's results in its context, as the model would have
    # seen them.
    segments[-1].add_text_tokens(pending_ids)
    final_files, _ = sb.slot.read_files()
  except _Budget as b:
    finish = b.reason
    try:
      final_files, _ = sb.slot.read_files()
    except (slot_lib.SlotError, ValueError) as e:
      sb.close()
      return fail(f"could not read final files: {e}")
  except agent_tools.InfraFailure as e:
    sb.close()
    return fail(f"sandbox failed: {e}")
  except policy_lib.PolicyError as e:
    sb.close()
    return fail(f"policy failed: {e}")
  except turn_format.ChatTemplateUnfit as e:
    sb.close()
    return fail(f"chat template failed: {e}")
  except (slot_lib.SlotError, ValueError) as e:
    sb.close()
    return fail(f"sandbox failed: {e}")
  sb.close()
  flags = hacks.detect(task, final_files, commands=box.commands, read_paths=box.read_paths,
                       events=box.events)
  t = time.monotonic()
  grade = grade_fn(task, final_files, pool=pool, config=config.reward, hack_flags=flags)
  timings["grade_s"] = time.monotonic() - t
  timings["total_s"] = time.monotonic() - t0
  return traj_lib.Trajectory(
      task_id=task.task_id, segments=segments, tool_calls=records, status=grade.status,
      reward=grade.reward, test_reward=grade.test_reward, hack_flags=grade.hack_flags,
      finish_reason=finish, num_turns=state["turns"], timings=timings,
      infra_error=grade.detail if grade.status != reward_lib.OK else None,
      malformed_calls=state["malformed"], test_outcomes=grade.outcomes, final_files=final_files)
