"""//tools:serve's command line: model presets and engine settings from gin files, `--gin.X=V`
bindings and flags (flags win), the old binding spelling refused, and the binary's admin token
(generated, in a 0600 file the start-up line names)."""

import json
import os
import queue
import re
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from tools import serve

WAIT_S = 300  # the subprocess imports JAX and builds an engine: slow on a loaded machine

TINY = "--gin_file=moe/configs/tiny.gin"
SERVE = "--gin_file=tools/configs/runs/serve.gin"


def test_engine_settings_from_gin_files_bindings_and_flags():
  args = serve.parse_args([TINY, SERVE, "--gin.EngineConfig.decode_steps=4",
                           "--gin.EngineConfig.max_slots=16", "--max_slots=4", "--max_len=64",
                           "--port=0"])
  engine = serve.build_engine(args)
  try:
    ec = engine.config
    # decode_steps from the binding, max_slots from the flag over the binding, dtype from
    # serve.gin, the end of sequence from the byte tokenizer of the tiny vocabulary.
    assert (ec.decode_steps, ec.max_slots, ec.max_len, ec.dtype) == (4, 4, 64, "float32")
    assert ec.eos_token_ids == (engine.tokenizer.eos_id,)
    assert engine.model_config.hidden_size == 128  # tiny.gin
  finally:
    engine.stop()


@pytest.mark.parametrize("flag", ["--gin_param=EngineConfig.max_slots=4",
                                  "--gin_binding=EngineConfig.max_slots=4", "--gin=x.gin"])
def test_one_flag_spelling(flag, capsys):
  with pytest.raises(SystemExit) as e:
    serve.parse_args([TINY, flag])
  assert e.value.code == 2 and "unknown argument" in capsys.readouterr().err


def test_needs_a_source_of_weights():
  with pytest.raises(SystemExit, match="give --hf_checkpoint, --checkpoint or --gin_file"):
    serve.build_engine(serve.parse_args([]))


def test_serve_writes_the_admin_token_file_and_says_where_it_is(tmp_path):
  """The binary end to end: the admin app on loopback requires the generated token, which is in
  a 0600 file; the start-up line names the file and does not show the token."""
  token_file = tmp_path / "token"
  env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_ADMIN_TOKEN"}
  env["PYTHONPATH"] = os.pathsep.join(sys.path)
  proc = subprocess.Popen(
      [sys.executable, "-m", "tools.serve", TINY, SERVE, "--max_slots=2", "--max_len=32",
       "--port=0", "--admin_port=0", f"--admin_token_file={token_file}"],
      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
  lines = queue.Queue()
  threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
  try:
    try:
      line = lines.get(timeout=WAIT_S)  # the one line the binary prints
    except queue.Empty:
      raise AssertionError(f"no start-up line within {WAIT_S} s") from None
    m = re.search(r"admin on http://127\.0\.0\.1:(\d+), admin token in (\S+) ", line)
    assert m and m.group(2) == str(token_file), line
    token = token_file.read_text().strip()
    assert len(token) >= 32 and token not in line
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    url = f"http://127.0.0.1:{m.group(1)}/admin/status"
    with pytest.raises(urllib.error.HTTPError) as e:
      urllib.request.urlopen(url, timeout=WAIT_S)
    assert e.value.code == 401
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=WAIT_S) as r:
      assert r.status == 200 and json.loads(r.read())["policy_version"] == 0
  finally:
    proc.terminate()
    proc.wait(WAIT_S)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
