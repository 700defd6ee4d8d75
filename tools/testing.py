"""Test-only helpers of tools/' tests: an entry point run as a process, the way Bazel runs it.

`Binary("serve", args + serve_flags(log_dir), log_dir)` starts //tools:serve and waits
(bounded) for the one line it prints at start-up; `serve_flags` keeps JAX's persistent
compilation cache in the test's directory and skips the warm-up, and `Binary` refuses to start
the server without a cache directory of the test's own. Under `bazel test` the process is the
Bazel binary itself (the test target needs `data = [":serve"]`); outside Bazel it is what the
binary's stub executes, the toolchain's interpreter (build_defs/venv_python.sh) on
tools/<name>.py as a script. Running the real binary, not an import of its module, is what
catches start-up faults such as a module of the package shadowing a dependency on sys.path
(see build_defs/module_names_test.py).
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import threading
from typing import Sequence

WAIT_S = 300  # the process imports JAX and builds an engine: slow on a loaded machine
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(name: str) -> list:
  """The command that runs //tools:<name> as Bazel runs it (see the module docstring)."""
  if os.environ.get("TEST_SRCDIR"):
    path = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "tools", name)
    assert os.path.isfile(path), f"{path} is missing: the test needs data = [\":{name}\"]"
    return [path]
  return [os.path.join(ROOT, "build_defs", "venv_python.sh"),
          os.path.join(ROOT, "tools", f"{name}.py")]


def serve_flags(log_dir, *, warmup: bool = False) -> list:
  """The flags a test's start of //tools:serve needs besides its own.

  `--compilation_cache_dir` under `log_dir`: a test never writes the user's cache (the
  default, ~/.cache/moe-rl/jax) nor reads what another run left there. `--no_warmup` unless
  `warmup`: a test sends a few requests, whose shapes compile on first use, where a warm-up
  would compile every shape a request could reach first (minutes on a loaded CPU).
  """
  flags = [f"--compilation_cache_dir={os.path.join(log_dir, 'jax_cache')}"]
  return flags if warmup else flags + ["--no_warmup"]


class Binary:
  """//tools:<name> running as a process; `line` is the first line it prints.

  Raises AssertionError with the process's stderr if it exits or prints nothing within WAIT_S.
  """

  def __init__(self, name: str, args: Sequence[str], log_dir):
    self.name = name
    if name == "serve" and not any(a.startswith("--compilation_cache_dir=") for a in args):
      raise ValueError("//tools:serve in a test needs --compilation_cache_dir (serve_flags): "
                       "the default is the user's own cache")
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_ADMIN_TOKEN"}
    if not os.environ.get("TEST_SRCDIR"):  # Bazel's stub sets PYTHONPATH itself
      env["PYTHONPATH"] = ROOT
    self._stderr = open(os.path.join(log_dir, f"{name}.stderr"), "w+")  # pylint: disable=consider-using-with
    self.proc = subprocess.Popen(command(name) + list(args), stdout=subprocess.PIPE,
                                 stderr=self._stderr, text=True, env=env, cwd=ROOT)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    try:
      self.line = lines.get(timeout=WAIT_S)
    except queue.Empty:
      self.line = None
    if self.line is None:
      self._stop()
      err = self.stderr()
      self.close()
      raise AssertionError(f"//tools:{name} printed no start-up line within {WAIT_S} s (exit "
                           f"{self.proc.returncode}); stderr:\n{err[-4000:]}")

  def stderr(self) -> str:
    """What the process wrote to stderr so far."""
    self._stderr.flush()
    self._stderr.seek(0)
    return self._stderr.read()

  def _stop(self):
    if self.proc.poll() is None:
      self.proc.terminate()
    self.proc.wait(WAIT_S)

  def close(self):
    self._stop()
    self._stderr.close()


def serve_port(line: str) -> int:
  """The public port //tools:serve's start-up line names."""
  m = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", line or "")
  assert m, f"not //tools:serve's start-up line: {line!r}"
  return int(m.group(1))


# The RL launch config (tools/configs/launch/rl.gin) with the pipeline tests' tiny model and
# settings (pipeline.testing.MODEL and config()): gin bindings every part gets
# (`--gin.rl_jobs.bindings=...`), so a launched pipeline runs in seconds a step on a CPU.
RL_TINY_BINDINGS = (
    "ModelConfig.hidden_size=32", "ModelConfig.num_layers=2", "ModelConfig.num_heads=2",
    "ModelConfig.num_kv_heads=1", "ModelConfig.intermediate_size=64",
    "ModelConfig.moe_intermediate_size=32", "ModelConfig.num_experts=4",
    "ModelConfig.max_seq_len=128", "PipelineConfig.max_staleness=1",
    "PipelineConfig.prompts_per_step=2", "PipelineConfig.attempts=4",
    "PipelineConfig.max_new_tokens=12", "PipelineConfig.seq_len=96",
    "PipelineConfig.batch_rows=8", "PipelineConfig.grade_workers=2",
    "OptimizerConfig.learning_rate=1e-3", "ExperimentConfig.sandbox_pool=2",
    "RLConfig.sampler_slots=8")


def rl_launch_flags(steps: int, root_dir: str, *extra: str) -> list:
  """//tools:launch flags that run rl.gin tiny for `steps` steps in `root_dir`, without Bazel
  (the parts run as `python -m tools.rl_part`)."""
  import json  # pylint: disable=g-import-not-at-top
  return ["--experiment=tools/configs/launch/rl.gin", "--use_bazel=False",
          f"--root_dir={root_dir}", "--grace_s=2", f"--gin.rl_jobs.steps={steps}",
          f"--gin.rl_jobs.bindings={json.dumps(list(RL_TINY_BINDINGS))}", *extra]
