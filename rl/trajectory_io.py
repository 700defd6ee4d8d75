"""Finished trajectories on disk: sharded msgpack record files in one directory.

The rollout side appends episodes with a `TrajectoryWriter`; each shard is written to a hidden
temporary name and renamed into place when complete, so readers only ever see whole shards.
Shard names are `<writer_id>-<sequence>.msgpack` (zero-padded), unique per writer, so many
writers can share a directory. The learner's RL pipeline lists finished shards and reads their
records by (shard, index), which is also how its checkpointed state refers to them.

Missing data is detectable: a writer's sequence numbers start at 0 and have no holes, and every
record carries `writer_index`, its position in its writer's stream. A reader that finds shard
`w-n` while it has read `w` only up to `w-m`, m < n - 1, knows shards m+1..n-1 are missing, and
`writer_index` of `w-n`'s first record minus the records it has read of `w` is how many records
they held (`missing_before`, `first_index`). A hole at the END of a writer's stream has no later
shard to reveal it, so after each shard the writer also replaces `<writer_id>.progress.json`
({"next_seq", "next_index"}: what it has written so far), written after the shard itself; a reader
that sees progress past the shards it can find knows the tail is missing (`read_progress`). What
a reader does about a hole is its rule (rl.rl_data.TrajectorySource: wait for a bound, then raise
or count the records as lost).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Iterable, Mapping, Optional

import msgpack

from rl.episodes import Episode

SUFFIX = ".msgpack"
_NAME = re.compile(r"^([A-Za-z0-9_.-]+)-(\d{8})\.msgpack$")
# The record field holding the record's position in its writer's stream (0, 1, 2, ...).
INDEX_KEY = "writer_index"


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
    self._seq, self._index = self._resume()

  def _resume(self) -> tuple[int, int]:
    """(next sequence number, next writer_index): a reused writer id continues its stream."""
    seqs = [parse_name(n)[1] for n in list_shards(self.directory)
            if parse_name(n)[0] == self.writer_id]
    progress = read_progress(self.directory).get(self.writer_id)
    if progress is not None and (not seqs or progress["next_seq"] > max(seqs) + 1):
      return progress["next_seq"], progress["next_index"]  # its last shards went missing
    if not seqs:
      return 0, 0
    last = shard_name(self.writer_id, max(seqs))
    recs = read_shard(os.path.join(self.directory, last))
    start = first_index(recs)
    if start is None:
      raise ValueError(f"cannot continue writer {self.writer_id!r}: its last shard {last} "
                       f"carries no {INDEX_KEY}")
    return max(seqs) + 1, start + len(recs)

  def write(self, episode: Episode) -> None:
    rec = episode.to_record()
    rec[INDEX_KEY] = self._index
    self._buffer.append(msgpack.packb(rec, use_bin_type=True))
    self._index += 1
    if len(self._buffer) >= self.records_per_shard:
      self.flush()

  def write_all(self, episodes: Iterable[Episode]) -> None:
    for ep in episodes:
      self.write(ep)

  def flush(self) -> Optional[str]:
    """Publishes the buffered episodes as one shard; returns its name (None if empty)."""
    if not self._buffer:
      return None
    name = shard_name(self.writer_id, self._seq)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
    with os.fdopen(fd, "wb") as f:
      for rec in self._buffer:
        f.write(rec)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, os.path.join(self.directory, name))
    self._buffer = []
    self._seq += 1
    _write_atomic(os.path.join(self.directory, progress_name(self.writer_id)),
                  json.dumps({"next_seq": self._seq, "next_index": self._index}).encode())
    return name

  def close(self) -> None:
    self.flush()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


PROGRESS_SUFFIX = ".progress.json"
_PROGRESS = re.compile(r"^([A-Za-z0-9_.-]+)\.progress\.json$")


def _write_atomic(path: str, data: bytes) -> None:
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
  with os.fdopen(fd, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def progress_name(writer_id: str) -> str:
  return writer_id + PROGRESS_SUFFIX


def read_progress(directory: str) -> dict:
  """writer id -> {"next_seq", "next_index"} as each writer last recorded (see the module
  docstring). An unreadable progress file is skipped: it only ever adds a check."""
  out = {}
  if not os.path.isdir(directory):
    return out
  for n in os.listdir(directory):
    m = _PROGRESS.match(n)
    if m is None:
      continue
    try:
      with open(os.path.join(directory, n), "rb") as f:
        rec = json.loads(f.read())
      out[m.group(1)] = {"next_seq": int(rec["next_seq"]), "next_index": int(rec["next_index"])}
    except (OSError, ValueError, KeyError, TypeError):
      continue
  return out


def shard_name(writer_id: str, seq: int) -> str:
  return f"{writer_id}-{seq:08d}{SUFFIX}"


def parse_name(name: str) -> tuple[str, int]:
  """`"w-00000003.msgpack"` -> ("w", 3); raises ValueError for a name that is not a shard's."""
  m = _NAME.match(name)
  if m is None:
    raise ValueError(f"{name!r} is not a trajectory shard name (<writer>-<8 digits>{SUFFIX})")
  return m.group(1), int(m.group(2))


def missing_before(name: str, next_seq: Mapping[str, int]) -> list[str]:
  """The shards of `name`'s writer that must come before it and have not been read.

  `next_seq` maps a writer id to the sequence number the reader expects next from it (0 for a
  writer it has not read yet).
  """
  writer, seq = parse_name(name)
  return [shard_name(writer, j) for j in range(next_seq.get(writer, 0), seq)]


def first_index(records: list) -> Optional[int]:
  """`writer_index` of a shard's first record (None if the shard or the field is absent)."""
  if not records or not isinstance(records[0], dict):
    return None
  value = records[0].get(INDEX_KEY)
  return int(value) if isinstance(value, int) else None


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
