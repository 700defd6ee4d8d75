"""The Ray executor on a local multi-node Ray cluster (ray.cluster_utils.Cluster, one cluster for
the module): jobs placed by the resources they declare find each other by name through the
registry; a job whose node is removed is placed again on another node, registers its new
address and its peer follows it (the program on the lost node died with it); a failed job is restarted up to its max_restarts, with its
gang; one that runs out of restarts stops its work unit; services stop when the rest ended.
"""

import json
import os
import sys

import pytest

from launch import local
from launch import ray_executor
from launch import spec
from testlib import waiting

SERVER = spec.PyModule("launch.testdata.echo_server")
CLIENT = spec.PyModule("launch.testdata.echo_client")
PINGER = spec.PyModule("launch.testdata.echo_pinger")
FLAKY = spec.PyModule("launch.testdata.flaky")
TIMEOUT_S = 120.0
_MB = 1 << 20


@pytest.fixture(scope="module")
def cluster():
  """Head (the driver, 1 CPU, label "head") and two worker nodes (2 CPUs, label "worker")."""
  import ray  # pylint: disable=g-import-not-at-top
  from ray.cluster_utils import Cluster  # pylint: disable=g-import-not-at-top
  c = Cluster(initialize_head=True, head_node_args={
      "num_cpus": 1, "resources": {"head": 1}, "object_store_memory": 80 * _MB,
      "include_dashboard": False})
  c.workers = [c.add_node(num_cpus=2, resources={"worker": 2}, object_store_memory=80 * _MB)
               for _ in range(2)]
  c.wait_for_nodes()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  ray.init(address=c.address, include_dashboard=False, log_to_driver=False,
           runtime_env={"env_vars": {"PYTHONPATH": root}})
  yield c
  ray.shutdown()
  c.shutdown()


def _executor(tmp_path, **kw):
  return ray_executor.RayExecutor(str(tmp_path), use_bazel=False, grace_s=2, out=None,
                                  placement_timeout_s=60, **kw)


def _wait(run):
  try:
    if not run.wait(timeout=TIMEOUT_S):
      raise TimeoutError(f"the experiment did not end in {TIMEOUT_S:g}s:\n{run.summary()}")
  finally:
    run.close()


def _logs(run, name):
  with open(run.status(name).log_path, encoding="utf-8") as f:
    return f.read()


def test_jobs_placed_by_their_resources_find_each_other_by_name(cluster, tmp_path):
  worker = spec.Resources(num_cpus=1, custom={"worker": 1})
  jobs = [spec.Job("server", SERVER, args={"clients": 2}, resources=worker),
          spec.Job("client_0", CLIENT, args={"message": "hi"}, resources=worker),
          spec.Job("client_1", CLIENT, args={"message": "yo"},
                   resources=spec.Resources(num_cpus=0.5, custom={"head": 0.5}))]
  run = _executor(tmp_path).launch(spec.Experiment("echo", (spec.WorkUnit(tuple(jobs)),)))
  _wait(run)
  assert run.succeeded(), run.summary()
  assert "client_0 got reply 'echo:hi'" in _logs(run, "client_0")
  assert "client_1 got reply 'echo:yo'" in _logs(run, "client_1")
  head = cluster.head_node.node_id
  workers = {n.node_id for n in cluster.workers}
  assert run.status("client_1").node == head
  assert run.status("server").node in workers and run.status("client_0").node in workers
  with open(os.path.join(run.dir, "status.json"), encoding="utf-8") as f:
    doc = json.load(f)
  assert doc["executor"] == "ray"
  assert {n: j["state"] for n, j in doc["work_units"][0]["jobs"].items()} == {
      "server": "succeeded", "client_0": "succeeded", "client_1": "succeeded"}
  table = local.status_table(doc)
  assert "server" in table and "succeeded" in table and "wu0/server.log" in table


def test_a_job_whose_node_dies_runs_again_elsewhere_and_its_peer_follows(cluster, tmp_path):
  """The server is a service on a worker node; the pinger (on the head) asks for its address
  before every message. Removing the server's node places it on the other worker, at a new
  address, and the pinger gets every reply; the service is stopped when the pinger is done."""
  import ray  # pylint: disable=g-import-not-at-top
  progress = tmp_path / "progress.txt"
  jobs = [spec.Job("server", SERVER, args={"clients": 10**6}, service=True, max_restarts=2,
                   resources=spec.Resources(num_cpus=1, custom={"worker": 1})),
          spec.Job("pinger", PINGER, args={"count": 40, "interval_s": 0.1,
                                           "progress_file": str(progress)},
                   resources=spec.Resources(num_cpus=0.5, custom={"head": 0.5}))]
  run = _executor(tmp_path).launch(spec.Experiment("move", (spec.WorkUnit(tuple(jobs)),)))
  try:
    waiting.wait_until(lambda: progress.exists() and len(progress.read_text().split("\n")) > 5,
                       "the pinger's first replies", timeout_s=TIMEOUT_S)
    first = run.status("server")
    first_node, first_address, first_pid = first.node, f"{first.host}:{first.port}", first.pid
    (victim,) = [n for n in cluster.workers if n.node_id == first_node]
    cluster.remove_node(victim)
    cluster.workers.remove(victim)
    cluster.workers.append(cluster.add_node(num_cpus=2, resources={"worker": 2},
                                            object_store_memory=80 * _MB))
  except BaseException:
    run.close()
    raise
  _wait(run)
  assert run.succeeded(), run.summary() + _logs(run, "pinger")
  server = run.status("server")
  assert server.restarts == 1 and server.node != first_node
  replies = [line.split() for line in progress.read_text().splitlines()]
  assert [r[0] for r in replies] == [f"echo:m{i}" for i in range(40)]
  where = [r[1] for r in replies]
  assert where[0] == first_address and where[-1] == f"{server.host}:{server.port}"
  assert "start 2 of server" in _logs(run, "server")
  assert not waiting.pid_alive(first_pid)  # the lost node's program died with its actor
  waiting.wait_until(lambda: ray.available_resources().get("worker", 0) == 4,
                     "the run's bundles released", timeout_s=30)


