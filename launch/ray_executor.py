"""The Ray executor: an experiment's jobs as Ray actors on an existing (or a local) Ray cluster.

The same `spec.Experiment` the local executor runs, placed by Ray instead of run on this machine:

  * One placement group per work unit, one bundle per job holding what the job declares
    (`spec.Resources`: CPUs, GPUs, memory, custom resources such as a node label), so a work
    unit starts only when the cluster has room for all of it, and a job lands on a node that has
    what it asked for.
  * Each job runs under its own actor (`_JobActor`, scheduled into its bundle): the actor
    reserves a port on its node, registers "host:port" with the work unit's registry actor (a
    named actor in the run's namespace, where addresses live) and starts the job's program as a
    child process, exactly the command the local executor would run (`launch.targets`), with the
    same LAUNCH_* discovery environment. The job's program cannot tell the executors apart: it
    asks `launch.discovery.address_of("sampler_0")` in both, and its actor keeps the node-local
    address file current from the registry (see launch/discovery.py). A program that uses Ray
    itself (the controller grading in a sandbox fleet) finds the cluster in $RAY_ADDRESS.
  * Faults: a job whose program fails, or whose actor dies with its node, is started again, up
    to the job's `max_restarts`. A dead node's bundles are placed again by Ray on nodes with
    room, and the restarted actor (Ray's `max_restarts`) starts the program there at once and
    registers its new address. Jobs of one `gang` (the processes of one jax.distributed
    learner) are stopped together when one goes down and started together once every
    member's actor is back up. The program dies with its actor (PR_SET_PDEATHSIG), so a
    killed actor leaves nothing running.

Why a child process and not the part's code inside the actor: the parts are whole programs (a
JAX runtime each, jax.distributed, signal handling, sandboxes forked from them), the same ones
`bazel run` and the local executor start, so one body runs under every executor.

Cluster assumptions (as for any multi-node run of the pipeline): the repository (with its venv
or bazel-bin) is at the same path on every node, and the experiment directory (logs) and the
pipeline's work directory are on a filesystem every node mounts. On the local multi-node
clusters of the tests (`ray.cluster_utils.Cluster`) both hold by construction.

Everything the driver knows is written to `<experiment dir>/status.json` on every change, in
the local executor's schema plus where each job runs (node, host:port) and its restarts, so
`//tools:launch -- --status=DIR` reads either executor's runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional, TextIO

from launch import discovery
from launch import spec
from launch import targets
from launch.local import FAILED, ON_FAILURE, PENDING, RUNNING, STOPPED, SUCCEEDED, JobStatus
from launch.local import apply_failure_policy, status_table

RESTARTING = "restarting"  # its actor died (with its node) and Ray is placing it again
_PR_SET_PDEATHSIG = 1


class RayExecutorError(RuntimeError):
  """The cluster cannot run the experiment (no room for a work unit, Ray not importable)."""


def _die_with_parent() -> None:
  """In the job's child process: SIGKILL when the actor that started it dies (a killed actor or
  a lost node then leaves no part running with stale state)."""
  import ctypes  # pylint: disable=g-import-not-at-top
  ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class _Registry:
  """A work unit's address book: job name -> host, port, node, pid and start count.

  Job actors register on every (re)start; every job's actor polls `table` for changes. It is a
  named actor (`<namespace>/registry-wu<i>`), so any driver connected to the cluster can ask
  where the parts of a run are.
  """

  def __init__(self):
    self._version = 0
    self._entries: dict[str, dict] = {}
    self._started = False

  def register(self, name: str, host: str, port: Optional[int], node: str) -> tuple[bool, int]:
    """Records a (re)started job's address; returns whether the work unit has started (a
    restarted actor then starts its program at once) and how often the job's program has."""
    e = self._entries.setdefault(name, {"starts": 0, "pid": None})
    e.update(host=host, port=port, node=node)
    self._version += 1
    return self._started, e["starts"]

  def started(self, name: str, pid: int) -> int:
    """Records that `name`'s program started as `pid`; returns how many times it has."""
    e = self._entries[name]
    e["starts"] += 1
    e["pid"] = pid
    self._version += 1
    return e["starts"]

  def set_started(self) -> None:
    self._started = True

  def table(self, since: int = -1) -> Optional[tuple[int, dict]]:
    """(version, entries), or None when nothing changed since version `since`."""
    if since == self._version:
      return None
    return self._version, {k: dict(v) for k, v in self._entries.items()}


