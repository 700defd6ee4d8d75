"""Tiny pipeline fixtures for tests: a small model, learner, tasks and settings, and the
weights a run published (the end-to-end tests compare the first and last versions)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from typing import Optional, Sequence

import numpy as np

from envs.tasks import suite_pyfunc
from moe import sharding
from moe.config import ModelConfig
from pipeline import episodes as episodes_lib
from pipeline.config import PipelineConfig
from rl import learner as learner_lib
from rl import trajectory_io
from rl.train_state import OptimizerConfig
from rl.train_step import LossConfig
from rollout.engine import Completion, EngineConfig
from sync import publisher as publisher_lib
from sync import store as store_lib

MODEL = ModelConfig(vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                    num_experts_per_tok=2, max_seq_len=128, tie_word_embeddings=True)
ENGINE = EngineConfig(max_slots=8, max_len=128, decode_steps=8)
# The tests' learner settings, in-process (`learner`) and in the multi-process learner
# (pipeline.processes.run_learner) alike.
LEARNER = learner_lib.LearnerConfig(optimizer=OptimizerConfig(learning_rate=1e-3),
                                    loss=LossConfig(objective="policy"), sampler_dtype="float32")


def tasks(n: int = 6):
  return suite_pyfunc.split(suite_pyfunc.generate(), "train")[:n]


def config(**kw) -> PipelineConfig:
  base = dict(max_staleness=1, prompts_per_step=2, attempts=4, max_new_tokens=12, seq_len=96,
              batch_rows=8, grade_workers=2)
  base.update(kw)
  return PipelineConfig(**base)


def learner(max_staleness: int = 1, seed: int = 0) -> learner_lib.Learner:
  return learner_lib.build_learner(LEARNER, MODEL, mesh=sharding.make_mesh((1, 1, 1, 1)),
                                   seed=seed, max_staleness=max_staleness)


def write_steps(traj_dir: str, steps: int, cfg: PipelineConfig,
                versions: Optional[Sequence[int]] = None) -> list[str]:
  """The records of `steps` learner steps of MODEL, one group per shard, as the controller
  writes them, so that learner tests decide everything but the records; step s's tokens come
  from policy version versions[s] (default s). Returns the shard names in order."""
  w = trajectory_io.TrajectoryWriter(traj_dir, "controller-1", records_per_shard=cfg.attempts)
  moe_layers, k, experts = MODEL.num_moe_layers, MODEL.num_experts_per_tok, MODEL.num_experts
  prompt = [256, 40, 41, 42, 43]
  for s in range(steps):
    v = s if versions is None else versions[s]
    for g in range(cfg.prompts_per_step):
      gid = f"g{s * cfg.prompts_per_step + g:06d}"
      eps = []
      for j in range(cfg.attempts):
        n = 4 + j
        # Token t of the completion went to experts t, t+1, ... (mod E): every expert is used.
        routing = (np.arange(k)[None, None] + np.arange(n)[None, :, None]) % experts
        comp = Completion(token_ids=[60 + (j + g) % 30] * n, logprobs=[-1.0] * n,
                          routing=np.broadcast_to(routing, (moe_layers, n, k)).astype(np.uint8),
                          policy_versions=[v] * n, finish_reason="stop",
                          prompt_routing=np.zeros((moe_layers, len(prompt) - 1, k), np.uint8))
        eps.append(episodes_lib.from_completion(
            group_id=gid, episode_id=f"{gid}-a{j}", group_size=cfg.attempts, prompt_ids=prompt,
            completion=comp, reward=float(j % 2)))
      w.write_all(eps)
      w.flush()
  w.close()
  return trajectory_io.list_shards(traj_dir)


def published_weights(workdir: str, version: Optional[int] = None) -> tuple[dict, int]:
  """(flat weights, version) a run published to <workdir>/weights (default: the newest).

  Version 0 is the learner's initial weights (pipeline.learner_loop publishes them before the
  first step), so version 0 against the newest shows whether training moved the weights.
  """
  url = "file://" + os.path.join(os.path.abspath(workdir), "weights")
  return publisher_lib.restore(store_lib.Store(url), version)


# -- pipeline parts as processes ---------------------------------------------------------------
def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def spawn(code: str, log_path: str) -> subprocess.Popen:
  """Runs `code` in a new Python process (its own session, so a test can kill its group), with
  this process's import path; stdout and stderr go to `log_path`."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
             PYTHONUNBUFFERED="1")
  f = open(log_path, "w")  # pylint: disable=consider-using-with
  return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=f,
                          stderr=subprocess.STDOUT, start_new_session=True)


def wait_http(url: str, proc: subprocess.Popen, log: str, timeout: float = 300) -> None:
  """Waits until `url`/health answers; fails loudly when the process exits or time runs out."""
  t0 = time.time()
  while time.time() - t0 < timeout:
    if proc.poll() is not None:
      raise AssertionError(f"{url}: the process exited: {open(log).read()[-3000:]}")
    try:
      with urllib.request.urlopen(url + "/health", timeout=2):
        return
    except OSError:
      time.sleep(0.5)
  raise AssertionError(f"{url} did not come up in {timeout}s: {open(log).read()[-3000:]}")


def ready_delta_kernels(work_dir: str) -> None:
  """Readies the delta kernels in this process: a delta of the test model published to a store
  under `work_dir` and applied compiles them into (or loads them from) the on-disk kernel
  cache, sync.delta.jit's default directory (under Bazel the test's own), which the processes a
  test starts share. Parts that need them at start-up (samplers) or at their first delta (the
  learner), all at once, then load them instead of each compiling them."""
  from moe import build  # pylint: disable=g-import-not-at-top
  from moe import params as moe_params  # pylint: disable=g-import-not-at-top
  from pipeline import processes  # pylint: disable=g-import-not-at-top
  from pipeline.local import WeightChannel  # pylint: disable=g-import-not-at-top
  url = processes.paths(work_dir)["weights"]
  flat = moe_params.flatten(build.create(MODEL, seed=0))
  channel = WeightChannel(url, model_cfg=MODEL)
  channel.publish(flat, 0)
  channel.publish({k: np.asarray(v) * np.float32(1.01) for k, v in flat.items()}, 1)
  if processes.wait_for_weights(url, timeout_s=60)[1].version != 1:
    raise AssertionError("the test model's delta (version 1) was not applied")
