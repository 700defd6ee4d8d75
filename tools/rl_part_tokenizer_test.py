"""`rl_part --tokenizer=DIR` reaches every part (pipeline/processes.py): the learner takes the
tokenizer saved beside `--init_checkpoint` by default and publishes it with the weights, the
sampler serves with the one named, and a tokenizer that cannot serve the model (none at the
named path, more ids than the model, not the learner's) stops the part with exit status 2 and
`error: ...` naming it, no traceback. A chat model's directory (a checkpoint's tokenizer and its
EOS list, <|im_end|> among them) makes the sampler stop at that list. The checks themselves are
pipeline/processes_tokenizer_test.py's.
"""

import os
import sys

import pytest
import transformers

from envs.harness import toolcall
from envs.tasks import suite_repo
from moe import build
from moe import checkpoint as moe_checkpoint
from moe.hf import testutil
from moe.tokenizer import BPETokenizer
from pipeline import processes
from pipeline import testing
from rollout import server as server_lib
from sync import publisher as publisher_lib
from sync import store as store_lib
from tools import rl_part

TEXT = "<|im_start|>user\nSet BASE in consts.py to what the tests expect.<|im_end|>\n"


@pytest.fixture(scope="module")
def bpe():
  tasks = suite_repo.split(suite_repo.generate(), "train")[:40]
  texts = [t.instructions for t in tasks] + [c for t in tasks for c in t.files.values()]
  return BPETokenizer.train(texts, 300, extra_tokens=toolcall.TEMPLATE_TOKENS)


@pytest.fixture
def model(tmp_path, bpe):
  """A tiny model of the BPE's vocabulary with its tokenizer.json beside it."""
  path = str(tmp_path / "model")
  moe_checkpoint.save_params(
      build.create(testing.MODEL.replace(vocab_size=bpe.vocab_size), seed=0), path)
  bpe.save(path)
  return path


@pytest.fixture
def served(monkeypatch):
  """The engine each sampler part would serve (the server itself is not started)."""
  engines = []
  monkeypatch.setattr(server_lib, "serve", lambda engine, **kw: engines.append(engine))
  return engines


def _published_tokenizer(workdir: str) -> dict:
  store = store_lib.Store(processes.paths(workdir)["weights"])
  return publisher_lib.read_manifest(store, publisher_lib.read_index(store).latest).info[
      "tokenizer"]


def test_every_part_speaks_the_init_checkpoints_tokenizer(tmp_path, bpe, model, served, capsys):
  work = str(tmp_path / "work")
  assert rl_part.main(["learner", f"--workdir={work}", "--steps=0",
                       f"--init_checkpoint={model}"]) == 0
  assert _published_tokenizer(work) == processes.tokenizer_info(bpe)
  assert rl_part.main(["sampler", f"--workdir={work}", "--port=1", f"--tokenizer={model}"]) == 0
  (engine,) = served
  assert isinstance(engine.tokenizer, BPETokenizer)
  assert engine.tokenizer.encode(TEXT) == bpe.encode(TEXT)
  assert engine.config.eos_token_ids == (bpe.eos_id,)
  # Without the flag the sampler and controller take bytes: refused, the learner's is a BPE.
  for part in (["sampler", "--port=1"], ["controller", "--samplers=http://127.0.0.1:1"]):
    assert rl_part.main([*part, f"--workdir={work}", "--steps=1"]) == 2, part
    err = capsys.readouterr().err
    assert err.startswith(f"error: {part[0]}: the learner publishes weights for the tokenizer "
                          "BPETokenizer of 300 ids (vocabulary digest "), err
    assert "is ByteTokenizer of 259 ids" in err and "Traceback" not in err
  assert len(served) == 1


def test_a_chat_models_sampler_stops_at_its_eos_list(tmp_path, served):
  """The model directory of a run from a Hugging Face chat checkpoint (its tokenizer files and
  generation_config.json beside the weights): every part takes it with --tokenizer, and the
  sampler ends completions at <|im_end|> as well as <|endoftext|>."""
  ref = testutil.bpe_tokenizer()
  model = str(tmp_path / "model")
  moe_checkpoint.save_params(
      build.create(testing.MODEL.replace(vocab_size=len(ref) + 16), seed=0), model)
  ref.save_pretrained(model)
  eos = [ref.convert_tokens_to_ids("<|im_end|>"), ref.eos_token_id]
  transformers.GenerationConfig(eos_token_id=eos).save_pretrained(model)
  work = str(tmp_path / "work")
  assert rl_part.main(["learner", f"--workdir={work}", "--steps=0",
                       f"--init_checkpoint={model}"]) == 0
  assert rl_part.main(["sampler", f"--workdir={work}", "--port=1", f"--tokenizer={model}"]) == 0
  (engine,) = served
  assert engine.config.eos_token_ids == tuple(eos)
  assert engine.tokenizer.chat_template is not None


def test_a_tokenizer_larger_than_the_model_exits_2(tmp_path, model, served, capsys):
  work = str(tmp_path / "work")
  assert rl_part.main(["learner", f"--workdir={work}", "--steps=0"]) == 0  # 259 ids, bytes
  for part in (["sampler", "--port=1"], ["controller", "--samplers=http://127.0.0.1:1"]):
    assert rl_part.main([*part, f"--workdir={work}", "--steps=1", f"--tokenizer={model}"]) == 2
    assert capsys.readouterr().err == (
        f"error: {part[0]}: the tokenizer ({model}) has 300 ids but the model's vocab_size is "
        "259; give the model's own tokenizer (the directory its tokenizer.json was saved in)\n")
  assert rl_part.main(["learner", f"--workdir={tmp_path / 'work2'}", "--steps=0",
                       f"--tokenizer={model}"]) == 2  # default.gin's model: 259 ids
  assert "learner: the tokenizer" in capsys.readouterr().err
  assert not served


def test_a_tokenizer_directory_without_tokenizer_json_exits_2(tmp_path, served, capsys):
  empty = str(tmp_path / "model")
  os.makedirs(empty)
  work = str(tmp_path / "work")  # nothing published: a sampler past the check would wait
  for part in (["learner"], ["sampler", "--port=1"],
               ["controller", "--samplers=http://127.0.0.1:1"]):
    assert rl_part.main([*part, f"--workdir={work}", "--steps=1", f"--tokenizer={empty}"]) == 2
    assert capsys.readouterr().err == (
        f"error: no tokenizer.json in the tokenizer directory {empty} (expected "
        f"{empty}/tokenizer.json); name the directory a model was saved in with its tokenizer, "
        "or leave the tokenizer out for bytes\n"), part
  assert not served and not os.path.exists(work)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
