"""Tests for the agent transcripts: real oracle episodes of the train tasks, every one earning
reward 1, in exactly the harness's rendering, with no held-out task in them."""

import json
import statistics
import sys

import pytest

from envs.harness import agent_loop
from envs.harness import toolcall
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_repo
from envs.tasks import transcripts
from moe import tokenizer as tokenizer_lib

TOK = tokenizer_lib.ByteTokenizer()
TASKS = suite_repo.generate()
CONFIG = agent_loop.LoopConfig(tools=suite_repo.TOOLS, observation_max_chars=300,
                               max_tokens_per_turn=128, summary_max_tokens=96,
                               max_context_tokens=1536)


@pytest.fixture(scope="module")
def pool():
  with pool_lib.WarmPool(size=2) as p:
    yield p


@pytest.fixture(scope="module")
def records(pool):
  # Every task, held-out ones included: the function must leave those out itself.
  return transcripts.transcript_records(TASKS, pool, loop_config=CONFIG, tokenizer=TOK)


def test_every_train_task_gets_a_transcript_with_reward_one(records):
  train = {t.task_id for t in suite_repo.split(TASKS, "train")}
  assert {r.task_id for r in records} == train
  assert all((r.status, r.reward) == ("ok", 1.0) for r in records)
  st = transcripts.stats(records)
  assert set(st["variants"]) == set(transcripts.VARIANTS), st
  assert all(n >= 30 for n in st["variants"].values()), st
  assert st["summarised_episodes"] >= 40, st
  # The figures for the record (seen with -s).
  print(json.dumps(st))
  assert st["max_segment_tokens"] <= CONFIG.max_context_tokens
  unsummarised = [sum(r.segment_tokens) for r in records if not r.summaries]
  assert statistics.median(unsummarised) < 1100, statistics.median(unsummarised)


def test_no_heldout_task_in_the_documents(records, pool):
  docs = "\n".join(d for r in records for d in r.documents)
  by_id = {t.task_id: t for t in TASKS}

  def mark(task):
    """A string only this task's episodes show: the failing assertion where the test fails at
    one (const, op: suite-wide unique), else the fix (unique too: a misspelt name)."""
    if task.metadata["template"] in ("const", "op"):
      return next(l.strip() for l in task.files[task.visible_tests[0]].splitlines()
                  if l.strip().startswith("assert "))
    return json.dumps({k: task.metadata["fix"][k] for k in ("path", "old", "new")},
                      separators=(",", ":"))[1:-1]

  # The check can see a task: every direct or tests_first transcript shows its mark.
  for r in records:
    if r.variant in ("direct", "tests_first"):
      assert mark(by_id[r.task_id]) in "\n".join(r.documents), r.task_id
  for t in suite_repo.split(TASKS, "test"):
    assert mark(t) not in docs, t.task_id
    with pytest.raises(ValueError, match="transcripts use train tasks only"):
      transcripts.oracle_transcript(t, "direct", pool=pool, loop_config=CONFIG, tokenizer=TOK)
  assert transcripts.agent_transcripts(suite_repo.split(TASKS, "test")[:5], pool,
                                       loop_config=CONFIG, tokenizer=TOK) == []


def test_documents_are_the_harness_rendering(records):
  by_id = {t.task_id: t for t in TASKS}
  for r in records:
    task = by_id[r.task_id]
    assert [len(TOK.encode(d)) for d in r.documents] == r.segment_tokens
    first = r.documents[0]
    assert first.startswith(toolcall.initial_prompt(task.instructions, suite_repo.TOOLS))
    assert r.documents[-1].rstrip().endswith(
        '<tool_call>\n{"name":"submit","arguments":{}}\n</tool_call><|im_end|>')
    for i, doc in enumerate(r.documents[:-1]):  # Every segment but the last ends summarised.
      head, _, summary = doc.rpartition(agent_loop.SUMMARY_REQUEST)
      assert head and summary.startswith("<|im_end|>\n<|im_start|>assistant\nFound: ")
      said = summary.split("assistant\n", 1)[1].replace("<|im_end|>", "").strip()
      assert r.documents[i + 1].startswith(toolcall.initial_prompt(
          f"{task.instructions}\n\nSummary of your progress so far:\n{said}", suite_repo.TOOLS))
    for doc in r.documents:
      for m in doc.split("<tool_call>\n")[1:]:
        call = json.loads(m.split("\n</tool_call>")[0])
        assert call["name"] in suite_repo.TOOLS


def test_wrong_first_transcripts_show_failing_feedback_then_the_fix(records):
  by_id = {t.task_id: t for t in TASKS}
  wrong = [r for r in records if r.variant == "wrong_first"]
  assert wrong
  for r in wrong:
    task = by_id[r.task_id]
    text = "\n".join(r.documents)
    shown = text.find(task.metadata["wrong"]["shows"])
    fixed = text.rfind(f'"new":{json.dumps(task.metadata["fix"]["new"])}')
    assert 0 < shown < fixed, r.task_id


def test_oracle_reacts_to_what_it_is_shown(pool):
  # A repository already fixed: the visible tests pass, so the failure the tests_first plan
  # relies on is not shown and the oracle stops instead of writing a fix it has no reason for.
  task = next(t for t in suite_repo.split(TASKS, "train") if t.metadata["template"] == "const")
  fixed = type(task)(**{**task.__dict__, "files": suite_repo.solved_files(task)})
  with pytest.raises(transcripts.OracleError, match="should show"):
    transcripts.oracle_transcript(fixed, "tests_first", pool=pool, loop_config=CONFIG,
                                  tokenizer=TOK)


def test_small_context_summarises_and_still_succeeds(pool):
  config = agent_loop.LoopConfig(tools=suite_repo.TOOLS, observation_max_chars=300,
                                 max_tokens_per_turn=128, summary_max_tokens=96,
                                 max_context_tokens=1024)
  sample = suite_repo.split(TASKS, "train")[::20]
  recs = transcripts.transcript_records(sample, pool, loop_config=config, tokenizer=TOK, seed=3)
  assert len(recs) >= len(sample)
  assert all(r.reward == 1.0 and r.summaries >= 1 for r in recs)


def test_bad_mix_is_refused(pool):
  with pytest.raises(ValueError, match="mix must weigh"):
    transcripts.transcript_records(TASKS[:1], pool, loop_config=CONFIG, tokenizer=TOK,
                                   mix={"summarised": 1.0})


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
