"""The RL launch config (tools/configs/launch/rl.gin) on a local multi-node Ray cluster, with
faults, in one run of the tiny pipeline (tools/testing.RL_TINY_BINDINGS):

  * the controller's actor is killed: Ray starts it again, it resumes after the last group it
    wrote ("controller resumed at group N"), and no group is written twice or skipped;
  * at the same time the weight relay both samplers read through (`rl_jobs.relays=1`) is
    killed: Ray starts it again on a new port, it registers its address, and each sampler finds
    it by name and goes past the version it held;
  * the node of a sampler is removed while it has requests in flight: the sampler is placed on
    the other sampler node and registers its new address, the controller retries its requests
    on the other sampler and follows the moved one by name. The controller grades in a Ray
    sandbox fleet (tools/configs/runs/ray_grading.gin, joining the run's cluster by itself) of
    two hosts spread over the sampler nodes, so the node takes a fleet host with it: the host
    is replaced on the other node and its grades re-run there, each attempt graded once;
  * at the same time the learner's node is removed: the learner is placed on the spare learner
    node, restores its last checkpoint ("learner restored at step N") and the run finishes.

Then the run's summary.json: every episode generated once (no duplicates), every one read by
the learner and trained or dropped as stale, none lost; each step in metrics.jsonl once; the
fleet's host failure counted, grades retried on another host, graded by more than one host
process, as many grades as episodes.

The cluster (ray.cluster_utils.Cluster): a head for the driver, the controller and the relay,
two learner nodes (one spare) and two sampler nodes (which also carry the fleet's hosts), each
with its own custom resource so each part's placement is known; every part declares one
through rl.gin's resources, the fleet's hosts through PipelineConfig.grader_resources. About
two minutes on the quiet 2-core machine (the restarted parts compile again).
"""

import json
import os
import sys
import threading
import urllib.error
import urllib.request

import pytest

from launch import local
from launch import ray_executor
from pipeline import processes
from testlib import waiting
from tools import configs
from tools import launcher
from tools import rl_launch
from tools import testing

STEPS = 8
EPISODES = STEPS * 2 * 4  # prompts_per_step x attempts (RL_TINY_BINDINGS)
WAIT_S = 240.0  # per event: a restarted part imports JAX and compiles on a loaded machine
_MB = 1 << 20
FLEET_LINE = "controller grading fleet "
RELAY_LINE = "relay serving "
SAMPLERS = ("sampler_0", "sampler_1")


@pytest.fixture(scope="module")
def cluster():
  import ray  # pylint: disable=g-import-not-at-top
  from ray.cluster_utils import Cluster  # pylint: disable=g-import-not-at-top
  c = Cluster(initialize_head=True, head_node_args={
      "num_cpus": 2, "resources": {"head": 2}, "object_store_memory": 80 * _MB,
      "include_dashboard": False})
  c.learner_nodes = [c.add_node(num_cpus=1, resources={"learner_node": 1},
                                object_store_memory=80 * _MB) for _ in range(2)]
  c.sampler_nodes = [c.add_node(num_cpus=2, resources={"sampler_node": 2, "grader_node": 2},
                                object_store_memory=80 * _MB) for _ in range(2)]
  c.wait_for_nodes()
  ray.init(address=c.address, include_dashboard=False, log_to_driver=False,
           runtime_env={"env_vars": {"PYTHONPATH": testing.ROOT}})
  yield c
  ray.shutdown()
  c.shutdown()


