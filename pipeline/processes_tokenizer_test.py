"""The multi-process parts speak the model's tokenizer (pipeline.processes; rl_part's flag is
tools/rl_part_tokenizer_test.py's).

A byte-level BPE trained here on the repository tasks' prompts is saved beside a tiny model of
its vocabulary, as the agentic experiment saves its pre-trained model. The learner takes it from
its init checkpoint and publishes its identity with the weights; the sampler's engine encodes and
stops with it; a tokenizer larger than the model, a named directory without tokenizer.json, and
a part started on another tokenizer than the learner's are refused with the sizes and paths.

A chat model's directory (a checkpoint's tokenizer saved by transformers with its chat template,
and generation_config.json naming <|im_end|> before <|endoftext|>, as a run from a Hugging Face
checkpoint keeps them beside its models): the sampler stops at that EOS list, and the controller
rebuilds the agent loop's turns in the chat template from the directory, in its own process.
"""

import dataclasses
import os
import sys

import pytest
import transformers

from envs.harness import agent_loop
from envs.harness import toolcall
from envs.harness import turn_format
from envs.tasks import suite_pyfunc
from envs.tasks import suite_repo
from moe import build
from moe import checkpoint as moe_checkpoint
from moe.hf import testutil
from moe.tokenizer import BPETokenizer, ByteTokenizer, JsonTokenizer
from pipeline import controller as controller_lib
from pipeline import processes
from pipeline import testing
from rollout import server as server_lib
from sync import publisher as publisher_lib
from sync import store as store_lib

TEXT = "<|im_start|>user\nSet BASE in consts.py to what the tests expect.<|im_end|>\n"


@pytest.fixture(scope="module")
def bpe():
  tasks = suite_repo.split(suite_repo.generate(), "train")[:40]
  loop = agent_loop.LoopConfig(tools=suite_repo.TOOLS)
  texts = [agent_loop.initial_prompt(t.instructions, loop) for t in tasks]
  texts += [c for t in tasks for c in t.files.values()]
  return BPETokenizer.train(texts, 300, extra_tokens=toolcall.TEMPLATE_TOKENS)


def _model_dir(path, vocab_size: int, tokenizer=None) -> str:
  """A tiny model of `vocab_size` ids saved at `path`, `tokenizer` saved beside it."""
  moe_checkpoint.save_params(build.create(testing.MODEL.replace(vocab_size=vocab_size), seed=0),
                             str(path))
  if tokenizer is not None:
    tokenizer.save(str(path))
  return str(path)


def _learn(workdir: str, **kw) -> None:
  """The learner publishes its initial weights (version 0) and stops."""
  processes.run_learner(workdir, testing.MODEL, testing.config(), testing.LEARNER, steps=0, **kw)


def _published(workdir: str) -> dict:
  store = store_lib.Store(processes.paths(workdir)["weights"])
  return publisher_lib.read_manifest(store, publisher_lib.read_index(store).latest).info


@pytest.fixture
def served(monkeypatch):
  """The engine each run_sampler would serve (the server itself is not started)."""
  engines = []
  monkeypatch.setattr(server_lib, "serve", lambda engine, **kw: engines.append(engine))
  return engines


@pytest.fixture(scope="module")
def bpe_work(tmp_path_factory, bpe):
  """A workdir whose learner started from a BPE model with its tokenizer.json beside it."""
  root = tmp_path_factory.mktemp("bpe")
  model = _model_dir(root / "model", bpe.vocab_size, bpe)
  work = str(root / "work")
  _learn(work, init_checkpoint=model)
  return work, model


def test_load_tokenizer(tmp_path, bpe):
  assert isinstance(processes.load_tokenizer(None), ByteTokenizer)
  bpe.save(str(tmp_path / "tok"))
  loaded = processes.load_tokenizer(str(tmp_path / "tok"))
  assert isinstance(loaded, BPETokenizer) and loaded.encode(TEXT) == bpe.encode(TEXT)
  with pytest.raises(processes.TokenizerError, match="no tokenizer.json in the tokenizer "
                     f"directory {tmp_path}"):
    processes.load_tokenizer(str(tmp_path))


def test_the_learner_publishes_the_init_checkpoints_tokenizer(bpe_work, bpe):
  work, _ = bpe_work
  info = _published(work)
  assert info["tokenizer"] == processes.tokenizer_info(bpe)
  assert info["tokenizer"]["kind"] == "BPETokenizer" and info["tokenizer"]["vocab_size"] == 300
  assert info["tokenizer"] != processes.tokenizer_info(ByteTokenizer())


