"""Device sampling: filters equal a sort-based reference, logprobs are under the sampled law,
randomness depends only on (seed, sample, token index)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout import sampling


def _reference_mask(scaled, k, p):
  """Top-k then top-p by sorting (the textbook definition)."""
  probs = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
  order = np.argsort(-probs, kind="stable")
  keep = np.zeros(probs.size, bool)
  kk = probs.size if k == 0 else min(k, probs.size)
  keep[order[:kk]] = True
  pk = np.where(keep, probs, 0)
  pk = pk / pk.sum()
  if p < 1:
    cum = np.cumsum(pk[order])
    n = int(np.searchsorted(cum, p - 1e-7) + 1)  # smallest prefix with mass >= p
    keep2 = np.zeros(probs.size, bool)
    keep2[order[:n]] = True
    keep &= keep2
  return keep


@pytest.mark.parametrize("k,p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (7, 0.8),
                                 (300, 0.95)])
def test_filter_mask_matches_sorting(k, p):
  rng = np.random.default_rng(k * 10 + int(p * 10))
  logits = rng.normal(size=(6, 259)).astype(np.float32) * 3
  got = np.asarray(sampling.filter_mask(jnp.asarray(logits), jnp.full(6, k, jnp.int32),
                                        jnp.full(6, p, jnp.float32)))
  for r in range(6):
    np.testing.assert_array_equal(got[r], _reference_mask(logits[r], k, p))


def _draw(logits, temp=1.0, k=0, p=1.0, seed=0, sample=0, tindex=0):
  b = logits.shape[0]
  return sampling.sample(jnp.asarray(logits), jnp.full(b, temp, jnp.float32),
                         jnp.full(b, k, jnp.int32), jnp.full(b, p, jnp.float32),
                         jnp.full(b, seed, jnp.uint32), jnp.full(b, sample, jnp.int32),
                         jnp.full(b, tindex, jnp.int32))[:2]


def test_logprob_is_under_the_sampling_distribution():
  logits = np.random.default_rng(0).normal(size=(1, 50)).astype(np.float32)
  for temp, k, p in [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.6), (0.5, 10, 0.9)]:
    tok, lp = _draw(logits, temp, k, p, seed=3)
    scaled = logits[0] / temp
    keep = _reference_mask(scaled, k, p)
    z = np.where(keep, scaled, -np.inf)
    want = z - np.log(np.exp(z - z.max()).sum()) - z.max()
    assert keep[int(tok[0])]
    np.testing.assert_allclose(float(lp[0]), want[int(tok[0])], atol=1e-5)


def test_top_alternatives_are_the_most_likely_under_the_sampled_law():
  logits = np.random.default_rng(2).normal(size=(3, 40)).astype(np.float32)
  b = 3
  tok, lp, top_lp, top_ids = sampling.sample(
      jnp.asarray(logits), jnp.full(b, 0.7), jnp.full(b, 4, jnp.int32), jnp.ones(b),
      jnp.zeros(b, jnp.uint32), jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32), top_n=5)
  for r in range(b):
    scaled = logits[r] / 0.7
    keep = _reference_mask(scaled, 4, 1.0)
    z = np.where(keep, scaled, -np.inf)
    want = z - z.max() - np.log(np.exp(z - z.max()).sum())
    order = np.argsort(-want, kind="stable")[:5]
    np.testing.assert_array_equal(np.asarray(top_ids[r, :4]), order[:4])
    np.testing.assert_allclose(np.asarray(top_lp[r, :4]), want[order[:4]], atol=1e-5)
    assert np.isneginf(np.asarray(top_lp[r, 4]))  # only 4 tokens survive top-k
    assert int(tok[r]) in order[:4].tolist()


def test_greedy_is_argmax_with_model_logprob():
  logits = np.random.default_rng(1).normal(size=(4, 30)).astype(np.float32)
  tok, lp = _draw(logits, temp=0.0, k=3, p=0.5)
  np.testing.assert_array_equal(tok, logits.argmax(-1))
  ref = jax.nn.log_softmax(logits, -1)[np.arange(4), logits.argmax(-1)]
  np.testing.assert_allclose(lp, ref, atol=1e-6)


def test_randomness_depends_only_on_seed_sample_and_token_index():
  logits = np.zeros((1, 1000), np.float32)
  a = int(_draw(logits, seed=7, sample=2, tindex=5)[0][0])
  # The same row inside a bigger batch with other rows around it draws the same token.
  big = np.zeros((9, 1000), np.float32)
  b = sampling.sample(jnp.asarray(big), jnp.ones(9), jnp.zeros(9, jnp.int32), jnp.ones(9),
                      jnp.asarray([1, 2, 3, 4, 7, 5, 6, 8, 9], jnp.uint32),
                      jnp.asarray([0, 0, 0, 0, 2, 0, 0, 0, 0], jnp.int32),
                      jnp.asarray([0, 1, 2, 3, 5, 0, 0, 0, 0], jnp.int32))[0]
  assert int(b[4]) == a
  draws = {int(_draw(logits, seed=7, sample=s, tindex=t)[0][0]) for s in range(3) for t in range(3)}
  assert len(draws) > 5  # different samples / positions draw differently


def test_empirical_frequencies_follow_the_distribution():
  probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
  n = 4000
  logits = np.tile(np.log(probs), (n, 1))
  toks = sampling.sample(jnp.asarray(logits), jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.ones(n),
                         jnp.full(n, 11, jnp.uint32), jnp.arange(n, dtype=jnp.int32),
                         jnp.zeros(n, jnp.int32))[0]
  freq = np.bincount(np.asarray(toks), minlength=4) / n
  # 4 standard errors of a binomial proportion at n=4000 is <= 0.032.
  np.testing.assert_allclose(freq, probs, atol=0.032)


def test_sampling_params_validation():
  with pytest.raises(ValueError, match="max_tokens"):
    sampling.SamplingParams(max_tokens=0)
  with pytest.raises(ValueError, match="top_p"):
    sampling.SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    sampling.SamplingParams(temperature=-1.0)
  with pytest.raises(ValueError, match="n must"):
    sampling.SamplingParams(n=0)
  with pytest.raises(ValueError, match="integer"):
    sampling.SamplingParams(max_tokens=2.5)



@pytest.mark.parametrize("field,value", [
    ("top_k", 2**31), ("top_k", -1), ("max_tokens", 2**31), ("n", 2**31), ("logprobs", 6),
    ("temperature", 1e-40), ("temperature", float("inf")), ("temperature", float("nan")),
    ("temperature", 10**400), ("temperature", True), ("top_p", 1e-40), ("top_p", float("nan")),
    ("top_p", 1.5), ("seed", 2**64), ("seed", -2**63 - 1), ("seed", 10**5000), ("seed", 1.0),
    ("stop_token_ids", (2**31,)), ("stop_token_ids", (True,)), ("stop_token_ids", {}),
    ("stop_token_ids", False), ("stop_token_ids", 0), ("stop", "\n"), ("stop", ("",)),
    ("ignore_eos", 1), ("top_k", 2.0)], ids=lambda v: v if isinstance(v, str) else type(v).__name__)
def test_values_the_engine_tables_cannot_hold_are_refused_naming_the_field(field, value):
  """Every numeric setting must fit the engine's int32 / float32 / uint32 slot tables (a top_k of
  2**31 used to pass and overflow them on the engine thread); the message names the field and
  stays short whatever the value."""
  with pytest.raises(ValueError, match=field) as e:
    sampling.SamplingParams(**{field: value})
  assert len(str(e.value)) < 200


def test_largest_values_that_fit_are_accepted_and_sequences_become_tuples():
  p = sampling.SamplingParams(top_k=2**31 - 1, max_tokens=2**31 - 1, seed=2**64 - 1,
                              temperature=sampling.MIN_TEMPERATURE, top_p=sampling.MIN_TOP_P,
                              stop_token_ids=[3, 2**31 - 1], stop=["a"])
  assert p.stop_token_ids == (3, 2**31 - 1) and p.stop == ("a",)
  assert sampling.SamplingParams(seed=-2**63, temperature=0, top_p=1).seed == -2**63
  hash(p)  # hashable: lists were stored as tuples


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