def _experiment(root_dir: str):
  """rl.gin with the tiny pipeline grading in a Ray fleet, each part pinned to its kind of node
  (the fleet's hosts to the sampler nodes)."""
  bindings = [*testing.RL_TINY_BINDINGS, 'PipelineConfig.grader_resources={"grader_node": 1}']
  flags = testing.rl_launch_flags(
      STEPS, root_dir,
      f"--gin.rl_jobs.bindings={json.dumps(bindings)}",
      '--gin.rl_jobs.gin_files=["tools/configs/runs/ray_grading.gin"]',
      '--gin.learner/resources.custom={"learner_node": 1}',
      '--gin.sampler/resources.custom={"sampler_node": 1}',
      '--gin.controller/resources.custom={"head": 1}',
      "--gin.rl_jobs.relays=1", '--gin.relay/resources.custom={"head": 1}')
  files, bindings, extra = configs.split_flags(flags, launcher.launch_main,
                                               extra_flags=("experiment",))
  configs.parse([configs.resolve_path(extra["experiment"]), *files], bindings)
  return launcher.experiment()


def _log(run, name):
  try:
    with open(run.status(name).log_path, encoding="utf-8") as f:
      return f.read()
  except OSError:
    return ""


def _learner_step(run) -> int:
  return max((r["step"] for r in processes.parse_step_lines(_log(run, "learner"))), default=0)


def _busy(run, name) -> bool:
  """Whether sampler `name` is working on requests now (its /metrics)."""
  st = run.status(name)
  try:
    with urllib.request.urlopen(f"http://{st.host}:{st.port}/metrics", timeout=2) as r:
      text = r.read().decode()
  except OSError:
    return False
  return any(line.split()[0] in ("rollout_active_slots", "rollout_queue_depth")
             and float(line.split()[-1]) > 0 for line in text.splitlines() if line.strip()
             and not line.startswith("#"))


def _version(run, name) -> int:
  """The weight version sampler `name` serves now (its /health), -1 if it does not answer."""
  st = run.status(name)
  try:
    with urllib.request.urlopen(f"http://{st.host}:{st.port}/health", timeout=2) as r:
      return json.loads(r.read())["policy_version"]
  except urllib.error.HTTPError as e:  # 503 (weight sync behind) still names the version
    return json.loads(e.read()).get("policy_version", -1)
  except (OSError, ValueError):
    return -1


def _fleet(run) -> dict:
  """The fleet of the controller's latest incarnation: {"host_pids", "host_nodes"} (or {})."""
  lines = [line for line in _log(run, "controller").splitlines()
           if line.startswith(FLEET_LINE)]
  return json.loads(lines[-1][len(FLEET_LINE):]) if lines else {}


def _node(cluster, node_id):
  for n in cluster.learner_nodes + cluster.sampler_nodes:
    if n.node_id == node_id:
      return n
  raise AssertionError(f"no worker node {node_id}")


