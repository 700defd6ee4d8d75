"""pipeline.faults: a named point kills a child process at exactly the asked hit, and only then."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pipeline import faults


def test_parse():
  assert faults.parse("a@3, b") == {"a": 3, "b": 1}
  for bad in ("a@x", "@3", "a@0"):
    with pytest.raises(ValueError, match="RL_FAULTS"):
      faults.parse(bad)


def _child(tmp_path, spec):
  code = textwrap.dedent("""
      import sys
      from pipeline import faults
      for i in range(1, 6):
        print(i, flush=True)
        faults.point("here")
        faults.point("elsewhere")
  """)
  log = tmp_path / "faults.log"
  env = {**os.environ, faults.ENV: spec, faults.LOG_ENV: str(log),
         "PYTHONPATH": os.pathsep.join(sys.path)}
  p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                     timeout=120)
  return p, (log.read_text() if log.exists() else "")


def test_kills_at_the_asked_hit(tmp_path):
  p, log = _child(tmp_path, "here@3")
  assert p.returncode == -signal.SIGKILL
  assert p.stdout.split() == ["1", "2", "3"]
  assert log.split()[:2] == ["here", "3"]


def test_other_points_and_no_spec_do_nothing(tmp_path):
  p, log = _child(tmp_path, "nowhere@1")
  assert p.returncode == 0 and p.stdout.split() == ["1", "2", "3", "4", "5"] and not log


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