@dataclasses.dataclass(frozen=True)
class _JobLaunch:
  """What a job actor needs to run its program (pickled to the node it lands on)."""
  name: str
  work_unit: int
  argv: tuple
  env: dict
  cwd: str
  log_path: str
  want_port: bool
  experiment: str
  experiment_dir: str
  params: dict
  registry: str   # the registry actor's name ...
  namespace: str  # ... in the run's namespace
  auto_start: bool  # start the program when Ray restarts the actor (not a gang's: the driver)


class _JobActor:
  """Runs one job's program on its node (see the module docstring)."""

  def __init__(self, job: _JobLaunch):
    import ray  # pylint: disable=g-import-not-at-top
    self._ray = ray
    self.job = job
    # Looked up by name, not passed as a handle: a restarted actor's arguments must be plain
    # values (Ray keeps an argument holding a handle in the object store, which a restart
    # on another node may not find).
    self.registry = registry = ray.get_actor(job.registry, namespace=job.namespace)
    self.host = ray.util.get_node_ip_address()
    self.port = discovery.free_port(self.host) if job.want_port else None
    self.node = ray.get_runtime_context().get_node_id()
    self.proc: Optional[subprocess.Popen] = None
    self.starts = 0
    self._dir = tempfile.mkdtemp(prefix=f"launch-{job.name}-")
    self.jobs_file = os.path.join(self._dir, "jobs.json")
    self._version = -1
    self._closed = threading.Event()
    started, self.starts = ray.get(registry.register.remote(job.name, self.host, self.port,
                                                            self.node))
    self._refresh()
    threading.Thread(target=self._refresh_loop, daemon=True, name="address-refresh").start()
    if started and job.auto_start:  # Ray restarted this actor (its node died): run again
      self.start()

  # ---------------------------------------------------------------- addresses
  def _refresh(self) -> None:
    got = self._ray.get(self.registry.table.remote(self._version), timeout=30)
    if got is None:
      return
    version, entries = got
    table = {n: {"host": e["host"], "port": e["port"], "node": e["node"]}
             for n, e in entries.items()}
    discovery.write_jobs_file(self.jobs_file, table, work_unit=self.job.work_unit,
                              experiment=self.job.experiment, params=self.job.params)
    self._version = version

  def _refresh_loop(self) -> None:
    while not self._closed.wait(0.5):
      try:
        self._refresh()
      except Exception:  # pylint: disable=broad-except
        pass  # the registry is gone (the run is ending) or slow: the file keeps the last table

  # ---------------------------------------------------------------- the program
  def ready(self) -> dict:
    return self.where()

  def where(self) -> dict:
    return {"host": self.host, "port": self.port, "node": self.node,
            "pid": self.proc.pid if self.proc else None, "starts": self.starts}

  def start(self) -> dict:
    """Starts the program (the work unit's table is complete: every job registered first)."""
    self._refresh()
    env = targets.python_env(self.job.cwd)
    # The cluster this part runs on, for a part that uses Ray itself (the controller's sandbox
    # fleet, pipeline/grading.py): `ray.init()` without an address joins $RAY_ADDRESS's.
    env["RAY_ADDRESS"] = self._ray.get_runtime_context().gcs_address
    env.update({discovery.JOBS_JSON: self.jobs_file, discovery.JOB_NAME: self.job.name,
                discovery.WORK_UNIT: str(self.job.work_unit),
                discovery.EXPERIMENT_DIR: self.job.experiment_dir})
    env.update(self.job.env)
    os.makedirs(os.path.dirname(self.job.log_path), exist_ok=True)
    with open(self.job.log_path, "ab") as log:
      log.write((f"--- launch: start {self.starts + 1} of {self.job.name} on node "
                 f"{self.node[:12]} ({self.host}{':' + str(self.port) if self.port else ''}) "
                 f"at {datetime.datetime.now().isoformat(timespec='seconds')}\n").encode())
      log.flush()
      # A session of its own: stopping the job stops whatever it started (sandboxes, ...).
      self.proc = subprocess.Popen(list(self.job.argv), cwd=self.job.cwd, env=env,
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=_die_with_parent)
    self.starts = self._ray.get(self.registry.started.remote(self.job.name, self.proc.pid))
    return self.where()

  def poll(self) -> dict:
    """{"returncode": None while running, "starts", "host", "port", "node", "pid"}."""
    rc = self.proc.poll() if self.proc else None
    return {**self.where(), "returncode": rc}

  def restart(self, grace_s: float = 5.0) -> dict:
    """Stops the program if it runs and starts it again here (same address)."""
    self.stop(grace_s)
    return self.start()

  def stop(self, grace_s: float = 5.0) -> Optional[int]:
    """SIGTERM to the program's group, SIGKILL after `grace_s`; returns its exit code."""
    p = self.proc
    if p is None:
      return None
    if p.poll() is None:
      _signal_group(p.pid, signal.SIGTERM)
      try:
        p.wait(timeout=grace_s)
      except subprocess.TimeoutExpired:
        _signal_group(p.pid, signal.SIGKILL)
        p.wait()
    _signal_group(p.pid, signal.SIGKILL)  # what it left behind in its group
    return p.returncode

  def close(self, grace_s: float = 5.0) -> None:
    self._closed.set()
    self.stop(grace_s)