def test_rl_gin_on_ray_survives_a_controller_a_relay_a_sampler_node_and_the_learner_node(
    cluster, tmp_path):
  import ray  # pylint: disable=g-import-not-at-top
  ex = ray_executor.RayExecutor(str(tmp_path), use_bazel=False, grace_s=2, out=sys.stdout,
                                placement_timeout_s=120)
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
    return (f"run ended: {ended.is_set()}\n{run.summary()}\n--- learner\n"
            f"{_log(run, 'learner')[-2000:]}\n--- controller\n{_log(run, 'controller')[-2000:]}")

  def wait_for(cond, what):
    def check():
      if ended.is_set() and not cond():
        raise AssertionError(f"the run ended before {what} (raise STEPS?):\n{state()}")
      return cond()
    waiting.wait_until(check, lambda: f"{what}:\n{state()}", timeout_s=WAIT_S, poll_s=0.2)

  def back_up(name, restarts):
    st = run.status(name)
    return st.restarts >= restarts and st.state == local.RUNNING

  try:
    # 1. The controller's actor, once it has written a group and the learner trained a step,
    #    and at the same time the relay both samplers read their weights through.
    wait_for(lambda: _learner_step(run) >= 1 and "\ngroup " in _log(run, "controller")
             and min(_version(run, s) for s in SAMPLERS) >= 0, "the first step")
    held = {s: _version(run, s) for s in SAMPLERS}
    ray.kill(run.actor("controller"), no_restart=False)
    ray.kill(run.actor("relay_0"), no_restart=False)
    wait_for(lambda: back_up("controller", 1) and "controller resumed at group"
             in _log(run, "controller"), "the controller back, resumed")
    wait_for(lambda: back_up("relay_0", 1) and _log(run, "relay_0").count(RELAY_LINE) >= 2,
             "relay_0 placed again, serving")
    # Both samplers find the relay again by name and go past the version they held.
    wait_for(lambda: all(_version(run, s) > held[s] for s in SAMPLERS),
             f"both samplers past the versions they held ({held}) through the new relay_0")
    # 2. A sampler's node while the sampler has requests in flight, then the learner's node
    #    (two faults at once: they recover side by side, which keeps the test short).
    wait_for(lambda: _learner_step(run) >= 2 and _busy(run, "sampler_0")
             and _log(run, "controller").count(FLEET_LINE) >= 2,
             "step 2, sampler_0 busy, the resumed controller's fleet up")
    victim = run.status("sampler_0").node
    # The fleet's hosts are spread over both sampler nodes: the victim takes one with it.
    hosts = _fleet(run)["host_nodes"]
    assert victim in hosts.values() and set(hosts.values()) - {victim}, hosts
    cluster.remove_node(_node(cluster, victim))
    learner = run.status("learner").node
    step = _learner_step(run)
    cluster.remove_node(_node(cluster, learner))
    wait_for(lambda: back_up("sampler_0", 1), "sampler_0 placed again")
    assert run.status("sampler_0").node != victim
    wait_for(lambda: "sampler @sampler_0 moved from" in _log(run, "controller"),
             "the controller following sampler_0 to its new address")
    wait_for(lambda: back_up("learner", 1) and "learner restored at step"
             in _log(run, "learner"), "the learner back, restored")
    assert run.status("learner").node != learner
    wait_for(lambda: _learner_step(run) > step, "a step after the learner's restart")
    waiting.wait_event(ended, lambda: f"the run's end:\n{state()}", timeout_s=WAIT_S)
  finally:
    run.interrupt(15) if not ended.is_set() else None
    ended.wait(60)
    run.close()
  assert not errors, errors
  assert run.succeeded(), state()

  summary = rl_launch.summarize(run.dir)
  (unit,) = summary["work_units"]
  assert unit["steps"] == STEPS, unit
  assert unit["episodes_generated"] == unit["episodes_read"] == EPISODES, unit
  assert unit["duplicate_episodes"] == 0 and unit["episodes_lost"] == 0, unit
  assert unit["episodes_trained"] + unit["episodes_stale"] == EPISODES, unit
  assert unit["infra_failures"] == 0, unit
  assert unit["restarts"]["controller"] >= 1 and unit["restarts"]["learner"] >= 1, unit
  assert unit["restarts"]["sampler_0"] >= 1, unit
  assert unit["restarts"]["relay_0"] >= 1 and unit["restarts"]["sampler_1"] == 0, unit
  # The killed sampler's requests went to the other one (and it was followed by name to its
  # new address, above).
  assert unit["episodes_retried"] >= 1, unit
  # The host on the removed node: counted as failed, its grades re-run on another host (one
  # grade per episode, none from the controller's own pool), hosts of more than one process
  # graded.
  g = unit["grading"]
  assert g["grader"] == "ray" and g["host_failures"] >= 1, g
  assert g["jobs_retried"] >= 1 and g["retried_grades"] >= 1, g
  assert g["grades"] == g["episodes_graded"] > 0 and g["fleet_errors"] == 0, g
  assert len(g["grading_pids"]) >= 2, g
  with open(os.path.join(run.dir, "metrics.jsonl"), encoding="utf-8") as f:
    assert [json.loads(line)["step"] for line in f] == list(range(1, STEPS + 1))
  with open(os.path.join(run.dir, "summary.json"), encoding="utf-8") as f:
    assert json.load(f)["executor"] == "ray"


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-s", "-p", "no:cacheprovider"]))
