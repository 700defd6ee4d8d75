"""Pre-training pipeline: files -> tokens -> packed rows; checkpointed iterator state."""

import json
import sys

import numpy as np
import pytest

from moe.tokenizer import ByteTokenizer
from rl import pretrain_data


def _corpus(tmp_path, n=7):
  for i in range(n):
    sub = tmp_path / ("pkg" if i % 2 else "lib")
    sub.mkdir(exist_ok=True)
    (sub / f"m{i}.py").write_text(f"def f{i}(x):\n  return x * {i}\n" * (1 + i % 3))
  (tmp_path / "notes.bin").write_bytes(b"\x00\x01")  # not a code file: ignored
  return pretrain_data.corpus_files(str(tmp_path))


def test_packed_rows_cover_the_corpus(tmp_path):
  files = _corpus(tmp_path)
  assert len(files) == 7 and all(f.endswith(".py") for f in files)
  tok = ByteTokenizer()
  total = sum(len(tok.encode(open(f).read(), bos=True, eos=True)) for f in files)
  ds = pretrain_data.pretrain_dataset(files, seq_len=32, batch_rows=2, num_epochs=1, seed=1)
  batches = list(ds)
  assert batches[0]["tokens"].shape == (2, 32)
  seen = sum(int((b["segment_ids"] > 0).sum()) for b in batches)
  # Everything but the incomplete last batch is used; nothing is duplicated.
  assert total - 2 * 32 < seen <= total
  b = batches[0]
  np.testing.assert_array_equal(b["loss_mask"], (b["segment_ids"] > 0).astype(np.int32))
  first = b["tokens"][0]
  assert first[0] == tok.bos_id and b["positions"][0][0] == 0


def test_trained_spans_mask_what_is_context(tmp_path):
  """Only the pieces trained_spans marks are trained; the tokens are the whole text's."""
  (tmp_path / "conv.txt").write_text("ASK: what? SAY: yes. ASK: and? SAY: no.")
  (tmp_path / "code.py").write_text("x = 1\n")

  def spans(text):
    if not text.startswith("ASK"):
      return None  # not a conversation: every token trained
    return [(p, p.startswith("SAY")) for p in text.replace("SAY", "|SAY").replace(
        "ASK", "|ASK").split("|") if p]

  tok = ByteTokenizer()
  ds = pretrain_data.pretrain_dataset([str(tmp_path / "conv.txt"), str(tmp_path / "code.py")],
                                      seq_len=64, batch_rows=1, num_epochs=1, shuffle=False,
                                      trained_spans=spans)
  b = next(iter(ds))
  toks, mask = b["tokens"][0], b["loss_mask"][0]
  n_conv = len(tok.encode("ASK: what? SAY: yes. ASK: and? SAY: no.", bos=True, eos=True))
  conv = tok.decode(toks[:n_conv])
  assert conv == "ASK: what? SAY: yes. ASK: and? SAY: no."
  trained = tok.decode([t for t, m in zip(toks[:n_conv], mask[:n_conv]) if m])
  assert trained == "SAY: yes. SAY: no."
  code = toks[n_conv:n_conv + len(tok.encode("x = 1\n", bos=True, eos=True))]
  assert tok.decode(code) == "x = 1\n" and mask[n_conv:n_conv + len(code)].all()


def test_a_tokenizer_without_bos_starts_documents_with_their_text(tmp_path):
  """A checkpoint's tokenizer may have no BOS (Qwen's): documents are text + EOS, in both the
  whole-document and the trained-spans paths."""
  from moe import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from moe.hf import testutil  # pylint: disable=g-import-not-at-top
  testutil.bpe_tokenizer().save_pretrained(str(tmp_path / "tok"))
  tok = tokenizer_lib.for_model(str(tmp_path / "tok"), 400)
  assert tok.bos_id is None and tok.eos_id is not None
  text = "def add(a, b):\n    return a + b\n"
  (tmp_path / "a.py").write_text(text)
  for spans in (None, lambda text: [(text[:4], False), (text[4:], True)]):
    pieces = [text] if spans is None else [text[:4], text[4:]]  # each piece encoded alone
    want = [t for p in pieces for t in tok.encode(p)] + [tok.eos_id]
    ds = pretrain_data.pretrain_dataset([str(tmp_path / "a.py")], seq_len=len(want),
                                        batch_rows=1, num_epochs=1, shuffle=False,
                                        tokenizer=tok, trained_spans=spans)
    b = next(iter(ds))
    assert list(b["tokens"][0]) == want and b["positions"][0][0] == 0
    assert b["loss_mask"][0][-1] == (1 if spans is None else 0)  # EOS: trained only unmasked


def test_state_round_trip(tmp_path):
  files = _corpus(tmp_path)

  def make():
    return pretrain_data.pretrain_dataset(files, seq_len=16, batch_rows=2, seed=3)

  it = iter(make())
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  want = [next(it) for _ in range(4)]
  other = iter(make())
  other.set_state(state)
  for w in want:
    got = next(other)
    np.testing.assert_array_equal(got["tokens"], w["tokens"])
    np.testing.assert_array_equal(got["segment_ids"], w["segment_ids"])


def test_errors(tmp_path):
  with pytest.raises(ValueError, match="no files"):
    pretrain_data.corpus_files(str(tmp_path))
  with pytest.raises(ValueError):
    pretrain_data.pretrain_dataset([], seq_len=8, batch_rows=1)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
