"""Multi-turn RL through the in-process pipeline: repository tasks run as agent episodes (tool
calls, observations, self-summarisation) by the controller, and the learner trains them.

The model is random, so its turns are malformed tool calls answered by error observations; the
episodes still take several turns and, in a small context window, summarise themselves. Grading
is replaced by a test double that alternates rewards 0 and 1 (a random model passes no hidden
test, and a group of equal rewards gives the policy gradient nothing); everything else -- the
harness, the samplers, the records, the learner with router replay -- is the real path.
"""

import dataclasses
import itertools
import os
import sys
import threading

import pytest

from envs import reward as reward_lib
from envs.harness import agent_loop
from envs.harness import toolcall
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_repo
from moe import sharding
from moe.tokenizer import ByteTokenizer
from pipeline import local
from pipeline import testing
from rl import learner as learner_lib
from rl import testing as rl_testing
from rl import trajectory_io
from rl.episodes import Episode

MAX_LEN = 1024
PER_TURN = 16


def _alternating_grade():
  count = itertools.count()
  lock = threading.Lock()

  def grade(task, files, pool, config, hack_flags=None):
    del task, files, pool, config
    with lock:
      r = float(next(count) % 2)
    return reward_lib.Grade(status=reward_lib.OK, reward=r, test_reward=r, outcomes={},
                            hack_flags=dict(hack_flags or {}))
  return grade


def _loop(tasks) -> agent_loop.LoopConfig:
  """A context window that holds each task's opening prompt and about one turn."""
  tok = ByteTokenizer()
  base = agent_loop.LoopConfig(max_turns=3, summary_max_tokens=12, max_summaries=1,
                               max_tokens_per_turn=PER_TURN, tools=suite_repo.TOOLS)
  opening = max(1 + len(tok.encode(toolcall.initial_prompt(t.instructions, suite_repo.TOOLS)))
                for t in tasks)
  return dataclasses.replace(
      base, max_context_tokens=opening + agent_loop.room_for_a_turn(tok.encode, base) + 200)


def test_multi_turn_episodes_are_trained(tmp_path):
  tasks = suite_repo.split(suite_repo.generate(), "train")[:2]
  loop = _loop(tasks)
  assert loop.max_context_tokens <= MAX_LEN - 32
  model = testing.MODEL.replace(max_seq_len=MAX_LEN)
  cfg = testing.config(max_staleness=1, max_new_tokens=PER_TURN, seq_len=MAX_LEN,
                       batch_rows=8, attempts=2, prompts_per_step=2)
  learner = learner_lib.build_learner(testing.LEARNER, model,
                                      mesh=sharding.make_mesh((1, 1, 1, 1)), seed=0,
                                      max_staleness=1)
  engine_cfg = dataclasses.replace(testing.ENGINE, max_len=MAX_LEN)
  steps = []
  with pool_lib.WarmPool(size=2) as pool:
    res = local.run(learner=learner, tasks=tasks, pool=pool, workdir=str(tmp_path), config=cfg,
                    num_steps=2, engine_config=engine_cfg, loop_config=loop,
                    grade_fn=_alternating_grade(),
                    on_step=lambda s, m, i: steps.append(
                        (s, dict(i), dict(m, trained_episodes=i["trained_episodes"]))))
  assert res.steps == 2 and res.groups == 4
  assert res.batcher["trained_episodes"] == 8 and res.batcher["overflow_episodes"] == 0
  rl_testing.assert_steps_trained([m for _, _, m in steps], steps=2)
  initial, _ = testing.published_weights(str(tmp_path), 0)
  final, version = res.learner.sampler_weights()
  assert version == 2
  rl_testing.assert_weights_changed(initial, final)

  ctl = res.controller
  assert ctl["episodes_written"] == 8 and ctl["episodes_lost"] == 0
  assert ctl["mean_turns"] >= 1.5, ctl  # several turns: error observations keep it going
  assert ctl["summarised_episodes"] >= 1, ctl  # the small window made some summarise
  d = os.path.join(str(tmp_path), "trajectories")
  eps = [Episode.from_record(r) for n in trajectory_io.list_shards(d)
         for r in trajectory_io.read_shard(os.path.join(d, n))]
  assert len(eps) == 8
  bos = ByteTokenizer().bos_id
  summarised = [e for e in eps if e.segment_lengths is not None]
  assert summarised, "no record carries its context segments"
  for e in eps:
    bounds = e.segment_bounds()
    assert all(e.tokens[s] == bos for s, _ in bounds)  # every context starts as sent: BOS
    assert e.routing is not None and e.routing.shape[1] == e.tokens.size
    # Harness text (the system prompt, error observations) is context, not trained.
    assert 0 < e.loss_mask.sum() < e.tokens.size
    assert not e.loss_mask[bounds[0][0]:bounds[0][0] + 40].any()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
