"""The multi-process deployment runs multi-turn episodes: a learner, a sampler server and a
controller as separate processes, the controller driving repository tasks through the agent
loop (tool calls over HTTP sampling, observations, sandboxes) and the learner training them.

The model speaks a byte-level BPE, as the agentic experiment's does: its init checkpoint has the
tokenizer.json beside it and every part is given that directory, so the episodes the learner
trains on are in the BPE's ids (their contexts open with the BPE's encoding of the prompt)."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from envs.harness import agent_loop
from envs.harness import toolcall
from envs.tasks import suite_repo
from moe import build
from moe import checkpoint as moe_checkpoint
from moe.tokenizer import BPETokenizer, ByteTokenizer
from pipeline import processes
from pipeline import testing
from rl import trajectory_io
from rl.episodes import Episode

LOOP_KW = dict(max_turns=3, max_context_tokens=1000, tools=suite_repo.TOOLS,
               observation_max_chars=240, summary_max_tokens=32)
LOOP = agent_loop.LoopConfig(**LOOP_KW)
PRELUDE = f"""
import logging
logging.basicConfig(level=logging.WARNING)
from envs.harness import agent_loop
from envs.tasks import suite_repo
from pipeline import processes, testing
cfg = testing.config(max_staleness=1, max_new_tokens=48, seq_len=1024, batch_rows=8, attempts=2)
loop = agent_loop.LoopConfig(**{LOOP_KW!r})
"""
TASKS = suite_repo.split(suite_repo.generate(), "train")


def _bpe_model(directory: str) -> BPETokenizer:
  """A BPE trained on the train tasks' opening prompts and files, and a tiny model of its
  vocabulary saved in `directory` with the tokenizer.json beside it."""
  texts = [agent_loop.initial_prompt(t.instructions, LOOP) for t in TASKS[:40]]
  texts += [c for t in TASKS[:40] for c in t.files.values()]
  bpe = BPETokenizer.train(texts, 300, extra_tokens=toolcall.TEMPLATE_TOKENS)
  model = testing.MODEL.replace(vocab_size=bpe.vocab_size, max_seq_len=1024)
  moe_checkpoint.save_params(build.create(model, seed=0), directory)
  bpe.save(directory)
  return bpe


def test_multi_turn_episodes_over_separate_processes(tmp_path):
  work = str(tmp_path / "work")
  model_dir = str(tmp_path / "model")
  bpe = _bpe_model(model_dir)
  logs = {n: str(tmp_path / f"{n}.log") for n in ("learner", "s0", "controller")}
  procs: dict[str, subprocess.Popen] = {}
  try:
    procs["learner"] = testing.spawn(PRELUDE + f"""
processes.run_learner({work!r}, testing.MODEL, cfg, testing.LEARNER, steps=2,
                      init_checkpoint={model_dir!r})
""", logs["learner"])
    port = testing.free_port()
    procs["s0"] = testing.spawn(PRELUDE + f"""
processes.run_sampler({work!r}, port={port}, max_slots=8, max_len=1024,
                      tokenizer_dir={model_dir!r})
""", logs["s0"])
    url = f"http://127.0.0.1:{port}"
    # The controller starts beside the sampler (its imports overlap the sampler's start-up) and
    # waits for it itself before its first request; the test fails here if the sampler exits.
    procs["controller"] = testing.spawn(PRELUDE + f"""
from testlib import waiting
waiting.wait_until(lambda: waiting.url_answers({url!r} + "/health"), {url!r}, timeout_s=300,
                   poll_s=0.05)
tasks = suite_repo.split(suite_repo.generate(), "train")[:4]
n = processes.run_controller({work!r}, [{url!r}], cfg, steps=2, pool_size=2, tasks=tasks,
                             loop_config=loop, tokenizer_dir={model_dir!r})
print("groups written", n)
""", logs["controller"])
    testing.wait_http(url, procs["s0"], logs["s0"])
    assert procs["controller"].wait(timeout=600) == 0, open(logs["controller"]).read()[-3000:]
    assert procs["learner"].wait(timeout=600) == 0, open(logs["learner"]).read()[-3000:]
  finally:
    for p in procs.values():
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  out = open(logs["controller"]).read()
  assert "groups written 4" in out, out[-3000:]
  steps = processes.parse_step_lines(open(logs["learner"]).read())
  assert [s["step"] for s in steps] == [1, 2] and all(s["trained_episodes"] == 4 for s in steps)
  d = os.path.join(work, "trajectories")
  eps = [Episode.from_record(r) for s in trajectory_io.list_shards(d)
         for r in trajectory_io.read_shard(os.path.join(d, s))]
  assert len(eps) == 8 and not any(e.infra_failure for e in eps)
  by_id = {t.task_id: t for t in TASKS}
  for e in eps:
    # Several model turns with harness text (observations) between them: runs of trained
    # tokens separated by untrained ones, every position routed (prefill routing of the
    # observations came back over HTTP).
    runs = np.count_nonzero(np.diff(e.loss_mask.astype(np.int8)) == 1)
    assert runs >= 2, e.episode_id
    assert e.routing is not None and e.routing.shape[1] == e.tokens.size
    # In the BPE's ids: the first context opens with the BPE's encoding of the task's prompt
    # (about half as many ids as its bytes), ids past the bytes' occur, and the tokens decode
    # with the BPE to chat-template text, a user turn (observations) between assistant turns.
    task = by_id[e.group_id.split("-", 1)[1]]
    opening = agent_loop.initial_prompt(task.instructions, LOOP)
    prompt = [bpe.bos_id] + bpe.encode(opening)
    assert e.tokens[:len(prompt)].tolist() == prompt, e.episode_id
    assert len(prompt) < 0.7 * len(ByteTokenizer().encode(opening))
    assert ByteTokenizer().vocab_size <= e.tokens.max() < bpe.vocab_size
    text = bpe.decode(e.tokens, skip_special=False)
    assert text.startswith("<bos>" + opening), text[:300]
    assert text.count("<|im_start|>assistant\n") >= 2 and text.count("<|im_start|>user\n") >= 2


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
