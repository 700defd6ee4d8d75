"""`rl_part controller` stops with a clear message when trajectories cannot be written (#17
item 7): exit status 1, the trajectory directory and the error on stderr, no traceback. The
directory refuses every new file (tempfile.mkstemp raises PermissionError, as an unwritable
directory does for a non-root user); the controller's retries are pipeline/controller_test.py's."""

import os
import sys
import tempfile

import pytest

from moe import build
from moe import params as moe_params
from moe.tokenizer import ByteTokenizer
from pipeline import processes
from pipeline import testing
from rl import trajectory_io
from rollout import testing as rollout_testing
from rollout.engine import Engine
from tools import rl_part


def _refuse(*args, dir=None, **kw):  # pylint: disable=redefined-builtin,unused-argument
  raise PermissionError(13, "Permission denied", os.path.join(dir, ".tmp-x"))


@pytest.fixture
def sampler_url():
  """A real sampling server (rollout.server over a tiny engine) on 127.0.0.1."""
  engine = Engine.from_flat(moe_params.flatten(build.create(testing.MODEL, seed=0)),
                            testing.MODEL, tokenizer=ByteTokenizer(), config=testing.ENGINE)
  try:
    live = rollout_testing.LiveServer(engine)
    yield live.url
    live.close()
  finally:
    engine.stop()


def test_a_persistent_write_error_exits_1_naming_the_path_and_the_error(
    tmp_path, monkeypatch, capsys, sampler_url):
  monkeypatch.setattr(trajectory_io.tempfile, "mkstemp", _refuse)
  rc = rl_part.main(["controller", f"--workdir={tmp_path}", "--steps=1",
                     f"--samplers={sampler_url}", "--gin.PipelineConfig.prompts_per_step=1",
                     "--gin.PipelineConfig.attempts=2", "--gin.PipelineConfig.max_new_tokens=4",
                     "--gin.ExperimentConfig.sandbox_pool=1"])
  monkeypatch.setattr(trajectory_io.tempfile, "mkstemp", tempfile.mkstemp)
  captured = capsys.readouterr()
  traj = processes.paths(str(tmp_path))["trajectories"]
  assert rc == 1, captured
  assert "error: could not write group 0" in captured.err, captured.err
  assert traj in captured.err and "PermissionError" in captured.err, captured.err
  assert "Traceback" not in captured.err
  assert not trajectory_io.list_shards(traj)
  assert '"episodes_lost": 2' in captured.out  # the summary still comes out


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
