"""The RL launch config (tools/configs/launch/rl.gin) on Ray with a learner of two
jax.distributed processes (`rl_jobs.learner_processes=2`, one CPU device each, a (2, 1, 1, 1)
mesh): process 1 finds process 0's coordinator by name through Ray (`--coordinator=@learner_0`,
its address registered by learner_0's actor). Process 1's actor is killed after the first step:
the two processes are one gang, so process 0 is stopped too, and both start again once process
1's actor is back, restore their last checkpoint together and finish the run; nothing is lost
or generated twice.

The executor starts a local Ray (no address) sized to what the parts declare. About 100 s on
the quiet 2-core machine (two learner processes compile twice).
"""

import json
import os
import sys
import threading

import pytest

from launch import local
from launch import ray_executor
from pipeline import processes
from testlib import waiting
from tools import configs
from tools import launcher
from tools import rl_launch
from tools import testing

STEPS = 3
EPISODES = STEPS * 2 * 4
WAIT_S = 240.0


def _experiment(root_dir: str):
  flags = testing.rl_launch_flags(
      STEPS, root_dir, "--gin.rl_jobs.learner_processes=2", "--gin.rl_jobs.samplers=1",
      '--gin.rl_jobs.learner_env={"JAX_PLATFORMS": "cpu", '
      '"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}')
  files, bindings, extra = configs.split_flags(flags, launcher.launch_main,
                                               extra_flags=("experiment",))
  bindings.append("rl_jobs.bindings = " + json.dumps(
      [*testing.RL_TINY_BINDINGS, "ExperimentConfig.mesh_shape=(2, 1, 1, 1)"]))
  configs.parse([configs.resolve_path(extra["experiment"]), *files], bindings)
  return launcher.experiment()


def _log(run, name):
  try:
    with open(run.status(name).log_path, encoding="utf-8") as f:
      return f.read()
  except OSError:
    return ""


def test_two_learner_processes_find_their_coordinator_and_restart_as_a_gang(tmp_path):
  import ray  # pylint: disable=g-import-not-at-top
  ex = ray_executor.RayExecutor(str(tmp_path), use_bazel=False, grace_s=2, out=sys.stdout,
                                placement_timeout_s=120, object_store_memory=80 << 20)
  run = ex.launch(_experiment(str(tmp_path)))
  ended = threading.Event()
  errors = []

  def drive():
    try:
      run.wait(timeout=900)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
    finally:
      ended.set()

  threading.Thread(target=drive, daemon=True).start()

  def state():
    return (f"run ended: {ended.is_set()}\n{run.summary()}\n--- learner_0\n"
            f"{_log(run, 'learner_0')[-2500:]}\n--- learner_1\n{_log(run, 'learner_1')[-1500:]}")

  def step(name):
    return max((r["step"] for r in processes.parse_step_lines(_log(run, name))), default=0)

  try:
    waiting.wait_until(lambda: step("learner_0") >= 1 or ended.is_set(),
                       lambda: f"the first step:\n{state()}", timeout_s=WAIT_S, poll_s=0.2)
    assert not ended.is_set(), f"the run ended before the kill:\n{state()}"
    ray.kill(run.actor("learner_1"), no_restart=False)
    waiting.wait_until(
        lambda: all(run.status(n).restarts >= 1 and run.status(n).state == local.RUNNING
                    for n in ("learner_0", "learner_1")) or ended.is_set(),
        lambda: f"the gang started again:\n{state()}", timeout_s=WAIT_S, poll_s=0.2)
    waiting.wait_event(ended, lambda: f"the run's end:\n{state()}", timeout_s=WAIT_S)
  finally:
    ended.wait(60)
    run.close()
    ray.shutdown()
  assert not errors, errors
  assert run.succeeded(), state()
  for i in (0, 1):
    log = _log(run, f"learner_{i}")
    assert f"learner process {i} of 2" in log
    assert "learner restored at step" in log, log[-3000:]
    assert run.status(f"learner_{i}").restarts == 1
  (unit,) = rl_launch.summarize(run.dir)["work_units"]
  assert unit["steps"] == STEPS, unit
  assert unit["episodes_generated"] == unit["episodes_read"] == EPISODES, unit
  assert unit["duplicate_episodes"] == 0 and unit["episodes_lost"] == 0, unit
  with open(os.path.join(run.dir, "metrics.jsonl"), encoding="utf-8") as f:
    assert [json.loads(line)["step"] for line in f] == list(range(1, STEPS + 1))


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-s", "-p", "no:cacheprovider"]))
