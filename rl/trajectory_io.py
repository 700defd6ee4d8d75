"""Finished trajectories on disk: sharded msgpack record files in one directory.

The rollout side appends episodes with a `TrajectoryWriter`; each shard is written to a hidden
temporary name and renamed into place when complete, so readers only ever see whole shards.
Shard names are `<writer_id>-<sequence>.msgpack` (zero-padded), unique per writer, so many
writers can share a directory. The learner's RL pipeline lists finished shards and reads their
records by (shard, index), which is also how its checkpointed state refers to them.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Iterable, Optional

import msgpack

from rl.episodes import Episode

SUFFIX = ".msgpack"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+-\d{8}\.msgpack$")


class TrajectoryWriter:
  """Appends episodes to shard files in `directory`.

  Args:
    directory: the trajectory directory (created if absent).
    writer_id: unique name of this writer (letters, digits, '_', '.', '-').
    records_per_shard: a shard is finished and published after this many episodes.
  """

  def __init__(self, directory: str, writer_id: str, records_per_shard: int = 64):
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", writer_id):
      raise ValueError(f"writer_id {writer_id!r} must use letters, digits, '_', '.', '-'")
    if records_per_shard < 1:
      raise ValueError("records_per_shard must be >= 1")
    self.directory = directory
    self.writer_id = writer_id
    self.records_per_shard = records_per_shard
    os.makedirs(directory, exist_ok=True)
    self._buffer: list[bytes] = []
    self._seq = self._next_sequence()

  def _next_sequence(self) -> int:
    seqs = [int(n[len(self.writer_id) + 1:-len(SUFFIX)]) for n in list_shards(self.directory)
            if n.startswith(self.writer_id + "-")
            and n[len(self.writer_id) + 1:-len(SUFFIX)].isdigit()]
    return max(seqs, default=-1) + 1

  def write(self, episode: Episode) -> None:
    self._buffer.append(msgpack.packb(episode.to_record(), use_bin_type=True))
    if len(self._buffer) >= self.records_per_shard:
      self.flush()

  def write_all(self, episodes: Iterable[Episode]) -> None:
    for ep in episodes:
      self.write(ep)

  def flush(self) -> Optional[str]:
    """Publishes the buffered episodes as one shard; returns its name (None if empty)."""
    if not self._buffer:
      return None
    name = f"{self.writer_id}-{self._seq:08d}{SUFFIX}"
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
    with os.fdopen(fd, "wb") as f:
      for rec in self._buffer:
        f.write(rec)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, os.path.join(self.directory, name))
    self._buffer = []
    self._seq += 1
    return name

  def close(self) -> None:
    self.flush()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def list_shards(directory: str) -> list[str]:
  """Names of the finished shards in `directory`, sorted."""
  if not os.path.isdir(directory):
    return []
  return sorted(n for n in os.listdir(directory) if _NAME.match(n))


def read_shard(path: str) -> list:
  """All records of one shard as decoded msgpack objects. A corrupt tail is returned as one
  trailing `None` (the reader rejects it) instead of raising."""
  out = []
  with open(path, "rb") as f:
    unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False)
    try:
      for rec in unpacker:
        out.append(rec)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError):
      out.append(None)
  return out
