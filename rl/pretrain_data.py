"""The continual pre-training grain pipeline: code files -> tokens -> packed rows -> batches.

Files are shuffled per epoch (grain's index shuffle, seeded), read as UTF-8 (undecodable bytes
replaced), tokenised with BOS/EOS, concatenated and split into rows of `seq_len` (grain's
concat-then-split: segment ids and positions restart with each document piece), so no token is
wasted on padding except at the very end. The iterator's state is grain's (a few integers), which
the trainer checkpoints with the train state.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import grain
import grain.experimental as grain_exp
import numpy as np

from moe.tokenizer import ByteTokenizer

CODE_EXTENSIONS = (".py", ".c", ".cc", ".h", ".rs", ".go", ".js", ".ts", ".java", ".sh", ".md")


def corpus_files(root: str, extensions: Sequence[str] = CODE_EXTENSIONS) -> list[str]:
  """Sorted paths of the files under `root` with one of `extensions`."""
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    out.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(tuple(extensions)))
  if not out:
    raise ValueError(f"no files with extensions {tuple(extensions)} under {root}")
  return sorted(out)


class _Encode(grain.transforms.Map):

  def __init__(self, tokenizer, trained_spans=None):
    self.tokenizer = tokenizer
    self.trained_spans = trained_spans

  def map(self, path: str) -> dict:
    with open(path, "rb") as f:
      text = f.read().decode("utf-8", errors="replace")
    pieces = self.trained_spans(text) if self.trained_spans is not None else None
    # A document starts with BOS when the tokenizer has one (a checkpoint's may not: Qwen's).
    bos = self.tokenizer.bos_id is not None
    if pieces is None:
      ids = self.tokenizer.encode(text, bos=bos, eos=True)
      return {"tokens": np.asarray(ids, np.int32), "trained": np.ones(len(ids), np.int32)}
    tok = self.tokenizer
    ids, trained = ([tok.bos_id], [0]) if bos else ([], [])
    for piece, train in pieces:
      enc = tok.encode(piece)
      ids += enc
      trained += [int(train)] * len(enc)
    ids.append(tok.eos_id)
    trained.append(0)
    return {"tokens": np.asarray(ids, np.int32), "trained": np.asarray(trained, np.int32)}


def _to_batch(packed: dict) -> dict:
  seg = packed["tokens_segment_ids"]
  return {"tokens": packed["tokens"], "positions": packed["tokens_positions"],
          "segment_ids": seg, "loss_mask": ((seg > 0) & (packed["trained"] > 0)).astype(np.int32)}


def pretrain_dataset(files: Sequence[str], *, seq_len: int, batch_rows: int, seed: int = 0,
                     shuffle: bool = True, num_epochs: Optional[int] = None,
                     tokenizer=None, trained_spans=None) -> grain.IterDataset:
  """Batches of {tokens, positions, segment_ids, loss_mask} [batch_rows, seq_len] from `files`.

  Args:
    files: source files (see `corpus_files`).
    seq_len: row length.
    batch_rows: rows per batch.
    seed: shuffle seed.
    shuffle: shuffle file order (differently every epoch).
    num_epochs: passes over the files (None: forever).
    tokenizer: anything with encode(text, bos=, eos=), bos_id and eos_id; the byte tokenizer by
      default. Documents start with BOS only when it has one (a Qwen checkpoint's has none).
    trained_spans: which tokens of a document are trained: text -> [(piece, trained)] whose
      pieces concatenate to the text (each piece encoded on its own), or None to train the
      whole document. Agent transcripts train only the model's turns, as supervised
      fine-tuning on agent trajectories does: the system prompt, tool output and
      instructions stay context (they are not the model's to predict, and a held-out task's
      files cannot be guessed), and the model's capacity goes to its actions.
  """
  if not files:
    raise ValueError("pretrain_dataset needs at least one file")
  ds = grain.MapDataset.source(list(files))
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)
  ds = ds.map(_Encode(tokenizer or ByteTokenizer(), trained_spans))
  it = grain_exp.ConcatThenSplitIterDataset(ds.to_iter_dataset(),
                                            length_struct={"tokens": seq_len, "trained": seq_len})
  return it.batch(batch_rows, drop_remainder=True).map(_to_batch)
