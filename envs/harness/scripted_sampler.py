"""A test double for the sampler: a scripted `generate` callable for `InProcessPolicy`.

Scripted responses stand in for the model; everything else in the tests that use it (envs and
evaluation: sandboxes, HTTP, graders) is real.
"""

import dataclasses

import numpy as np

from moe import tokenizer as tokenizer_lib

TOK = tokenizer_lib.ByteTokenizer()


@dataclasses.dataclass
class Comp:
  token_ids: list
  logprobs: list
  routing: np.ndarray
  policy_versions: object


def scripted_generate(bodies, version=3):
  """A generate callable whose i-th sample is bodies[i % len] (+ EOS), with fake routing."""
  calls = []

  def generate(prompt_token_ids, *, n, max_tokens, temperature, stop_token_ids, seed):
    calls.append(dict(prompt=list(prompt_token_ids), n=n, max_tokens=max_tokens,
                      stop_token_ids=stop_token_ids, seed=seed))
    out = []
    for i in range(n):
      ids = (TOK.encode(bodies[i % len(bodies)]) + [TOK.eos_id])[:max_tokens]
      routing = np.arange(2 * len(ids) * 2).reshape(2, len(ids), 2)
      out.append(Comp(ids, [-0.1 * (j + 1) for j in range(len(ids))], routing, version))
    return out

  generate.calls = calls
  return generate
