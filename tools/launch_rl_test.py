"""The RL launch config (tools/configs/launch/rl.gin) under the local executor, no Ray: the
parts find each other by name, the samplers (services) are stopped once the learner and the
controller are done, and the run directory holds every part's log, status.json, summary.json
with the run's counts and metrics.jsonl; `--status=RUN_DIR` shows each part's state.

The pipeline tests' tiny model (tools/testing.RL_TINY_BINDINGS), 2 steps: ~40 s on the quiet
2-core machine. The same config on a Ray cluster, with faults: tools/launch_rl_ray_test.py.
"""

import glob
import json
import os
import sys

import pytest

from tools import launcher as launch_tool
from tools import testing

STEPS = 2  # two steps: metrics.jsonl in order, counts over more than one step
EPISODES = STEPS * 2 * 4  # prompts_per_step x attempts (RL_TINY_BINDINGS)


def test_rl_gin_runs_locally_and_reports_its_counts(tmp_path, capsys):
  rc = launch_tool.main(testing.rl_launch_flags(STEPS, str(tmp_path)))
  out = capsys.readouterr().out
  assert rc == 0, out[-5000:]
  (run_dir,) = glob.glob(str(tmp_path / "rl-*"))
  with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
    (unit,) = json.load(f)["work_units"]
  assert unit["steps"] == STEPS
  assert unit["episodes_generated"] == unit["episodes_read"] == EPISODES, unit
  assert unit["episodes_trained"] + unit["episodes_stale"] == EPISODES, unit
  assert unit["episodes_lost"] == unit["duplicate_episodes"] == 0, unit
  assert unit["states"] == {"learner": "succeeded", "sampler_0": "succeeded",
                            "sampler_1": "succeeded", "controller": "succeeded"}
  with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
    assert [json.loads(line)["step"] for line in f] == list(range(1, STEPS + 1))
  for part in ("learner", "sampler_0", "sampler_1", "controller"):
    assert os.path.getsize(os.path.join(run_dir, "wu0", f"{part}.log")) > 0
  # The controller asked for its samplers by name, and they served on the reserved ports.
  with open(os.path.join(run_dir, "status.json"), encoding="utf-8") as f:
    jobs = json.load(f)["work_units"][0]["jobs"]
  log = open(os.path.join(run_dir, "wu0", "sampler_0.log"), encoding="utf-8").read()
  assert str(jobs["sampler_0"]["port"]) in log
  assert launch_tool.main([f"--status={run_dir}"]) == 0
  status = capsys.readouterr().out
  assert "sampler_1   succeeded" in status and "wu0/controller.log" in status
  assert f"episodes_generated {EPISODES}" in status and "episodes_lost 0" in status


def test_status_of_a_directory_that_is_no_run_is_an_error(tmp_path, capsys):
  assert launch_tool.main([f"--status={tmp_path}"]) == 2
  assert "has no status.json" in capsys.readouterr().err


def test_rl_gin_jobs_name_each_other(capsys):
  rc = launch_tool.main(["--experiment=tools/configs/launch/rl.gin", "--dry_run=True",
                         "--gin.rl_jobs.learner_processes=2", "--gin.rl_jobs.relays=2",
                         "--gin.rl_jobs.samplers=3"])
  out = capsys.readouterr().out
  assert rc == 0
  assert ("learner_1: //tools:rl_part learner --gin_file=tools/configs/experiments/default.gin "
          "--num_processes=2 --process_id=1 --coordinator=@learner_0") in out
  assert "relay_1: //tools:rl_part relay --upstream=@relay_0" in out
  assert "sampler_2: //tools:rl_part sampler --weights_via=@relay_1,@relay_0" in out
  assert "controller: //tools:rl_part controller --samplers=@sampler_0,@sampler_1,@sampler_2" \
      in out


def test_retries_count_every_controller_incarnation_and_each_group_once(tmp_path):
  """A controller killed before its summary line still counts the retries of the groups it
  wrote; a group written again after a restart counts once (its last line)."""
  from tools import rl_launch  # pylint: disable=g-import-not-at-top
  log = tmp_path / "controller.log"
  log.write_text("\n".join([
      "group 0 t-a rewards [1.0, 0.0] retries 2",
      "group 1 t-b rewards [0.0, 0.0] retries 1",
      # killed here: no summary line; the restarted controller writes group 1 again
      "controller resumed at group 1",
      "group 1 t-b rewards [0.0, 1.0] retries 0",
      "group 2 t-c rewards [1.0, 1.0] retries 3",
      rl_launch.CONTROLLER_SUMMARY + json.dumps({"sampler_retries": 3}),
  ]) + "\n")
  unit = {"jobs": {"controller": {"log_path": str(log), "state": "succeeded"}}}
  counts, _ = rl_launch.summarize_unit(str(tmp_path), unit)
  assert counts["episodes_retried"] == 2 + 0 + 3, counts
  assert counts["controller_runs_ended"] == 1


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
