"""The local executor: every job of a work unit is a process group on this machine.

What it does for an `Experiment`:
  * builds all Bazel targets once (or resolves them to Python modules, see `launch.targets`);
  * per work unit, reserves a port per job, writes the address map (`launch.discovery`) and starts
    the jobs, each in its own session/process group so that stopping a job also stops whatever it
    spawned;
  * streams every job's stdout+stderr to the console with a `[<work unit>/<job>]` prefix and to
    `<experiment dir>/wu<i>/<job>.log`;
  * tracks status (pending, running, succeeded, failed, stopped, with exit codes) and writes it to
    `<experiment dir>/status.json` on every change;
  * stops jobs on failure (`on_failure`: "stop_work_unit", the default as in XManager where a work
    unit lives and dies together; "stop_experiment"; or "continue"), and everything on SIGINT or
    SIGTERM: SIGTERM to each process group, SIGKILL after `grace_s`.

Work units run concurrently up to `max_parallel` (a sweep on a small machine can run one at a
time).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional, TextIO

from launch import discovery
from launch import spec
from launch import targets

PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED = "pending", "running", "succeeded", "failed", \
    "stopped"
ON_FAILURE = ("stop_work_unit", "stop_experiment", "continue")


@dataclasses.dataclass
class JobStatus:
  work_unit: int
  name: str
  argv: list
  log_path: str
  state: str = PENDING
  returncode: Optional[int] = None
  pid: Optional[int] = None
  started_s: Optional[float] = None
  ended_s: Optional[float] = None
  port: Optional[int] = None
  host: Optional[str] = None
  service: bool = False
  restarts: int = 0
  node: Optional[str] = None

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


class _JobProcess:
  """A started job: the Popen, its process group and the log pump thread."""

  def __init__(self, status: JobStatus, env: dict, cwd: str, prefix: str,
               out: Optional[TextIO], out_lock: threading.Lock):
    self.status = status
    self.stop_requested = False
    os.makedirs(os.path.dirname(status.log_path), exist_ok=True)
    self._log = open(status.log_path, "wb")
    # start_new_session: the job leads its own process group (pgid == pid), so killpg reaches
    # its children too, and a Ctrl-C in the terminal reaches only the launcher, which then
    # stops the groups in order.
    self.proc = subprocess.Popen(status.argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    status.pid = self.proc.pid
    status.state = RUNNING
    status.started_s = time.time()
    self._pump = threading.Thread(target=self._pump_logs, args=(prefix, out, out_lock),
                                  daemon=True, name=f"log-{prefix}")
    self._pump.start()

  def _pump_logs(self, prefix: str, out: Optional[TextIO], lock: threading.Lock) -> None:
    for line in iter(self.proc.stdout.readline, b""):
      self._log.write(line)
      self._log.flush()
      if out is not None:
        with lock:
          out.write(f"[{prefix}] {line.decode('utf-8', 'replace').rstrip()}\n")
          out.flush()
    self.proc.stdout.close()

  def poll(self) -> Optional[int]:
    return self.proc.poll()

  def signal_group(self, sig: int) -> bool:
    """Sends `sig` to the job's process group; False if the group is gone."""
    try:
      os.killpg(self.proc.pid, sig)
      return True
    except (ProcessLookupError, PermissionError):
      return False

  def finish(self) -> None:
    """Reaps the process, kills leftovers of its group, closes the log."""
    self.proc.wait()
    self.signal_group(signal.SIGKILL)  # grandchildren left behind by a job that exited
    self._pump.join(timeout=5)
    self._log.close()


