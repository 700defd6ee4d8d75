"""The RL pipeline as a launcher experiment: its jobs, and its run's summary and status.

`rl_jobs(...)` turns a launch config (tools/configs/launch/rl.gin: learner processes, sampler
replicas, relays, the experiment gin every part trains with) into the launcher's named jobs, one
`//tools:rl_part` per part, that find each other by name (`@sampler_0`, `@learner_0`) whichever
executor runs them: the local one (processes on this machine) or Ray (actors placed by the
resources each part declares). The samplers and relays are services: they serve until the
learner and the controller have ended, then the executor stops them.

`summarize(run_dir)` gathers what the parts counted into the run's `summary.json` (and every
learner step into `metrics.jsonl`), from their logs and the work directory, because no part
sees the whole run: a controller killed and restarted prints its counts once per incarnation
that ended, the learner's own counts are checkpointed with its reader (so its last summary
covers every step, restarts included), and the records on disk are the episodes generated.

gin lives here (tools/): launch/ and pipeline/ take plain objects.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping, Optional, Sequence

import gin

from launch import spec

RL_PART = "//tools:rl_part"
CONTROLLER_SUMMARY = "controller summary "
# A group the controller wrote (pipeline.processes.run_controller's line per group): its index
# and the sampler requests retried on another sampler while it was generated.
_GROUP_LINE = re.compile(r"^group (\d+) \S+ rewards .* retries (\d+)$")


@gin.configurable
def resources(num_cpus: float = 1.0, num_gpus: float = 0.0, memory: int = 0,
              custom: Optional[Mapping[str, float]] = None) -> spec.Resources:
  """What one part needs of its machine (launch.spec.Resources; Ray places parts by it)."""
  return spec.Resources(num_cpus=num_cpus, num_gpus=num_gpus, memory=int(memory),
                        custom=dict(custom or {}))


@gin.configurable
def rl_jobs(experiment_gin: str = "tools/configs/experiments/default.gin",
            steps: Optional[int] = None, learner_processes: int = 1, samplers: int = 2,
            relays: int = 0, gin_files: Sequence[str] = (), bindings: Sequence[str] = (),
            tokenizer: Optional[str] = None,
            init_checkpoint: Optional[str] = None,
            learner_resources: Optional[spec.Resources] = None,
            sampler_resources: Optional[spec.Resources] = None,
            controller_resources: Optional[spec.Resources] = None,
            relay_resources: Optional[spec.Resources] = None,
            max_restarts: int = 3, learner_env: Optional[Mapping[str, str]] = None,
            target: str = RL_PART) -> list[spec.Job]:
  """The pipeline's parts as named jobs.

  Args:
    experiment_gin: the experiment every part trains with (its model, PipelineConfig, learner
      settings, tasks); `gin_files` (more tiers after it, e.g. one that has the controller grade
      in a Ray sandbox fleet of PipelineConfig.grader_hosts hosts) and `bindings`
      ("RLConfig.steps=10", ...) are added to it in every part.
    steps: learner steps (and the controller's groups for them); None: the experiment's.
    learner_processes: processes of one jax.distributed learner (`learner_0` is the
      coordinator; they restart together as one gang); 1: one job named `learner`.
    samplers: sampler replicas `sampler_0..`, each a service the controller finds by name.
    relays: weight relays; 0: samplers read the work directory's store. `relay_0` reads the
      store; each further relay pulls from it, and sampler i reads through relay 1 + i mod
      (relays - 1), then relay_0 (with one relay, through relay_0).
    tokenizer, init_checkpoint: rl_part's --tokenizer (every part) and the learner's
      --init_checkpoint.
    *_resources: what each part declares (default: 1 CPU each, as launch.spec.Resources).
    max_restarts: times a part is started again after it failed or its node died.
    learner_env: extra environment of the learner processes (e.g. XLA_FLAGS).
    target: the parts' Bazel target.
  """
  if learner_processes < 1 or samplers < 1 or relays < 0:
    raise spec.SpecError("need learner_processes >= 1, samplers >= 1 and relays >= 0")
  exe = spec.BazelBinary(target)
  common = [f"--gin_file={experiment_gin}", *[f"--gin_file={f}" for f in gin_files],
            *[f"--gin.{b}" for b in bindings]]
  if tokenizer:
    common.append(f"--tokenizer={tokenizer}")
  step_args = [f"--steps={steps}"] if steps is not None else []
  res = {k: v or spec.Resources() for k, v in (
      ("learner", learner_resources), ("sampler", sampler_resources),
      ("controller", controller_resources), ("relay", relay_resources))}
  jobs = []
  learner_args = ["learner", *step_args, *common]
  if init_checkpoint:
    learner_args.append(f"--init_checkpoint={init_checkpoint}")
  if learner_processes == 1:
    jobs.append(spec.Job("learner", exe, learner_args, env=dict(learner_env or {}), port=False,
                         resources=res["learner"], max_restarts=max_restarts))
  else:
    for i in range(learner_processes):
      jobs.append(spec.Job(
          f"learner_{i}", exe, [*learner_args, f"--num_processes={learner_processes}",
                                f"--process_id={i}", "--coordinator=@learner_0"],
          env=dict(learner_env or {}), port=i == 0, resources=res["learner"],
          max_restarts=max_restarts, gang="learner"))
  for k in range(relays):
    up = ["--upstream=@relay_0"] if k else []
    jobs.append(spec.Job(f"relay_{k}", exe, ["relay", *up, *common], resources=res["relay"],
                         max_restarts=max_restarts, service=True))
  for i in range(samplers):
    via = []
    if relays == 1:
      via = ["--weights_via=@relay_0"]
    elif relays > 1:
      via = [f"--weights_via=@relay_{1 + i % (relays - 1)},@relay_0"]
    jobs.append(spec.Job(f"sampler_{i}", exe, ["sampler", *via, *common],
                         resources=res["sampler"], max_restarts=max_restarts, service=True))
  names = ",".join(f"@sampler_{i}" for i in range(samplers))
  jobs.append(spec.Job("controller", exe, ["controller", f"--samplers={names}", *step_args,
                                           *common],
                       port=False, resources=res["controller"], max_restarts=max_restarts))
  return jobs


# ------------------------------------------------------------------------ the run's summary
def _read(path: str) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return f.read()
  except OSError:
    return ""


def _load_status(run_dir: str) -> dict:
  with open(os.path.join(run_dir, "status.json"), encoding="utf-8") as f:
    return json.load(f)


def summarize_unit(run_dir: str, unit: Mapping[str, Any]) -> tuple[dict, list]:
  """(the counts, the learner's step records) of one work unit of an RL launch (see the module
  docstring).

  episodes_generated: attempts written to the work directory (every controller incarnation);
  episodes_trained / _stale: the learner's (pipeline.step_batches.StepStats, checkpointed, so
  restarts neither drop nor double them); episodes_retried: sampler requests retried on
  another sampler while the written groups were generated (the controller's line per group,
  so an incarnation killed before its summary counts too; a group written twice counts
  once); episodes_lost: the learner's lost records (missing
  shards) plus what controllers generated but never wrote; duplicate_episodes: attempts
  written twice (by a controller that repeated a group after a restart); grading: where the
  attempts were graded, with a Ray sandbox fleet its grades, retries and host failures
  (`_grading_counts`).
  """
  from pipeline import processes  # pylint: disable=g-import-not-at-top
  from rl import trajectory_io  # pylint: disable=g-import-not-at-top
  jobs = unit["jobs"]
  learner = "learner" if "learner" in jobs else "learner_0"
  learner_log = _read(jobs[learner]["log_path"]) if learner in jobs else ""
  steps = {}
  for rec in processes.parse_step_lines(learner_log):
    steps[rec["step"]] = rec  # a step replayed after a restart: its last run counts
  try:
    learned = processes.parse_summary(learner_log)
  except ValueError:
    learned = {}
  controller_log = _read(jobs.get("controller", {}).get("log_path", "")).splitlines()
  controllers = [json.loads(line[len(CONTROLLER_SUMMARY):]) for line in controller_log
                 if line.startswith(CONTROLLER_SUMMARY)]
  group_retries = {int(m.group(1)): int(m.group(2))
                   for m in map(_GROUP_LINE.match, controller_log) if m}
  grading = [c["grading"] for c in controllers if c.get("grading", {}).get("grader") == "ray"]
  traj = os.path.join(run_dir, "work", "trajectories")
  ids = []
  if os.path.isdir(traj):
    for name in trajectory_io.list_shards(traj):
      ids += [r["episode_id"] for r in trajectory_io.read_shard(os.path.join(traj, name))
              if r is not None]
  return {
      "steps": learned.get("step", max(steps, default=0)),
      "episodes_generated": len(set(ids)),
      "episodes_read": learned.get("episodes", 0),
      "episodes_trained": learned.get("trained_episodes", 0),
      "episodes_stale": learned.get("stale_episodes", 0),
      "episodes_retried": sum(group_retries.values()),
      "episodes_lost": learned.get("lost_episodes", 0) + sum(c.get("episodes_lost", 0)
                                                             for c in controllers),
      "duplicate_episodes": len(ids) - len(set(ids)),
      "infra_failures": learned.get("infra_failures", 0),
      "rejected_episodes": learned.get("rejected_episodes", 0),
      "controller_runs_ended": len(controllers),
      "grading": _grading_counts(grading, controllers) if grading else {"grader": "local"},
      "restarts": {n: j.get("restarts", 0) for n, j in jobs.items()},
      "states": {n: j["state"] for n, j in jobs.items()},
      "learner_summary": learned,
  }, [steps[s] for s in sorted(steps)]


def _grading_counts(grading: Sequence[Mapping], controllers: Sequence[Mapping]) -> dict:
  """The Ray sandbox fleet's counts over the controller incarnations that ended: grades, those
  retried on another host after theirs died, host failures, the process ids that graded (each
  a fleet host actor's), and the episodes those incarnations generated, each graded once when
  `grades` equals it."""
  pids = set()
  for g in grading:
    pids |= {g["host_pids"][h] for h, n in g.get("grades_by_host", {}).items()
             if n and h in g.get("host_pids", {})}
  return {"grader": "ray",
          "grades": sum(g.get("grades", 0) for g in grading),
          "episodes_graded": sum(c.get("episodes_generated", 0) for c in controllers
                                 if c.get("grading", {}).get("grader") == "ray"),
          "retried_grades": sum(g.get("retried_grades", 0) for g in grading),
          "jobs_retried": sum(g.get("jobs_retried", 0) for g in grading),
          "host_failures": sum(g.get("host_failures", 0) for g in grading),
          "fleet_errors": sum(g.get("fleet_errors", 0) for g in grading),
          "grading_pids": sorted(pids)}


def summarize(run_dir: str, write: bool = True) -> dict:
  """The run's summary (one entry per work unit); with `write`, also summary.json and
  metrics.jsonl (the learner's step records, each step once) in `run_dir`."""
  doc = _load_status(run_dir)
  units, metrics = [], []
  for unit in doc["work_units"]:
    counts, steps = summarize_unit(run_dir, unit)
    units.append({"index": unit["index"], "params": unit.get("params", {}), **counts})
    metrics += [{"work_unit": unit["index"], **s} for s in steps]
  summary = {"experiment": doc["experiment"], "executor": doc.get("executor", "local"),
             "work_units": units}
  if write:
    with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
      json.dump(summary, f, indent=1)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
      for m in metrics:
        f.write(json.dumps(m) + "\n")
  return summary


def status_report(run_dir: str) -> str:
  """Each part's state (launch.local.status_table) and the run's counts so far."""
  from launch import local  # pylint: disable=g-import-not-at-top
  doc = _load_status(run_dir)
  lines = [f"experiment {doc['experiment']} ({doc.get('executor', 'local')} executor) in "
           f"{doc['dir']}", local.status_table(doc)]
  if any(n.startswith(("learner", "controller")) for u in doc["work_units"] for n in u["jobs"]):
    for u in summarize(run_dir, write=False)["work_units"]:
      counts = {k: v for k, v in u.items() if k.startswith("episodes_") or k in (
          "steps", "duplicate_episodes")}
      lines.append(f"work unit {u['index']}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
  return "\n".join(lines)
