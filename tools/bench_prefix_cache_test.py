"""Smoke run of the prefix-cache benchmark on tiny episodes: it runs end to end, and its prefill
accounting is exact (the figures follow from the lengths and the block size alone)."""

import json
import sys

import pytest

from tools import bench_prefix_cache


def test_quick_run(tmp_path):
  out = tmp_path / "r.json"
  assert bench_prefix_cache.main([
      "--episodes", "2", "--turns", "2", "3", "--prompt_len", "8", "--completion_len", "4",
      "--obs_len", "4", "--block_size", "4", "--repeats", "1", "--single_turn_prompts", "4",
      "--single_turn_len", "8", "--json", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  # Without the cache every turn prefills its whole prompt (8, 16, 24 tokens). With it, turn 0
  # prefills 8; its prompt + completion has KV for 11 tokens, two whole blocks of 4, so turn 1
  # (16 tokens) prefills 8; turn 1 leaves 19 tokens of KV, four blocks, so turn 2 (24) prefills 8.
  for name, off, on, unique in (("2 turns", 24, 16, 20), ("3 turns", 48, 24, 28)):
    assert rows[name]["off"]["prefill_tokens_per_episode"] == off
    assert rows[name]["on"]["prefill_tokens_per_episode"] == on
    assert rows[name]["on"]["unique_tokens_per_episode"] == unique
    assert rows[name]["off"]["cached_tokens_per_episode"] == 0
    assert rows[name]["on"]["episodes_per_s"] > 0 and rows[name]["off"]["episodes_per_s"] > 0
  for name in ("single turn, distinct prompts", "single turn, groups of n=4"):
    assert rows[name]["on"]["tokens_per_s"] > 0 and rows[name]["off"]["tokens_per_s"] > 0


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
