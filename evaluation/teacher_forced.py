"""Teacher-forced accuracy of an agent model's turns: a cheap probe during pre-training.

Running agent episodes costs minutes and scores 0 until the model gets every call of an episode
right, so it says little about a model that is still learning. This probe instead feeds oracle
transcripts (envs.tasks.transcripts) to the model and asks, for each of the model's turns,
whether greedy decoding under teacher forcing reproduces it exactly, every token, grouped by
what the turn does (the tool it calls, or "text" for a turn without a call: a summary). One
forward pass per batch of rows, at a fixed shape so it compiles once.

On transcripts of made-up-name tasks (names the model cannot have memorised) an exact
`read_file` or `edit_file` call means the model copied a name from its context: the skill every
repository task needs (BENCHMARKS.md, "Agentic RL").
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from envs.harness import toolcall

TEXT = "text"  # The label of a model turn that calls no tool (a summary, an answer).


@dataclasses.dataclass(frozen=True)
class Row:
  """One transcript as the model sees it: token ids (padded to the probe's length) and the
  model's turns as (start, end, label) token ranges."""
  ids: np.ndarray
  turns: tuple[tuple[int, int, str], ...]


def label(turn_text: str) -> str:
  """What a model turn does: the name of its first tool call, else TEXT."""
  calls = toolcall.parse(turn_text).calls
  return calls[0].name if calls else TEXT


def rows(documents: Sequence[str], tokenizer, seq_len: int) -> list[Row]:
  """The documents tokenized as pre-training tokenizes them (BOS, then each piece of
  `toolcall.assistant_spans` on its own, as rl.pretrain_data does with trained spans), cut to
  `seq_len`; a turn that does not fit whole is left out. Documents without model turns are
  refused (they are not transcripts)."""
  out = []
  for doc in documents:
    pieces = toolcall.assistant_spans(doc)
    if not pieces or not any(trained for _, trained in pieces):
      raise ValueError(f"not an agent transcript (no model turn): {doc[:80]!r}")
    ids, turns = [tokenizer.bos_id], []
    for piece, trained in pieces:
      enc = tokenizer.encode(piece)
      if trained and len(ids) + len(enc) <= seq_len:
        turns.append((len(ids), len(ids) + len(enc), label(piece)))
      ids += enc
    ids = ids[:seq_len]
    padded = np.zeros(seq_len, np.int32)
    padded[:len(ids)] = ids
    out.append(Row(padded, tuple(turns)))
  return out


def exact_turns(predict: Callable[[np.ndarray], np.ndarray], probe_rows: Sequence[Row], *,
                batch_rows: int = 8) -> dict[str, tuple[int, int]]:
  """{label: (turns reproduced exactly, turns)}, and "all" over every label.

  `predict` maps token ids [B, T] to the greedy next token at each position [B, T]; it always
  gets `batch_rows` rows (the last batch is padded), so a jitted predictor compiles once.
  """
  exact, total = collections.Counter(), collections.Counter()
  for i in range(0, len(probe_rows), batch_rows):
    chunk = list(probe_rows[i:i + batch_rows])
    x = np.zeros((batch_rows, len(chunk[0].ids)), np.int32)
    for b, r in enumerate(chunk):
      x[b] = r.ids
    pred = np.asarray(predict(x))
    for b, r in enumerate(chunk):
      for start, end, what in r.turns:
        # The token at j is predicted at position j - 1.
        ok = bool(np.all(pred[b, start - 1:end - 1] == r.ids[start:end]))
        for key in (what, "all"):
          exact[key] += ok
          total[key] += 1
  return {k: (exact[k], total[k]) for k in sorted(total)}


@nnx.jit
def _greedy(model, x):
  positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
  logits = model(x, positions=positions, segment_ids=jnp.ones_like(x)).logits
  return jnp.argmax(logits, axis=-1)


def greedy_predictor(model) -> Callable[[np.ndarray], np.ndarray]:
  """`model`'s greedy next token at every position of whole rows (one segment each). One jitted
  function for every model, so probing a model of the same shape again does not recompile."""
  return lambda x: jax.device_get(_greedy(model, jnp.asarray(x)))


def summary(result: dict[str, tuple[int, int]]) -> str:
  """One line: `all 12/40 (30%), edit_file 1/9, ...`."""
  parts = []
  for k, (ok, n) in sorted(result.items(), key=lambda kv: (kv[0] != "all", kv[0])):
    parts.append(f"{k} {ok}/{n}" + (f" ({100 * ok / n:.0f}%)" if k == "all" and n else ""))
  return ", ".join(parts)