def test_the_sampler_serves_with_the_named_tokenizer(bpe_work, bpe, served):
  work, model = bpe_work
  processes.run_sampler(work, port=0, max_slots=2, max_len=128, tokenizer_dir=model)
  (engine,) = served
  assert isinstance(engine.tokenizer, BPETokenizer)
  assert engine.tokenizer.encode(TEXT) == bpe.encode(TEXT)
  assert len(bpe.encode(TEXT)) < len(ByteTokenizer().encode(TEXT))
  assert engine.config.eos_token_ids == (bpe.eos_id,) != (ByteTokenizer().eos_id,)
  assert engine.model_config.vocab_size == bpe.vocab_size


def test_a_part_without_the_learners_tokenizer_is_refused(bpe_work, served):
  """Bytes (no flag) fit a 300-id model but are not its tokenizer: sampler and controller stop."""
  work, _ = bpe_work
  with pytest.raises(processes.TokenizerError, match=(
      r"sampler: the learner publishes weights for the tokenizer BPETokenizer of 300 ids "
      r"\(vocabulary digest \w+\) but this part's \(bytes \(no tokenizer named\)\) is "
      r"ByteTokenizer of 259 ids")):
    processes.run_sampler(work, port=0, max_slots=2, max_len=128)
  assert not served
  with pytest.raises(processes.TokenizerError, match="controller: the learner publishes"):
    processes.run_controller(work, ["http://127.0.0.1:1"], testing.config(), steps=1)
  assert not os.path.exists(processes.paths(work)["trajectories"])


def test_another_bpe_of_the_same_size_is_refused(bpe_work, bpe, served, tmp_path):
  """Same number of ids, other merges (trained on other text): the vocabulary digest differs."""
  work, _ = bpe_work
  other = BPETokenizer.train(["zzzz qqqq xyxy wvwv " * 50, TEXT.upper() * 20], 300,
                             extra_tokens=toolcall.TEMPLATE_TOKENS)
  assert other.vocab_size == bpe.vocab_size and other.encode(TEXT) != bpe.encode(TEXT)
  other.save(str(tmp_path / "other"))
  with pytest.raises(processes.TokenizerError, match="this part's .*other.* is BPETokenizer of "
                     "300 ids"):
    processes.run_sampler(work, port=0, max_len=128, tokenizer_dir=str(tmp_path / "other"))
  assert not served


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, bpe, served):
  tok_dir = str(tmp_path / "tok")
  bpe.save(tok_dir)
  work = str(tmp_path / "work")
  _learn(work)  # testing.MODEL: 259 ids, bytes
  for run in (lambda: processes.run_sampler(work, port=0, max_len=128, tokenizer_dir=tok_dir),
              lambda: processes.run_controller(work, ["http://127.0.0.1:1"], testing.config(),
                                               steps=1, tokenizer_dir=tok_dir)):
    with pytest.raises(processes.TokenizerError,
                       match=f"the tokenizer \\({tok_dir}\\) has 300 ids but the model's "
                             "vocab_size is 259"):
      run()
  assert not served
  # The learner checks the tokenizer beside its init checkpoint against that checkpoint's model.
  model = _model_dir(tmp_path / "model", testing.MODEL.vocab_size, bpe)
  with pytest.raises(processes.TokenizerError,
                     match="learner: the tokenizer has 300 ids, more than the model's 259"):
    _learn(str(tmp_path / "work2"), init_checkpoint=model)
  assert not os.path.exists(tmp_path / "work2" / "weights")


def test_a_named_directory_without_tokenizer_json_is_refused(tmp_path, served):
  """Not bytes in its place; and the sampler says so at once, not after waiting for weights."""
  empty = str(tmp_path / "model")
  os.makedirs(empty)
  work = str(tmp_path / "work")  # nothing published: a sampler that got past it would wait
  msg = f"no tokenizer.json in the tokenizer directory {empty}"
  with pytest.raises(processes.TokenizerError, match=msg):
    processes.run_sampler(work, port=0, tokenizer_dir=empty)
  with pytest.raises(processes.TokenizerError, match=msg):
    processes.run_controller(work, ["http://127.0.0.1:1"], testing.config(), steps=1,
                             tokenizer_dir=empty)
  with pytest.raises(processes.TokenizerError, match=msg):
    _learn(work, tokenizer_dir=empty)
  assert not served and not os.path.exists(work)


