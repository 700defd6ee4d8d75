"""//tools:serve's command line: model presets and engine settings from gin files, `--gin.X=V`
bindings and flags (flags win), and the old binding spelling refused."""

import sys

import pytest

from tools import serve

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


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
