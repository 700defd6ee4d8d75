"""//tools:serve's command line: model presets and engine settings from gin files, `--gin.X=V`
bindings and flags (flags win), the old binding spelling refused, the binary's admin token
(generated, in a 0600 file the start-up line names), the served model's name (its checkpoint's),
and the binary serving a checkpoint saved by transformers with its own tokenizer and chat template.

The binary runs as a process the way Bazel runs it (`tools.testing.Binary`): under `bazel test`
the `//tools:serve` binary itself; outside Bazel what its stub executes, the toolchain's
interpreter (build_defs/venv_python.sh) on tools/serve.py as a script. Reading the checkpoint's
tokenizer.json imports the `tokenizers` library, which a module of that name on the process's
sys.path once shadowed (rollout/tokenizers.py): the server died at start-up. The guard against
such names, and the interpreter check, are build_defs/module_names_test.py.
"""

import json
import os
import re
import stat
import sys
import urllib.error
import urllib.request

import pytest

from moe.hf import testutil
from tools import serve
from tools import testing
from tools.testing import WAIT_S

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


@pytest.mark.parametrize("argv,name", [
    (["--hf_checkpoint=/ckpts/Qwen3-30B-A3B/", SERVE], "Qwen3-30B-A3B"),
    (["--checkpoint=runs/r1/final_model", TINY, SERVE], "final_model"),
    (["--hf_checkpoint=.", SERVE], os.path.basename(os.getcwd())),
    ([TINY, SERVE], serve.RANDOM_INIT_NAME),
    (["--hf_checkpoint=/ckpts/q", "--model_name=mine"], "mine"),
])
def test_the_served_model_is_named_by_its_checkpoint(argv, name):
  assert serve.served_model_name(serve.parse_args(argv)) == name


def test_needs_a_source_of_weights():
  with pytest.raises(SystemExit, match="give --hf_checkpoint, --checkpoint or --gin_file"):
    serve.build_engine(serve.parse_args([]))


def test_serve_writes_the_admin_token_file_and_says_where_it_is(tmp_path):
  """The binary end to end: the admin app on loopback requires the generated token, which is in
  a 0600 file; the start-up line names the file and does not show the token."""
  token_file = tmp_path / "token"
  binary = testing.Binary("serve", [TINY, SERVE, "--max_slots=2", "--max_len=32", "--port=0",
                                    "--admin_port=0", f"--admin_token_file={token_file}",
                                    *testing.serve_flags(tmp_path)], tmp_path)
  try:
    line = binary.line
    m = re.search(r"admin on http://127\.0\.0\.1:(\d+), admin token in (\S+) ", line)
    assert m and m.group(2) == str(token_file), line
    token = token_file.read_text().strip()
    assert len(token) >= 32 and token not in line
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    assert "warm-up" not in binary.stderr()  # serve_flags: no warm-up in this test
    url = f"http://127.0.0.1:{m.group(1)}/admin/status"
    with pytest.raises(urllib.error.HTTPError) as e:
      urllib.request.urlopen(url, timeout=WAIT_S)
    assert e.value.code == 401
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=WAIT_S) as r:
      assert r.status == 200 and json.loads(r.read())["policy_version"] == 0
  finally:
    binary.close()


def test_a_test_does_not_start_serve_on_the_users_compilation_cache(tmp_path):
  with pytest.raises(ValueError, match="needs --compilation_cache_dir"):
    testing.Binary("serve", [TINY, SERVE, "--port=0"], tmp_path)
  flags = testing.serve_flags(tmp_path)
  assert flags == [f"--compilation_cache_dir={tmp_path / 'jax_cache'}", "--no_warmup"]
  assert testing.serve_flags(tmp_path, warmup=True) == flags[:1]


@pytest.fixture(scope="module")
def transformers_checkpoint(tmp_path_factory):
  """A tiny Qwen3-MoE and a BPE tokenizer saved by transformers into one directory, as a real
  checkpoint is (`moe.hf.testutil.save_with_tokenizer`), and the transformers tokenizer loaded
  back from it (the reference)."""
  import transformers  # pylint: disable=g-import-not-at-top
  d = testutil.save_with_tokenizer(tmp_path_factory.mktemp("qwen3_bpe"), seed=1)
  assert {"tokenizer.json", "chat_template.jinja", "config.json"} <= set(os.listdir(d))
  return d, transformers.AutoTokenizer.from_pretrained(d)