def _signal_group(pid: int, sig: int) -> None:
  try:
    os.killpg(pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


@dataclasses.dataclass
class _Tracked:
  """The driver's view of one job."""
  job: spec.Job
  status: JobStatus
  actor: Any = None
  stop_requested: bool = False
  deaths: int = 0          # actor deaths seen (node lost, actor killed)
  failures_restarted: int = 0
  seen_starts: int = 0     # program starts the driver has seen
  gang_pending: bool = False  # waits to start again with its gang
  down_since: float = 0.0     # time.monotonic() when it went down (RESTARTING)

  @property
  def restarts_used(self) -> int:
    return self.deaths + self.failures_restarted


class RayRun:
  """A launched experiment on Ray (see RayExecutor.launch)."""

  def __init__(self, executor: "RayExecutor", experiment: spec.Experiment, exp_dir: str,
               commands: dict, namespace: str):
    self.executor = executor
    self.experiment = experiment
    self.dir = exp_dir
    self.namespace = namespace
    self._commands = commands
    self._ray = executor.ray
    self.units: list[dict[str, _Tracked]] = []
    for i, wu in enumerate(experiment.work_units):
      self.units.append({j.name: _Tracked(j, JobStatus(
          work_unit=i, name=j.name, argv=commands[j.executable] + j.argv_args,
          log_path=os.path.join(exp_dir, f"wu{i}", f"{j.name}.log"), service=j.service))
                         for j in wu.jobs})
    self._pgs: list[Any] = []
    self._registries: list[Any] = []
    self._interrupted: Optional[int] = None
    self._write_status()

  # ---------------------------------------------------------------- start
  def _start(self) -> None:
    ray = self._ray
    from ray.util.placement_group import placement_group  # pylint: disable=g-import-not-at-top
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # pylint: disable=g-import-not-at-top
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # pylint: disable=g-import-not-at-top
    ex = self.executor
    registry_cls = ray.remote(num_cpus=0)(_Registry)
    actor_cls = ray.remote(_JobActor)
    for i, (wu, jobs) in enumerate(zip(self.experiment.work_units, self.units)):
      bundles = [t.job.resources.bundle() for t in jobs.values()]
      pg = placement_group(bundles, strategy=ex.placement_strategy,
                           name=f"{self.namespace}-wu{i}")
      self._pgs.append(pg)
      ready, _ = ray.wait([pg.ready()], timeout=ex.placement_timeout_s)
      if not ready:
        raise RayExecutorError(
            f"work unit {i}: the cluster has no room for its jobs after "
            f"{ex.placement_timeout_s:g}s (bundles {dict(zip(jobs, bundles))}; cluster "
            f"resources {ray.cluster_resources()})")
      # On the driver's node: the address book must outlive any worker node.
      registry = registry_cls.options(
          name=f"registry-wu{i}", namespace=self.namespace,
          scheduling_strategy=NodeAffinitySchedulingStrategy(
              ray.get_runtime_context().get_node_id(), soft=False)).remote()
      self._registries.append(registry)
      ray.get(registry.table.remote(), timeout=ex.placement_timeout_s)  # up before its users
      for k, (name, t) in enumerate(jobs.items()):
        launch = _JobLaunch(name=name, work_unit=i, argv=tuple(t.status.argv), env=dict(t.job.env),
                            cwd=ex.repo_root, log_path=t.status.log_path, want_port=t.job.port,
                            experiment=self.experiment.name, experiment_dir=self.dir,
                            params=_jsonable(wu.params), registry=f"registry-wu{i}",
                            namespace=self.namespace, auto_start=t.job.gang is None)
        res = t.job.resources
        t.actor = actor_cls.options(
            num_cpus=res.num_cpus, num_gpus=res.num_gpus, memory=res.memory or None,
            resources=dict(res.custom) or None, max_restarts=t.job.max_restarts,
            max_task_retries=0, name=f"wu{i}-{name}", namespace=self.namespace,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=k)).remote(launch)
      for name, where in zip(jobs, ray.get([t.actor.ready.remote() for t in jobs.values()],
                                           timeout=ex.placement_timeout_s)):
        self._note_where(jobs[name], where)
      ray.get(registry.set_started.remote())
      for name, where in zip(jobs, ray.get([t.actor.start.remote() for t in jobs.values()])):
        t = jobs[name]
        self._note_where(t, where)
        t.seen_starts = where["starts"]
        t.status.state, t.status.started_s = RUNNING, time.time()
      self._say(f"work unit {i}: started {', '.join(jobs)}")
    self._write_status()

  def _note_where(self, t: _Tracked, where: dict) -> None:
    st = t.status
    st.host, st.port, st.node, st.pid = where["host"], where["port"], where["node"], where["pid"]

  # ---------------------------------------------------------------- polling
  def _poll(self) -> list[JobStatus]:
    """Polls every live job's actor; applies restarts; returns the jobs that failed for good."""
    ray = self._ray
    live = [(t, t.actor.poll.remote()) for jobs in self.units for t in jobs.values()
            if t.status.state in (RUNNING, RESTARTING)]
    # One bounded wait for all: a call to an actor Ray is placing again waits in its queue,
    # and must not hold up the others' answers.
    ready, _ = ray.wait([ref for _, ref in live], num_returns=len(live),
                        timeout=self.executor.poll_timeout_s)
    ready = set(ready)
    failed = []
    up = set()  # the jobs whose actor answered
    now = time.monotonic()
    for t, ref in live:
      st = t.status
      if ref not in ready:
        if st.state == RESTARTING and now - t.down_since > self.executor.restart_timeout_s:
          st.state, st.ended_s = FAILED, time.time()
          self._say(f"[{st.work_unit}/{st.name}] not placed again in "
                    f"{self.executor.restart_timeout_s:g}s (no room on the cluster?)")
          failed.append(st)
          self._write_status()
        continue
      try:
        got = ray.get(ref)
      except ray.exceptions.RayActorError as e:
        if e.actor_init_failed:  # it cannot start anywhere: a broken job, not a lost node
          st.state, st.ended_s = FAILED, time.time()
          self._say(f"[{st.work_unit}/{st.name}] its actor failed to start: {e}")
          failed.append(st)
          self._write_status()
        elif st.state == RUNNING:
          t.deaths += 1
          if t.restarts_used > t.job.max_restarts:
            st.state, st.ended_s = FAILED, time.time()
            self._say(f"[{st.work_unit}/{st.name}] its actor died and it has no restarts left")
            failed.append(st)
          else:
            st.state, t.down_since = RESTARTING, now
            self._say(f"[{st.work_unit}/{st.name}] its actor died (node lost or killed): "
                      f"Ray places it again (restart {t.restarts_used} of "
                      f"{t.job.max_restarts})")
            self._restart_gang(t)
          self._write_status()
        continue
      up.add(id(t))
      self._note_where(t, got)
      if got["starts"] > t.seen_starts:  # a new start (after a restart): note and go on
        t.seen_starts = got["starts"]
        st.restarts = got["starts"] - 1
        if st.state == RESTARTING and not t.gang_pending:
          st.state = RUNNING
          where = f" at {st.host}:{st.port}" if st.port else ""
          self._say(f"[{st.work_unit}/{st.name}] running again on node {st.node[:12]}{where}")
        self._write_status()
      rc = got["returncode"]
      if rc is None or st.state != RUNNING:
        continue
      st.returncode = rc
      if rc == 0:
        st.state, st.ended_s = SUCCEEDED, time.time()
      elif t.stop_requested:
        st.state, st.ended_s = STOPPED, time.time()
      elif t.restarts_used < t.job.max_restarts:
        t.failures_restarted += 1
        self._say(f"[{st.work_unit}/{st.name}] failed (exit code {rc}): restarting "
                  f"({t.restarts_used} of {t.job.max_restarts})")
        if t.job.gang is None:
          t.actor.restart.remote(self.executor.grace_s)
        else:
          st.state, t.down_since = RESTARTING, now
          self._restart_gang(t)
        self._write_status()
        continue
      else:
        st.state, st.ended_s = FAILED, time.time()
        failed.append(st)
      self._say(f"[{st.work_unit}/{st.name}] {st.state} (exit code {rc})")
      self._write_status()
    self._start_ready_gangs(up)
    return failed

  def _gang(self, t: _Tracked) -> list[_Tracked]:
    """`t`'s gang, `t` included ([] when it has none)."""
    if t.job.gang is None:
      return []
    return [o for o in self.units[t.status.work_unit].values() if o.job.gang == t.job.gang]

  def _restart_gang(self, t: _Tracked) -> None:
    """`t` (of a gang) went down: stops the programs of the rest of its gang, which then wait,
    with it, until every member's actor is up (`_start_ready_gangs`). One process of a
    jax.distributed runtime cannot rejoin the others: they start again together."""
    members = self._gang(t)
    for o in members:
      o.gang_pending = True
      if o is t or o.status.state != RUNNING:
        continue
      o.status.state, o.down_since = RESTARTING, time.monotonic()
      try:
        self._ray.get(o.actor.stop.remote(self.executor.grace_s),
                      timeout=self.executor.grace_s + 30)
      except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
        pass  # its actor is gone too: Ray places it again
    if members:
      self._say(f"[{t.status.work_unit}/{t.status.name}] restarting its gang {t.job.gang!r} "
                f"({', '.join(o.status.name for o in members)}) once every member is up")

  def _start_ready_gangs(self, up: set) -> None:
    """Starts every gang whose members all wait and all answered this poll (a member placed
    again on another node has registered its new address, e.g. a new coordinator)."""
    seen = set()
    for jobs in self.units:
      for t in jobs.values():
        if not t.gang_pending or (t.status.work_unit, t.job.gang) in seen:
          continue
        seen.add((t.status.work_unit, t.job.gang))
        members = self._gang(t)
        if not all(o.gang_pending and o.status.state == RESTARTING and id(o) in up
                   for o in members):
          continue
        for o, where in zip(members, self._ray.get([o.actor.start.remote() for o in members])):
          self._note_where(o, where)
          o.seen_starts, o.status.restarts = where["starts"], where["starts"] - 1
          o.gang_pending, o.status.state = False, RUNNING
        self._say(f"gang {t.job.gang!r} of work unit {t.status.work_unit} started again")
        self._write_status()

  # ---------------------------------------------------------------- stopping
  def stop(self, work_units: Optional[set] = None, *, reason: str = "",
           services_only: bool = False) -> None:
    """Stops the running jobs (of `work_units`; only services with `services_only`)."""
    victims = [t for i, jobs in enumerate(self.units) for t in jobs.values()
               if t.status.state in (RUNNING, RESTARTING, PENDING)
               and (work_units is None or i in work_units)
               and (t.job.service or not services_only)]
    if not victims:
      return
    if reason:
      self._say(f"stopping {len(victims)} job(s): {reason}")
    refs = []
    for t in victims:
      t.stop_requested = True
      if t.status.state == RUNNING:
        refs.append((t, t.actor.stop.remote(self.executor.grace_s)))
      else:
        t.status.state = STOPPED
    for t, ref in refs:
      try:
        t.status.returncode = self._ray.get(ref, timeout=self.executor.grace_s + 30)
      except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
        pass  # the actor is gone, and its program with it (PR_SET_PDEATHSIG)
      t.status.state = SUCCEEDED if (services_only and t.job.service) else STOPPED
      t.status.ended_s = time.time()
    self._write_status()

  def _stop_finished_services(self) -> None:
    for i, jobs in enumerate(self.units):
      main = [t for t in jobs.values() if not t.job.service]
      if any(t.status.state in (PENDING, RUNNING, RESTARTING) for t in main):
        continue
      if any(t.job.service and t.status.state in (RUNNING, RESTARTING) for t in jobs.values()):
        self.stop({i}, reason=f"the jobs of work unit {i} ended: stopping its services",
                  services_only=True)

  def interrupt(self, signum: int) -> None:
    self._interrupted = signum

  # ---------------------------------------------------------------- waiting
  def done(self) -> bool:
    return all(t.status.state in (SUCCEEDED, FAILED, STOPPED)
               for jobs in self.units for t in jobs.values())

  def wait(self, timeout: Optional[float] = None) -> bool:
    """Runs the experiment to its end (or `timeout` seconds); True if it ended."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      if self._interrupted is not None:
        self.stop(reason=f"received {signal.Signals(self._interrupted).name}")
        return True
      apply_failure_policy(self.stop, self._poll(), self.executor.on_failure)
      self._stop_finished_services()
      if self.done():
        return True
      if deadline is not None and time.monotonic() >= deadline:
        return False
      time.sleep(self.executor.poll_s)

  @property
  def interrupted(self) -> bool:
    return self._interrupted is not None

  def succeeded(self) -> bool:
    return all(t.status.state == SUCCEEDED for jobs in self.units for t in jobs.values())

  def actor(self, name: str, work_unit: int = 0) -> Any:
    """The actor running job `name` (tests kill it as a failure would)."""
    return self.units[work_unit][name].actor

  def status(self, name: str, work_unit: int = 0) -> JobStatus:
    return self.units[work_unit][name].status

  def close(self) -> None:
    """Stops whatever still runs, then removes the actors, registries and placement groups."""
    ray = self._ray
    self.stop(reason="closing the run")
    for jobs in self.units:
      for t in jobs.values():
        if t.actor is not None:
          try:
            ray.kill(t.actor, no_restart=True)
          except Exception:  # pylint: disable=broad-except
            pass  # already gone
    for r in self._registries:
      try:
        ray.kill(r, no_restart=True)
      except Exception:  # pylint: disable=broad-except
        pass
    from ray.util.placement_group import remove_placement_group  # pylint: disable=g-import-not-at-top
    for pg in self._pgs:
      try:
        remove_placement_group(pg)
      except Exception:  # pylint: disable=broad-except
        pass
    self._pgs, self._registries = [], []

  # ---------------------------------------------------------------- reporting
  def _say(self, msg: str) -> None:
    out = self.executor.out
    if out is not None:
      out.write(f"[launch] {msg}\n")
      out.flush()

  def _write_status(self) -> None:
    doc = {"experiment": self.experiment.name, "dir": self.dir, "executor": "ray",
           "namespace": self.namespace,
           "work_units": [{"index": i, "params": _jsonable(wu.params),
                           "jobs": {n: t.status.to_json() for n, t in self.units[i].items()}}
                          for i, wu in enumerate(self.experiment.work_units)]}
    tmp = os.path.join(self.dir, "status.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(doc, f, indent=1)
    os.replace(tmp, os.path.join(self.dir, "status.json"))

  def summary(self) -> str:
    with open(os.path.join(self.dir, "status.json"), encoding="utf-8") as f:
      return status_table(json.load(f))


def _jsonable(x: Any) -> Any:
  return json.loads(json.dumps(x, default=str))


@dataclasses.dataclass
class RayExecutor:
  """Runs experiments on a Ray cluster (see the module docstring).

  Attributes:
    root_dir: experiments get `<root_dir>/<name>-<timestamp>` directories (on a filesystem
      every node mounts: the jobs write their logs there).
    ray_address: the cluster to join ("auto", "ray://...", "HOST:PORT"); None starts a local
      Ray with the CPUs and custom resources the experiment declares (`num_cpus` at least).
    repo_root: the workspace, at this path on every node. Default: targets.workspace_root().
    use_bazel: build Bazel targets here and run them from bazel-bin; False: `python -m`.
    bazel_args: extra `bazel build` flags.
    on_failure: "stop_work_unit", "stop_experiment" or "continue" (after restarts ran out).
    grace_s: SIGTERM -> SIGKILL delay when stopping a job.
    placement_strategy: the placement groups' strategy ("PACK", "SPREAD", "STRICT_SPREAD").
    placement_timeout_s: how long a work unit may wait for room on the cluster.
    num_cpus, object_store_memory: the local Ray's, when one is started.
    out: where launcher messages go (None: silent).
    poll_s: status polling period; poll_timeout_s: how long one poll waits for answers.
    restart_timeout_s: how long a job whose actor died may take to run again (its node's
      bundle placed again, its actor restarted) before it counts as failed.
  """
  root_dir: str
  ray_address: Optional[str] = None
  repo_root: Optional[str] = None
  use_bazel: bool = True
  bazel_args: tuple = ()
  on_failure: str = "stop_work_unit"
  grace_s: float = 5.0
  placement_strategy: str = "SPREAD"
  placement_timeout_s: float = 300.0
  num_cpus: Optional[int] = None
  object_store_memory: int = 100 << 20
  out: Optional[TextIO] = dataclasses.field(default_factory=lambda: sys.stdout)
  poll_s: float = 0.25
  poll_timeout_s: float = 2.0
  restart_timeout_s: float = 600.0

  def __post_init__(self):
    if self.on_failure not in ON_FAILURE:
      raise spec.SpecError(f"on_failure must be one of {ON_FAILURE}, got {self.on_failure!r}")
    self.repo_root = os.path.abspath(self.repo_root or targets.workspace_root())
    try:
      import ray  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise RayExecutorError(f"ray is not importable ({e}); it is in requirements.txt") from e
    self.ray = ray

  def _connect(self, experiment: spec.Experiment) -> None:
    """Joins the cluster, or starts a local Ray big enough for the experiment's bundles."""
    ray = self.ray
    if ray.is_initialized():
      return
    kw = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False,
          # Job actors import launch.* from the workspace (at this path on every node).
          "runtime_env": {"env_vars": {"PYTHONPATH": self.repo_root}}}
    if self.ray_address:
      ray.init(address=self.ray_address, **kw)
      return
    cpus, custom = 0.0, {}
    for wu in experiment.work_units:
      for j in wu.jobs:
        cpus += j.resources.num_cpus
        for k, v in j.resources.custom.items():
          custom[k] = custom.get(k, 0) + v
    # address="local": a new instance. Without it Ray joins any instance already running on the
    # machine (another run's, a concurrent test's), which then refuses num_cpus.
    ray.init(address="local", num_cpus=max(int(cpus + 0.999), self.num_cpus or 1),
             resources=custom or None, object_store_memory=self.object_store_memory, **kw)

  def _exp_dir(self, name: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(os.path.abspath(self.root_dir), f"{name}-{stamp}")
    path, k = base, 1
    while os.path.exists(path):
      path, k = f"{base}.{k}", k + 1
    os.makedirs(path)
    return path

  def launch(self, experiment: spec.Experiment) -> RayRun:
    """Builds targets, joins the cluster, places and starts every work unit."""
    if self.use_bazel:
      targets.build(experiment.bazel_labels, root=self.repo_root, bazel_args=self.bazel_args)
    commands = {}
    for wu in experiment.work_units:
      for j in wu.jobs:
        if j.executable not in commands:
          commands[j.executable] = targets.command(j.executable, root=self.repo_root,
                                                   use_bazel=self.use_bazel)
    self._connect(experiment)
    exp_dir = self._exp_dir(experiment.name)
    run = RayRun(self, experiment, exp_dir, commands,
                 namespace=f"launch-{os.path.basename(exp_dir)}")
    with open(os.path.join(exp_dir, "experiment.json"), "w", encoding="utf-8") as f:
      json.dump({"name": experiment.name, "executor": "ray", "work_units": [
          {"params": _jsonable(wu.params),
           "jobs": {j.name: {"argv": run.units[i][j.name].status.argv, "env": dict(j.env),
                             "resources": j.resources.bundle(),
                             "max_restarts": j.max_restarts, "service": j.service}
                    for j in wu.jobs}}
          for i, wu in enumerate(experiment.work_units)]}, f, indent=1)
    try:
      run._start()  # pylint: disable=protected-access
    except BaseException:
      run.close()
      raise
    return run

  def run(self, experiment: spec.Experiment) -> RayRun:
    """launch + wait + close, stopping everything on SIGINT/SIGTERM (from the main thread)."""
    run = self.launch(experiment)
    installed = {}
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        installed[sig] = signal.signal(sig, lambda s, _f: run.interrupt(s))
    try:
      run.wait()
    finally:
      run.close()
      for sig, old in installed.items():
        signal.signal(sig, old)
    return run