def test_failed_jobs_restart_with_their_gang_until_restarts_run_out(cluster, tmp_path):
  res = spec.Resources(num_cpus=0.5)
  a, b, c = (tmp_path / n for n in ("a", "b", "c"))
  # Work unit 0: `a` fails once and is restarted; `b` (same gang) is restarted with it.
  # Work unit 1: `c` fails twice with one restart: the unit stops, its service with it.
  unit0 = spec.WorkUnit((
      spec.Job("a", FLAKY, args={"starts_file": str(a), "fail_times": 1, "run_s": 1},
               resources=res, max_restarts=1, gang="g"),
      spec.Job("b", FLAKY, args={"starts_file": str(b), "run_s": 8}, resources=res,
               max_restarts=1, gang="g")))
  unit1 = spec.WorkUnit((
      spec.Job("c", FLAKY, args={"starts_file": str(c), "fail_times": 5, "run_s": 0.5},
               resources=res, max_restarts=1),
      spec.Job("server", SERVER, args={"clients": 10**6}, service=True, resources=res)))
  run = _executor(tmp_path).launch(spec.Experiment("flaky", (unit0, unit1)))
  _wait(run)
  assert len(a.read_text().split()) == 2 and len(b.read_text().split()) == 2
  assert run.status("a").state == run.status("b").state == local.SUCCEEDED
  assert (run.status("a").restarts, run.status("b").restarts) == (1, 1)
  assert len(c.read_text().split()) == 2
  assert run.status("c", 1).state == local.FAILED and run.status("c", 1).returncode == 3
  assert run.status("server", 1).state == local.STOPPED
  assert not run.succeeded()


def test_a_work_unit_the_cluster_cannot_hold_is_a_clear_error(cluster, tmp_path):
  job = spec.Job("big", FLAKY, args={"starts_file": str(tmp_path / "x")},
                 resources=spec.Resources(num_cpus=1, custom={"tpu": 8}))
  # No node ever has a "tpu" resource, so the launch waits the whole placement timeout.
  ex = ray_executor.RayExecutor(str(tmp_path), use_bazel=False, out=None,
                                placement_timeout_s=0.5)
  with pytest.raises(ray_executor.RayExecutorError, match="no room for its jobs"):
    ex.launch(spec.Experiment("big", (spec.WorkUnit((job,)),)))
  assert not (tmp_path / "x").exists()


_LOCAL_LAUNCH = """
import sys
from launch import ray_executor, spec
job = spec.Job("server", spec.PyModule("launch.testdata.echo_server"), args={"clients": 1})
client = spec.Job("client", spec.PyModule("launch.testdata.echo_client"), args={"message": "x"})
run = ray_executor.RayExecutor(sys.argv[1], use_bazel=False, grace_s=2, out=None,
                               placement_timeout_s=60).launch(
    spec.Experiment("own", (spec.WorkUnit((job, client)),)))
ok = run.wait(timeout=120)
print("own cluster:", run.succeeded(), flush=True)
run.close()
sys.exit(0 if ok and run.succeeded() else 1)
"""


def test_without_an_address_it_starts_its_own_ray_beside_another_instance(cluster, tmp_path):
  """With this module's cluster running on the machine (as another run's or a concurrent
  test's would be), an executor given no address starts a Ray of its own: Ray's default would
  join the running instance and refuse the CPUs the executor asks for."""
  import subprocess  # pylint: disable=g-import-not-at-top
  assert cluster.address  # the other instance is up
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root)
  env.pop("RAY_ADDRESS", None)
  r = subprocess.run([sys.executable, "-c", _LOCAL_LAUNCH, str(tmp_path)], env=env, cwd=root,
                     capture_output=True, text=True, timeout=240, check=False)
  assert r.returncode == 0 and "own cluster: True" in r.stdout, (r.stdout[-3000:]
                                                                  + r.stderr[-3000:])


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
