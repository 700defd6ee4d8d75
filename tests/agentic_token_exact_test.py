"""Token-in/token-out through a live sampling server: what the learner trains on is exactly what
the sampler saw and wrote, turn by turn, across a self-summarisation and a weight swap.

A multi-turn repository episode runs through the RL path -- `envs.harness.attempts` over
`pipeline.sampler_policy.SamplerPolicy` over `pipeline.samplers.HttpSampler` -- against
`rollout.server` on a free port. Every request body and response the client exchanged is
recorded on the wire (the JSON the server parsed and answered). The learner's record
(`pipeline.episodes.from_trajectory`) must then be the server's prompt and completion token ids
concatenated: each segment's tokens are its last request's prompt plus the completion, each
request's prompt extends the previous one by exactly the previous completion and the harness's
observation tokens, the loss mask covers exactly the completion tokens, logprobs and per-token
policy versions are the server's, and routing on every position is the server's: decode routing
for positions it decoded, its prefill's `prompt_routing` for tool output and template text.

The model is a random tiny MoE, so its turns are malformed tool calls answered by error
observations: the episode still runs several turns, summarises itself when the small context
fills, and ends. Half-way through, the weights are swapped (same values, a new version) between
two turns, so the episode spans two policy versions.
"""

import dataclasses
import sys

import numpy as np
import pytest

from envs.harness import agent_loop
from envs.harness import attempts
from envs.harness import openai_policy
from envs.harness import toolcall
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_swe
from moe.tokenizer import ByteTokenizer
from pipeline import episodes as episodes_lib
from pipeline import sampler_policy
from pipeline import samplers as samplers_lib
from rollout import testing
from rollout.engine import Engine, EngineConfig

WAIT_S = 120
START_VERSION = 3
MAX_LEN = 2048


@pytest.fixture(scope="module")
def setup():
  model = testing.tiny_model(seed=5, max_seq_len=MAX_LEN)
  tok = ByteTokenizer()
  cfg = EngineConfig(max_slots=4, max_len=MAX_LEN, decode_steps=4, max_queue=16,
                     deterministic=True, eos_token_ids=(tok.eos_id,))
  engine = Engine(model, config=cfg, tokenizer=tok, version=START_VERSION)
  live = testing.LiveServer(engine, timeout_s=WAIT_S, model_name="tiny", request_timeout=WAIT_S)
  pool = pool_lib.WarmPool(size=2)
  yield engine, tok, live, pool
  pool.close()
  live.close()
  engine.stop()


def _recording(sampler, on_response):
  """Records every (request body, response) the sampler's client sends and gets."""
  wire = []
  post = sampler.client._post  # pylint: disable=protected-access

  def recorded(body, timeout_s=None):
    out = post(body, timeout_s)
    wire.append((body, out))
    on_response(len(wire))
    return out

  sampler.client._post = recorded  # pylint: disable=protected-access
  return wire