class ExperimentRun:
  """A launched experiment (see LocalExecutor.launch)."""

  def __init__(self, executor: "LocalExecutor", experiment: spec.Experiment, exp_dir: str,
               commands: dict):
    self.executor = executor
    self.experiment = experiment
    self.dir = exp_dir
    self._commands = commands  # executable -> argv prefix
    self.statuses: list[dict[str, JobStatus]] = []
    for i, wu in enumerate(experiment.work_units):
      self.statuses.append({
          j.name: JobStatus(work_unit=i, name=j.name,
                            argv=commands[j.executable] + j.argv_args,
                            log_path=os.path.join(exp_dir, f"wu{i}", f"{j.name}.log"),
                            service=j.service)
          for j in wu.jobs})
    self._procs: dict[tuple[int, str], _JobProcess] = {}
    self._next_wu = 0
    self._out_lock = threading.Lock()
    self._interrupted: Optional[int] = None
    self._start_failures: list[JobStatus] = []
    self._write_status()

  # ---------------------------------------------------------------- scheduling
  def _running_units(self) -> set:
    return {i for (i, _), p in self._procs.items() if p.status.state == RUNNING}

  def _start_work_unit(self, i: int) -> None:
    wu = self.experiment.work_units[i]
    ex = self.executor
    table = {}
    for j in wu.jobs:
      port = discovery.free_port(ex.host) if j.port else None
      self.statuses[i][j.name].port = port
      self.statuses[i][j.name].host = ex.host
      table[j.name] = {"host": ex.host, "port": port}
    jobs_json = os.path.join(self.dir, f"wu{i}", "jobs.json")
    os.makedirs(os.path.dirname(jobs_json), exist_ok=True)
    discovery.write_jobs_file(jobs_json, table, work_unit=i, experiment=self.experiment.name,
                              params=_jsonable(wu.params))
    for j in wu.jobs:
      env = targets.python_env(ex.repo_root)
      env.update({discovery.JOBS_JSON: jobs_json, discovery.JOB_NAME: j.name,
                  discovery.WORK_UNIT: str(i), discovery.EXPERIMENT_DIR: self.dir})
      env.update(j.env)
      st = self.statuses[i][j.name]
      try:
        self._procs[(i, j.name)] = _JobProcess(st, env, ex.repo_root, f"{i}/{j.name}",
                                               ex.out if ex.stream_logs else None, self._out_lock)
      except OSError as e:
        st.state, st.returncode = FAILED, None
        self._start_failures.append(st)
        self._say(f"[{i}/{j.name}] could not start {st.argv[0]!r}: {e}")
    self._write_status()

  def _fill(self) -> None:
    limit = self.executor.max_parallel or len(self.experiment.work_units)
    while (self._next_wu < len(self.experiment.work_units)
           and len(self._running_units()) < limit and self._interrupted is None):
      self._start_work_unit(self._next_wu)
      self._next_wu += 1

  def _reap(self) -> list[JobStatus]:
    """Collects jobs that exited since the last call; returns the ones that failed."""
    failed, self._start_failures = self._start_failures, []
    for p in list(self._procs.values()):
      st = p.status
      if st.state != RUNNING:
        continue
      rc = p.poll()
      if rc is None:
        continue
      p.finish()
      st.returncode, st.ended_s = rc, time.time()
      st.state = STOPPED if p.stop_requested else (SUCCEEDED if rc == 0 else FAILED)
      self._say(f"[{st.work_unit}/{st.name}] {st.state} (exit code {rc})")
      if st.state == FAILED:
        failed.append(st)
      self._write_status()
    return failed

  # ---------------------------------------------------------------- stopping
  def stop(self, work_units: Optional[set] = None, *, reason: str = "") -> None:
    """Stops running jobs (of `work_units`, default all): SIGTERM, then SIGKILL after grace_s."""
    victims = [p for (i, _), p in self._procs.items()
               if p.status.state == RUNNING and (work_units is None or i in work_units)]
    self._stop_procs(victims, reason)
    if work_units is None:
      self._next_wu = len(self.experiment.work_units)  # start nothing more
      for sts in self.statuses:
        for st in sts.values():
          if st.state == PENDING:
            st.state = STOPPED
      self._write_status()

  def _stop_procs(self, victims: list, reason: str) -> None:
    """SIGTERM to each of `victims`' groups, SIGKILL after grace_s; reaps them."""
    if not victims:
      return
    if reason:
      self._say(f"stopping {len(victims)} job(s): {reason}")
    for p in victims:
      p.stop_requested = True
      p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + self.executor.grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in victims):
      time.sleep(0.02)
    for p in victims:
      if p.poll() is None:
        self._say(f"[{p.status.work_unit}/{p.status.name}] did not exit in "
                  f"{self.executor.grace_s}s: SIGKILL")
        p.signal_group(signal.SIGKILL)
    for p in victims:
      p.proc.wait()  # SIGKILL cannot be ignored; this returns as soon as it is delivered
    self._reap()

  def _stop_finished_services(self) -> None:
    """Stops the service jobs (spec.Job.service) of work units whose other jobs all ended."""
    for i, sts in enumerate(self.statuses):
      main = [st for st in sts.values() if not st.service]
      if any(st.state in (PENDING, RUNNING) for st in main):
        continue
      if any(st.service and st.state == RUNNING for st in sts.values()):
        self.stop_services(i)

  def stop_services(self, i: int) -> None:
    """Stops work unit `i`'s running services; each counts as succeeded (it did its job)."""
    victims = [p for (wu, _), p in self._procs.items()
               if wu == i and p.status.service and p.status.state == RUNNING]
    self._stop_procs(victims, f"the jobs of work unit {i} ended: stopping its services")
    for p in victims:
      if p.status.state == STOPPED:
        p.status.state = SUCCEEDED
    self._write_status()

  def interrupt(self, signum: int) -> None:
    """Called from a signal handler: wait() stops everything at its next poll."""
    self._interrupted = signum

  # ---------------------------------------------------------------- waiting
  def done(self) -> bool:
    return (self._next_wu >= len(self.experiment.work_units)
            and not self._running_units())

  def wait(self, timeout: Optional[float] = None) -> bool:
    """Runs the experiment to the end (or `timeout` seconds); True if it ended.

    Starts pending work units as slots free up, applies the failure policy, and stops
    everything if `interrupt` was called.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      if self._interrupted is not None:
        self.stop(reason=f"received {signal.Signals(self._interrupted).name}")
        return True
      apply_failure_policy(self.stop, self._reap(), self.executor.on_failure)
      self._stop_finished_services()
      self._fill()
      if self.done():
        return True
      if deadline is not None and time.monotonic() >= deadline:
        return False
      time.sleep(self.executor.poll_s)

  @property
  def interrupted(self) -> bool:
    return self._interrupted is not None

  def succeeded(self) -> bool:
    return all(st.state == SUCCEEDED for sts in self.statuses for st in sts.values())

  def pids(self) -> list[int]:
    return [st.pid for sts in self.statuses for st in sts.values() if st.pid is not None]

  # ---------------------------------------------------------------- reporting
  def _say(self, msg: str) -> None:
    if self.executor.out is not None:
      with self._out_lock:
        self.executor.out.write(f"[launch] {msg}\n")
        self.executor.out.flush()

  def _write_status(self) -> None:
    doc = {"experiment": self.experiment.name, "dir": self.dir,
           "work_units": [{"index": i, "params": _jsonable(wu.params),
                           "jobs": {n: st.to_json() for n, st in self.statuses[i].items()}}
                          for i, wu in enumerate(self.experiment.work_units)]}
    tmp = os.path.join(self.dir, "status.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(doc, f, indent=1)
    os.replace(tmp, os.path.join(self.dir, "status.json"))

  def summary(self) -> str:
    """A table: work unit, job, state, exit code, log."""
    with open(os.path.join(self.dir, "status.json"), encoding="utf-8") as f:
      return status_table(json.load(f))


def apply_failure_policy(stop, failed, policy: str) -> None:
  """What an executor does about jobs that failed (`JobStatus`es with `work_unit` and `name`):
  `stop(units, reason=...)` their work unit ("stop_work_unit"), everything ("stop_experiment";
  `stop(reason=...)`), or nothing ("continue")."""
  for st in failed:
    if policy == "stop_work_unit":
      stop({st.work_unit}, reason=f"{st.work_unit}/{st.name} failed")
    elif policy == "stop_experiment":
      stop(reason=f"{st.work_unit}/{st.name} failed")


def status_table(doc: dict) -> str:
  """A status.json document (either executor's) as a table: work unit, job, state, exit code,
  restarts, where it runs (host:port, node) and its log relative to the experiment directory."""
  rows = [("wu", "job", "state", "exit", "restarts", "address", "log")]
  for wu in doc["work_units"]:
    for name, st in wu["jobs"].items():
      addr = f"{st.get('host') or ''}:{st['port']}" if st.get("port") else ""
      if st.get("node"):
        addr = f"{addr} node {st['node'][:8]}".strip()
      rows.append((str(wu["index"]), name, st["state"],
                   "" if st.get("returncode") is None else str(st["returncode"]),
                   str(st.get("restarts", 0)), addr,
                   os.path.relpath(st["log_path"], doc["dir"])))
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def _jsonable(x: Any) -> Any:
  return json.loads(json.dumps(x, default=str))


@dataclasses.dataclass
class LocalExecutor:
  """Runs experiments as local process groups (see the module docstring).

  Attributes:
    root_dir: experiments get `<root_dir>/<name>-<timestamp>` directories.
    repo_root: the workspace (cwd of every job; on PYTHONPATH). Default: targets.workspace_root().
    use_bazel: build and run Bazel targets; False runs them as Python modules (targets docstring).
    bazel_args: extra `bazel build` flags.
    on_failure: "stop_work_unit", "stop_experiment" or "continue".
    grace_s: SIGTERM -> SIGKILL delay when stopping.
    max_parallel: most work units running at once (None: all).
    stream_logs: echo job output with a prefix to `out`.
    out: where launcher messages and streamed logs go (None: silent).
    host: the address jobs listen on and peers connect to.
    poll_s: status polling period.
  """
  root_dir: str
  repo_root: Optional[str] = None
  use_bazel: bool = True
  bazel_args: tuple = ()
  on_failure: str = "stop_work_unit"
  grace_s: float = 5.0
  max_parallel: Optional[int] = None
  stream_logs: bool = True
  out: Optional[TextIO] = dataclasses.field(default_factory=lambda: sys.stdout)
  host: str = "127.0.0.1"
  poll_s: float = 0.05

  def __post_init__(self):
    if self.on_failure not in ON_FAILURE:
      raise spec.SpecError(f"on_failure must be one of {ON_FAILURE}, got {self.on_failure!r}")
    if self.grace_s < 0 or (self.max_parallel is not None and self.max_parallel < 1):
      raise spec.SpecError("grace_s must be >= 0 and max_parallel >= 1")
    self.repo_root = os.path.abspath(self.repo_root or targets.workspace_root())

  def _exp_dir(self, name: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(os.path.abspath(self.root_dir), f"{name}-{stamp}")
    path, k = base, 1
    while os.path.exists(path):
      path, k = f"{base}.{k}", k + 1
    os.makedirs(path)
    return path

  def launch(self, experiment: spec.Experiment) -> ExperimentRun:
    """Builds targets, creates the experiment directory and starts the first work units."""
    if self.use_bazel:
      targets.build(experiment.bazel_labels, root=self.repo_root, bazel_args=self.bazel_args)
    commands = {}
    for wu in experiment.work_units:
      for j in wu.jobs:
        if j.executable not in commands:
          commands[j.executable] = targets.command(j.executable, root=self.repo_root,
                                                   use_bazel=self.use_bazel)
    run = ExperimentRun(self, experiment, self._exp_dir(experiment.name), commands)
    with open(os.path.join(run.dir, "experiment.json"), "w", encoding="utf-8") as f:
      json.dump({"name": experiment.name, "work_units": [
          {"params": _jsonable(wu.params),
           "jobs": {j.name: {"argv": run.statuses[i][j.name].argv, "env": dict(j.env)}
                    for j in wu.jobs}}
          for i, wu in enumerate(experiment.work_units)]}, f, indent=1)
    run._fill()  # pylint: disable=protected-access
    return run

  def run(self, experiment: spec.Experiment) -> ExperimentRun:
    """launch + wait, stopping everything on SIGINT/SIGTERM (handlers installed while running,
    when called from the main thread)."""
    run = self.launch(experiment)
    installed = {}
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        installed[sig] = signal.signal(sig, lambda s, _f: run.interrupt(s))
    try:
      run.wait()
    except BaseException:
      run.stop(reason="launcher error")
      raise
    finally:
      for sig, old in installed.items():
        signal.signal(sig, old)
    return run
