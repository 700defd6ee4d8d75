"""The main job's command line: gin overrides are passed through, bad configs exit 2 early."""

import sys

import pytest

from tools import main as main_lib
from tools import train as train_lib


def test_parse_args_collects_gin_overrides():
  args, bindings = main_lib.parse_args(["--gin_file=a.gin", "--gin.RLConfig.steps=3",
                                        "--run_dir=/tmp/x", "--gin_binding=EvalConfig.samples=2"])
  assert args.gin_file == ["a.gin"] and args.run_dir == "/tmp/x"
  assert bindings == ["RLConfig.steps=3", "EvalConfig.samples=2"]
  with pytest.raises(SystemExit):
    main_lib.parse_args(["--nonsense=1"])


@pytest.mark.parametrize("entry", [main_lib.main, train_lib.main])
def test_bad_configs_fail_before_any_work(entry, tmp_path, capsys):
  assert entry(["--gin.PipelineConfig.max_staleness=-1", f"--run_dir={tmp_path}/r"]) == 2
  assert "max_staleness" in capsys.readouterr().err
  assert entry(["--gin.NoSuchThing.x=1", f"--run_dir={tmp_path}/r"]) == 2
  assert not (tmp_path / "r").exists()  # nothing started


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