@pytest.fixture(scope="module")
def chat_work(tmp_path_factory):
  """(workdir, model directory, transformers' tokenizer, EOS list): a tiny model of a chat
  checkpoint's vocabulary (its ids padded past the tokenizer's, as Qwen's) with the checkpoint's
  tokenizer files and EOS list beside it; the learner started from it."""
  root = tmp_path_factory.mktemp("chat")
  ref = testutil.bpe_tokenizer()
  model = _model_dir(root / "model", len(ref) + 16)
  ref.save_pretrained(model)
  eos = [ref.convert_tokens_to_ids("<|im_end|>"), ref.eos_token_id]
  transformers.GenerationConfig(eos_token_id=eos).save_pretrained(model)
  work = str(root / "work")
  _learn(work, init_checkpoint=model)
  return work, model, ref, tuple(eos)


def test_the_sampler_stops_at_the_directorys_eos_list(chat_work, served):
  work, model, ref, eos = chat_work
  assert _published(work)["tokenizer"]["kind"] == "JsonTokenizer"
  processes.run_sampler(work, port=0, max_slots=2, max_len=128, tokenizer_dir=model)
  (engine,) = served
  assert engine.config.eos_token_ids == eos != (ref.eos_token_id,)
  tok = engine.tokenizer
  assert isinstance(tok, JsonTokenizer) and tok.bos_id is None and tok.chat_template is not None
  assert tok.encode(TEXT) == ref.encode(TEXT, add_special_tokens=False)
  # An id the model has past the tokenizer's decodes to nothing, as in the in-process run.
  assert tok.decode([engine.model_config.vocab_size - 1]) == ""


@pytest.fixture
def controllers(monkeypatch):
  """The settings each run_controller would build its RolloutController with (not run)."""
  made = []

  class Recorded:
    def __init__(self, tasks, samplers, pool, sink, **kw):
      made.append(dict(kw, tasks=tasks))

    def resume(self, written):
      return 0

    def run(self, steps):
      return 0

    def summary(self):
      return {}

  monkeypatch.setattr(controller_lib, "RolloutController", Recorded)
  return made


def test_the_controller_rebuilds_the_chat_turns_from_the_directory(chat_work, bpe_work,
                                                                    controllers):
  """Repository tasks: the loop's settings as given, its turns the directory's chat template,
  ending at its <|im_end|>. Single-turn tasks, or the project's BPE: the project's template."""
  work, model, ref, eos = chat_work
  repo = suite_repo.split(suite_repo.generate(), "train")[:2]
  loop = agent_loop.LoopConfig(max_turns=3, tools=suite_repo.TOOLS)
  processes.run_controller(work, ["http://127.0.0.1:1"], testing.config(), steps=1,
                           pool_size=1, tasks=repo, loop_config=loop, tokenizer_dir=model)
  (made,) = controllers
  chat = made["loop_config"].chat
  assert isinstance(chat, turn_format.ChatTurns) and chat.end_of_turn == "<|im_end|>"
  assert chat.name == os.path.join(model, "chat_template.jinja")
  assert made["loop_config"] == dataclasses.replace(loop, chat=chat)
  assert made["tokenizer"].decode([eos[0]], skip_special=False) == "<|im_end|>"
  messages = [{"role": "system", "content": toolcall.system_prompt(suite_repo.TOOLS)},
              {"role": "user", "content": repo[0].instructions}]
  assert agent_loop.initial_prompt(repo[0].instructions, made["loop_config"]) == (
      ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
  # Single-turn tasks run no agent loop; the project's model has no chat template.
  single = suite_pyfunc.split(suite_pyfunc.generate(), "train")[:2]
  processes.run_controller(work, ["http://127.0.0.1:1"], testing.config(), steps=1,
                           pool_size=1, tasks=single, loop_config=loop, tokenizer_dir=model)
  bpe_dir = bpe_work
  processes.run_controller(bpe_dir[0], ["http://127.0.0.1:1"], testing.config(), steps=1,
                           pool_size=1, tasks=repo, loop_config=loop, tokenizer_dir=bpe_dir[1])
  assert [m["loop_config"] for m in controllers[1:]] == [loop, loop]
  assert controllers[2]["loop_config"].turns is turn_format.PROJECT


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
