"""`envs.harness.openai_policy` against the real sampling server (`rollout.server`) on a free port.

Why here and not in envs/: envs is below rollout (no envs library imports rollout), so the test
that joins the two lives in the cross-package test package.

The engine behind the server is also called directly with the same request: in deterministic
mode (dropless experts, fixed shapes) and greedy or seeded decoding, the engine's own result is
the truth the policy's parsed `Completion` must equal -- tokens and routing exactly, logprobs
exactly (JSON carries Python floats losslessly), the policy version that produced each token.
A policy that misparses the response (routing transposed or dropped, logprobs shifted, the
version ignored, choices out of order, a stop string appended twice) fails these tests.
"""

import sys

import numpy as np
import pytest

from envs.harness import openai_policy
from envs.harness import single_turn
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_pyfunc
from moe import params as moe_params
from moe import tokenizer as tokenizer_lib
from rollout import testing
from rollout.engine import Engine, EngineConfig

START_VERSION = 7
PROMPT = [72, 105]  # "Hi"
WAIT_S = 120  # bound on every wait for the server's loop thread


@pytest.fixture(scope="module")
def engine():
  model = testing.tiny_model(seed=3)
  tok = tokenizer_lib.for_model(None, model.config.vocab_size)
  cfg = EngineConfig(max_slots=4, max_len=64, decode_steps=4, max_queue=16, deterministic=True,
                     eos_token_ids=(tok.eos_id,))
  eng = Engine(model, config=cfg, tokenizer=tok, version=START_VERSION)
  yield eng
  eng.stop()


@pytest.fixture(scope="module")
def policy(engine):
  live = testing.LiveServer(engine, timeout_s=WAIT_S, model_name="tiny", request_timeout=WAIT_S)
  yield openai_policy.OpenAIPolicy(live.url, "tiny", engine.tokenizer, timeout_s=WAIT_S)
  live.close()


def _assert_same(comp, ref, version):
  """The policy's Completion carries exactly what the engine produced."""
  assert comp.token_ids == ref.token_ids
  assert comp.logprobs == ref.logprobs  # exact: JSON round-trips Python floats
  assert comp.policy_versions == [version] * len(ref.token_ids)
  assert comp.routing.dtype == np.int32
  np.testing.assert_array_equal(comp.routing, ref.routing)


def test_greedy_completion_matches_the_engine(engine, policy):
  cfg = engine.model_config
  comp, = policy.complete(PROMPT, max_tokens=12, temperature=0.0)
  ref, = engine.generate(PROMPT, max_tokens=12, temperature=0.0)
  assert len(ref.token_ids) == 12 and ref.finish_reason == "length"
  assert comp.routing.shape == (cfg.num_moe_layers, 12, cfg.num_experts_per_tok)
  _assert_same(comp, ref, START_VERSION)
  assert comp.finish_reason == "length" and comp.stop_appended == ""
  assert comp.text == engine.tokenizer.decode(ref.token_ids)

  # Other weights under a new version: the version and the routing follow the swap.
  engine.swap_weights(moe_params.flatten(testing.tiny_model(seed=4)), version=START_VERSION + 1)
  after, = policy.complete(PROMPT, max_tokens=12, temperature=0.0)
  ref_after, = engine.generate(PROMPT, max_tokens=12, temperature=0.0)
  _assert_same(after, ref_after, START_VERSION + 1)
  assert not np.array_equal(after.routing, comp.routing)


def test_sampled_choices_match_the_engine_by_index(engine, policy):
  comps = policy.complete(PROMPT, max_tokens=10, temperature=1.0, seed=11, n=3)
  refs = engine.generate(PROMPT, max_tokens=10, temperature=1.0, seed=11, n=3)
  assert len({tuple(r.token_ids) for r in refs}) == 3, "the three samples should differ"
  for comp, ref in zip(comps, refs):
    _assert_same(comp, ref, engine.version)


def test_stop_string_is_cut_where_the_engine_cuts_it(engine, policy):
  tok = engine.tokenizer
  free, = engine.generate(PROMPT, max_tokens=30, temperature=0.0)
  # A two-character stop string the greedy continuation writes past its first token, so the
  # request ends there: the first pair of printable ASCII tokens.
  toks = free.token_ids
  i = next(i for i in range(1, len(toks) - 1) if all(32 < t < 127 for t in toks[i:i + 2]))
  stop = tok.decode(toks[i:i + 2])
  assert tok.decode(toks).find(stop) == len(tok.decode(toks[:i])), "an earlier match"
  comp, = policy.complete(PROMPT, max_tokens=30, temperature=0.0, stop=[stop])
  ref, = engine.generate(PROMPT, max_tokens=30, temperature=0.0, stop=[stop])
  assert ref.finish_reason == "stop" and comp.finish_reason == "stop"
  _assert_same(comp, ref, engine.version)
  assert ref.token_ids == toks[:len(ref.token_ids)]
  # Whatever part of the stop string the server's ids do not hold is handed to the harness to
  # add as template tokens, once: the text then ends with exactly one copy of the stop string.
  assert comp.text + comp.stop_appended == tok.decode(toks[:i + 2])
  assert comp.text == tok.decode(ref.token_ids)


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=2) as p:
    yield p


def test_single_turn_trajectories_carry_the_server_fields(engine, policy, pool):
  """The harness path: prompt tokens, then the model's, with the engine's logprobs, versions
  and routing in the trajectory (template tokens: none of those)."""
  task = next(t for t in suite_pyfunc.generate() if t.entry_point == "add_3")
  trs = single_turn.run_single_turn(task, policy, pool=pool, n=2, max_tokens=12, temperature=1.0,
                                    seed=5)
  refs = engine.generate(policy.encode(task.prompt), n=2, max_tokens=12, temperature=1.0, seed=5,
                         stop=single_turn.STOP)
  prompt_len = len(policy.encode(task.prompt))
  for tr, ref in zip(trs, refs):
    assert tr.status == "ok", tr.infra_error  # graded (a refused request is an infra error)
    seg, = tr.segments
    n = len(ref.token_ids)
    assert seg.token_ids == policy.encode(task.prompt) + ref.token_ids
    assert seg.model_mask == [False] * prompt_len + [True] * n
    # The reference request finds the server's request's prompt in the engine's prefix cache:
    # the same tokens and routing, logprobs within float32 rounding (rollout.testing.ATOL).
    np.testing.assert_allclose(seg.logprobs[prompt_len:], ref.logprobs, rtol=0,
                               atol=testing.ATOL)
    assert seg.policy_versions == [-1] * prompt_len + [engine.version] * n
    routing = seg.routing  # row t: the step whose input was token t (prompt routing not asked)
    assert np.all(routing[:, :prompt_len - 1] == -1) and np.all(routing[:, -1] == -1)
    np.testing.assert_array_equal(routing[:, prompt_len - 1:prompt_len - 1 + n], ref.routing)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