def _post_json(port, path, body) -> dict:
  req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                               method="POST", headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=WAIT_S) as r:
    return json.loads(r.read())


def test_the_binary_serves_a_transformers_checkpoint_with_its_own_tokenizer(
    transformers_checkpoint, tmp_path):
  """A text prompt is encoded by the checkpoint's tokenizer (not as bytes), and each completion's
  text is that tokenizer's decoding of its token ids; chat messages are rendered by its chat
  template; /v1/models names the checkpoint; all through the real entry point."""
  d, ref = transformers_checkpoint
  binary = testing.Binary("serve", [f"--hf_checkpoint={d}", "--port=0", "--admin_port=-1",
                                    "--max_slots=4", "--max_len=64", "--decode_steps=4",
                                    *testing.serve_flags(tmp_path)], tmp_path)
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "fix it"}]
  try:
    port = testing.serve_port(binary.line)
    prompt = "def add(a, b):\n    return"
    out = _post_json(port, "/v1/completions",
                     {"prompt": prompt, "max_tokens": 16, "n": 3, "temperature": 1.0, "seed": 7,
                      "return_routing": False})
    chat = _post_json(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=WAIT_S) as r:
      models = json.loads(r.read())
  finally:
    binary.close()
  assert [m["id"] for m in models["data"]] == [os.path.basename(d)] == [chat["model"]]
  rendered = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
  rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
  assert chat["choices"][0]["prompt_token_ids"] == list(rendered)
  want = ref.encode(prompt, add_special_tokens=False)
  assert len(want) < len(prompt.encode()) / 2  # merges: a byte tokenizer would not match
  assert len(out["choices"]) == 3 and out["usage"]["prompt_tokens"] == 3 * len(want)
  for c in out["choices"]:
    assert c["prompt_token_ids"] == want
    assert c["text"] == ref.decode(c["token_ids"], skip_special_tokens=True)
  assert any(c["text"] for c in out["choices"])


def test_a_checkpoint_without_a_tokenizer_whose_vocabulary_is_not_bytes_does_not_start(
    transformers_checkpoint, tmp_path):
  d, _ = transformers_checkpoint
  bare = tmp_path / "no_tokenizer"
  bare.mkdir()
  for name in ("config.json", "model.safetensors"):
    os.symlink(os.path.join(d, name), bare / name)
  with pytest.raises(SystemExit, match=r"error: .*no tokenizer.json, and its vocabulary of \d+ "
                     r"ids is not the byte tokenizer's"):
    serve.build_engine(serve.parse_args([f"--hf_checkpoint={bare}", "--max_len=64"]))


def test_the_binary_serves_replicas_of_a_sharded_engine(tmp_path, monkeypatch):
  """--replicas=2 --expert=2 on 4 (simulated) devices: one server, two engines each sharding the
  experts over two devices; requests complete and /metrics shows both replicas at work."""
  monkeypatch.setenv("XLA_FLAGS", (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=4").strip())
  binary = testing.Binary("serve", [TINY, "--port=0", "--admin_port=-1", "--max_slots=2",
                                    "--max_len=64", "--decode_steps=4", "--replicas=2",
                                    "--expert=2", *testing.serve_flags(tmp_path)], tmp_path)
  try:
    port = testing.serve_port(binary.line)
    outs = [_post_json(port, "/v1/completions", {"prompt": f"def f{i}():", "max_tokens": 6,
                                                  "n": 2, "temperature": 1.0, "seed": i})
            for i in range(4)]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as r:
      metrics = r.read().decode()
  finally:
    binary.close()
  assert all(len(o["choices"]) == 2 and o["usage"]["completion_tokens"] > 0 for o in outs)
  per_replica = {m.group(1): float(m.group(2)) for m in re.finditer(
      r'^rollout_replica_completions_total\{replica="(\d)"\} (\S+)$', metrics, re.M)}
  assert set(per_replica) == {"0", "1"}, metrics
  assert sum(per_replica.values()) == 8, per_replica


def test_a_layout_larger_than_the_machine_is_a_clear_error(tmp_path):
  with pytest.raises(SystemExit, match=r"error: .*need 4 devices, have 1"):
    serve.build_engine(serve.parse_args([TINY, "--max_len=64", "--replicas=2", "--expert=2"]))
  with pytest.raises(SystemExit, match="--tensor must be >= 1"):
    serve.build_engine(serve.parse_args([TINY, "--tensor=0"]))


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
