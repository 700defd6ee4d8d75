"""The main job's command line: gin flags are passed through, bad configs exit 2 early."""

import sys

import pytest

from tools import main as main_lib
from tools import train as train_lib


def test_parse_args_collects_gin_flags():
  args, files, bindings = main_lib.parse_args(["--gin_file=a.gin", "--gin.RLConfig.steps=3",
                                               "--run_dir=/tmp/x", "--gin.EvalConfig.samples=2"])
  assert files == ["a.gin"] and args.run_dir == "/tmp/x"
  assert bindings == ["RLConfig.steps = 3", "EvalConfig.samples = 2"]
  assert main_lib.parse_args([])[1] == [main_lib.DEFAULT_EXPERIMENT]


@pytest.mark.parametrize("flag", ["--nonsense=1", "--gin_binding=EvalConfig.samples=2",
                                  "--gin_param=EvalConfig.samples=2", "--gin=a.gin",
                                  "--binding=EvalConfig.samples=2", "--gin.EvalConfig.samples"])
def test_parse_args_refuses_other_spellings(flag, capsys):
  """One spelling in every binary: the old ones (and a binding without a value) are errors."""
  with pytest.raises(SystemExit) as e:
    main_lib.parse_args([flag])
  assert e.value.code == 2 and "unknown argument" in capsys.readouterr().err


@pytest.mark.parametrize("entry", [main_lib.main, train_lib.main])
def test_bad_configs_fail_before_any_work(entry, tmp_path, capsys):
  assert entry(["--gin.PipelineConfig.max_staleness=-1", f"--run_dir={tmp_path}/r"]) == 2
  assert "max_staleness" in capsys.readouterr().err
  assert entry(["--gin.NoSuchThing.x=1", f"--run_dir={tmp_path}/r"]) == 2
  assert not (tmp_path / "r").exists()  # nothing started


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
