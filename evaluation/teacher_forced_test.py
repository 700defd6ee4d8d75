"""Tests for the teacher-forced probe of an agent model's turns."""

import sys

import jax.numpy as jnp
import numpy as np
import pytest

from envs.harness import toolcall
from evaluation import teacher_forced
from moe import tokenizer as tokenizer_lib
from rollout import testing

TOK = tokenizer_lib.ByteTokenizer()
CALL = '<tool_call>\n{"name":"read_file","arguments":{"path":"hoda.py"}}\n</tool_call>'


def _transcript(summary="Found: hoda.py. Next: submit."):
  return (toolcall.initial_prompt("Read hoda.py.", ("read_file", "submit"))
          + CALL + toolcall.IM_END + "\n"
          + toolcall.render_responses(["x = 1"])
          + summary + toolcall.IM_END + "\n")


def _shifted(rows):
  """A predictor that knows every row: the next token at each position."""
  table = {r.ids.tobytes(): np.concatenate([r.ids[1:], [0]]) for r in rows}
  return lambda x: np.stack([table.get(row.tobytes(), np.zeros_like(row)) for row in x])


def test_rows_mark_the_model_turns_with_what_they_do():
  (row,) = teacher_forced.rows([_transcript()], TOK, 512)
  assert [t[2] for t in row.turns] == ["read_file", teacher_forced.TEXT]
  texts = [TOK.decode(row.ids[a:b].tolist()) for a, b, _ in row.turns]
  assert texts == [CALL + toolcall.IM_END, "Found: hoda.py. Next: submit." + toolcall.IM_END]
  assert row.ids[0] == TOK.bos_id and len(row.ids) == 512


def test_a_turn_cut_by_the_row_length_is_left_out():
  full = teacher_forced.rows([_transcript()], TOK, 512)[0]
  cut_at = full.turns[1][0] + 3  # inside the summary turn
  (row,) = teacher_forced.rows([_transcript()], TOK, cut_at)
  assert [t[2] for t in row.turns] == ["read_file"] and len(row.ids) == cut_at


def test_exact_turns_counts_a_turn_only_when_every_token_is_right():
  docs = [_transcript(), _transcript("Found: x = 1."), _transcript()]
  rows = teacher_forced.rows(docs, TOK, 512)
  perfect = _shifted(rows)
  assert teacher_forced.exact_turns(perfect, rows, batch_rows=2) == {
      "all": (6, 6), "read_file": (3, 3), "text": (3, 3)}

  # One wrong token: the last of the second document's call (its prediction sits one earlier).
  start, end, _ = rows[1].turns[0]

  def one_wrong(x):
    pred = perfect(x)
    for b in range(len(x)):
      if np.array_equal(x[b], rows[1].ids):
        pred[b, end - 2] += 1
    return pred

  assert teacher_forced.exact_turns(one_wrong, rows, batch_rows=2) == {
      "all": (5, 6), "read_file": (2, 3), "text": (3, 3)}
  # The predictor always gets full batches, so a jitted one compiles once.
  shapes = []
  teacher_forced.exact_turns(lambda x: shapes.append(x.shape) or perfect(x), rows, batch_rows=2)
  assert shapes == [(2, 512), (2, 512)]
  assert "all 5/6 (83%)" in teacher_forced.summary(
      teacher_forced.exact_turns(one_wrong, rows, batch_rows=2))


def test_documents_without_model_turns_are_refused():
  with pytest.raises(ValueError, match="not an agent transcript"):
    teacher_forced.rows(["def f():\n    return 1\n"], TOK, 64)


def test_greedy_predictor_is_the_models_argmax():
  model = testing.tiny_model(seed=0)
  x = np.asarray([TOK.encode(_transcript(), bos=True)[:64]] * 2, np.int32)
  got = teacher_forced.greedy_predictor(model)(x)
  logits = model(jnp.asarray(x), positions=jnp.broadcast_to(jnp.arange(64), x.shape),
                 segment_ids=jnp.ones_like(jnp.asarray(x))).logits
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(logits, -1)))


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-v"]))