def test_the_learner_trains_exactly_what_the_server_saw_and_wrote(setup):
  engine, tok, live, pool = setup
  task = suite_swe.generate()[0]
  sampler = samplers_lib.HttpSampler(live.url, tokenizer=tok)

  def swap_after(i):
    if i == 2:  # between the second and the third request: the episode spans two versions
      engine.swap_weights(engine.current_flat(), version=START_VERSION + 1, timeout=WAIT_S)

  wire = _recording(sampler, swap_after)
  policy = sampler_policy.SamplerPolicy(samplers_lib.SamplerSet([sampler]), tok,
                                        timeout_s=WAIT_S)
  per_turn = 24
  loop = agent_loop.LoopConfig(max_turns=5, max_tokens_per_turn=per_turn, summary_max_tokens=16,
                               max_summaries=1)
  # A context that holds the opening prompt and about one turn: the episode must summarise.
  opening = len(policy.start_ids() + policy.encode(toolcall.initial_prompt(task.instructions)))
  loop = dataclasses.replace(loop, max_context_tokens=opening + 250 +
                             agent_loop.room_for_a_turn(policy.encode, loop))
  settings = attempts.AttemptSettings(mode="agent", temperature=1.0, loop=loop)
  trajs = attempts.run_attempts(task, policy, pool=pool, n=1, seed=11, settings=settings)
  tr, = trajs
  assert tr.status == "ok", tr.infra_error
  assert len(tr.segments) == 2 and tr.segments[0].ended_by_summary, tr.finish_reason
  assert tr.num_turns >= 2 and len(wire) >= 3

  # Each request continues its segment: prompt = the segment's tokens so far, exactly.
  requests = [(list(body["prompt"]), ch) for body, out in wire for ch in out["choices"]]
  by_segment, s = [[], []], 0
  for prompt, ch in requests:
    if by_segment[s] and prompt[:len(by_segment[s][-1][0])] != by_segment[s][-1][0]:
      s += 1  # a fresh context (after the summary)
    by_segment[s].append((prompt, ch))
  assert all(by_segment), "both segments must have requests"
  for seg, reqs in zip(tr.segments, by_segment):
    for (p, c), (p_next, _) in zip(reqs, reqs[1:]):
      # The next prompt = this prompt + the completion's ids + the harness's tokens.
      assert p_next[:len(p) + len(c["token_ids"])] == p + c["token_ids"]
    last_p, last_c = reqs[-1]
    assert seg.token_ids[:len(last_p) + len(last_c["token_ids"])] == last_p + last_c["token_ids"]
    assert not any(seg.model_mask[len(last_p) + len(last_c["token_ids"]):])  # template only

  ep = episodes_lib.from_trajectory(tr, group_id="g", episode_id="g-a0", group_size=1)
  assert list(ep.segment_lengths) == [len(s) for s in tr.segments]
  assert list(ep.tokens) == [t for s in tr.segments for t in s.token_ids]
  offset = 0
  saw_versions = set()
  for seg, reqs in zip(tr.segments, by_segment):
    n = len(seg)
    mask = np.zeros(n, np.int8)
    logp = np.zeros(n, np.float32)
    versions = np.zeros(n, np.int32)
    expect = np.full(ep.routing[:, offset:offset + n].shape, -1, np.int64)
    for p, c in reqs:
      ids = c["token_ids"]
      span = slice(len(p), len(p) + len(ids))
      mask[span] = 1
      logp[span] = c["logprobs"]["token_logprobs"]
      versions[span] = c["policy_versions"]
      saw_versions.update(c["policy_versions"])
      # Routing row j of the completion is position len(p)-1+j (the step fed the token before).
      expect[:, len(p) - 1:len(p) - 1 + len(ids)] = np.asarray(c["routing"])
    for p, c in reqs:  # prefill routing fills what no decode step covered, first prefill first
      pr = np.asarray(c["prompt_routing"])
      assert pr.shape[1] == len(p) - 1
      hole = expect[:, :len(p) - 1, :1] < 0
      expect[:, :len(p) - 1] = np.where(hole, pr, expect[:, :len(p) - 1])
    np.testing.assert_array_equal(ep.loss_mask[offset:offset + n], mask)
    np.testing.assert_array_equal(ep.behaviour_logprobs[offset:offset + n], logp)
    np.testing.assert_array_equal(ep.policy_versions[offset:offset + n], versions)
    fed = int(np.nonzero(expect[0, :, 0] >= 0)[0][-1])  # positions after it were never fed
    assert fed >= len(reqs[-1][0]) - 1
    assert np.all(expect[:, :fed + 1] >= 0), "the server left positions without routing"
    np.testing.assert_array_equal(ep.routing[:, offset:offset + fed + 1], expect[:, :fed + 1])
    offset += n
  # Observation tokens are context, not trained: the first segment holds tool output that the
  # mask leaves out, and whose routing came from a prefill.
  assert ep.loss_mask.sum() < len(ep.tokens) and ep.loss_mask.sum() == tr.num_model_tokens
  assert saw_versions == {START_VERSION, START_VERSION + 1}


def test_a_server_without_routing_is_a_clear_error_when_it_is_required():
  from envs.harness import replay_server  # pylint: disable=g-import-not-at-top
  tok = ByteTokenizer()
  with replay_server.ReplayServer(["hello"], tok, with_extras=False) as srv:
    pol = openai_policy.OpenAIPolicy(srv.base_url, "m", tok, require=("routing",))
    with pytest.raises(openai_policy.MissingField, match="'routing'.*router replay"):
      pol.complete(tok.encode("hi"), max_tokens=4)
    sampler = samplers_lib.HttpSampler(srv.base_url, tokenizer=tok,
                                       require=("token_ids", "logprobs", "routing"))
    policy = sampler_policy.SamplerPolicy(samplers_lib.SamplerSet([sampler]), tok, timeout_s=30)
    with pytest.raises(Exception, match="rejected"):
      policy.complete(tok.encode("hi"), max_tokens=4)
    assert isinstance(policy.rejected, samplers_lib.RequestRejected)
    assert "token_ids" in str(policy.rejected)  # the first missing field is named


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
