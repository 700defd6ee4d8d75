"""RL of a chat model on repository tasks, in its own chat template, token in and token out.

A tiny Qwen3-MoE checkpoint saved by transformers with a BPE tokenizer, a chat template and a chat
model's EOS list (generation_config.json: <|im_end|> before <|endoftext|>) runs the main job on
multi-turn repository tasks: continual pre-training on oracle transcripts, evaluation before and
after, and two RL steps. The run decides its agent turns once (envs.harness.agent_loop.chat_for):
every phase writes its episodes in the checkpoint's template, not the project's.

What it proves, for the episodes the learner trained on (the trajectory records it read):
  * they are the template's conversation: each context opens with transformers'
    `apply_chat_template` ids of the system and user messages, tool results and the summary
    request are tool messages (this template writes a `tool` turn, which the project's template
    never does), and each model turn ends with <|im_end|>;
  * an <|im_end|> the model wrote is a model token, trained (loss mask 1), and one the harness
    wrote to close a turn cut short is not;
  * token in, token out: each context is its requests' prompts and the sampler's completions,
    turn by turn; each request extends the last by its completion and the harness's tokens, the
    loss mask covers exactly the completions and the behaviour logprobs are the sampler's;
  * the sampler was asked to stop at <|im_end|> as a token, with none of the project's stop
    strings, and the pre-training transcripts and both evaluations got the same turns.

The checkpoint's random weights are nudged so that the model ends a turn with <|im_end|> about
one token in twenty (its output row points along the mean final hidden state), so turns end both
ways: by the model's end of turn and by running out of tokens.
"""

import glob
import json
import os
import sys

import numpy as np
import pytest
import torch
import transformers

from envs.harness import toolcall
from envs.tasks import suite_repo
from envs.tasks import transcripts
from evaluation import evaluate as evaluate_lib
from experiment import run as run_lib
from experiment.config import (AgentConfig, EvalConfig, ExperimentConfig, PretrainConfig,
                               RLConfig)
from moe import tokenizer as tokenizer_lib
from moe.config import ModelConfig
from moe.hf import testutil
from pipeline import samplers as samplers_lib
from pipeline.config import PipelineConfig
from rl import trajectory_io
from rl.episodes import Episode

END = "<|im_end|>"
# The tests' Qwen3-style template with tool results in a turn of their own role, as many chat
# templates write them: a context in it can be told from the project's template at a glance.
TEMPLATE = testutil.QWEN3_STYLE_TEMPLATE.replace(
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + "
    "'\n</tool_response><|im_end|>\n' }}",
    "{{- '<|im_start|>tool\n' + message.content + '<|im_end|>\n' }}")
WINDOW = 384  # the agent's context: small enough that some RL episodes summarise themselves
PER_TURN = 48  # tokens per model turn: the oracle's longest tool call fits
SUMMARY = "Context full. Summarise."
TASKS = (suite_repo.split(suite_repo.generate(), "train")[:3] +
         suite_repo.split(suite_repo.generate(), "test")[:1])


def _opening_ids(ref, task) -> list:
  messages = [{"role": "system", "content": toolcall.system_prompt(suite_repo.TOOLS)},
              {"role": "user", "content": task.instructions}]
  out = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
  return list(out["input_ids"] if hasattr(out, "keys") else out)


def _oracle_calls() -> list:
  out = []
  for t in TASKS:
    for variant in ("direct", "tests_first", "wrong_first"):
      if t.split == "train" and (variant != "wrong_first" or t.metadata.get("wrong")):
        out += [f"{toolcall.CALL_OPEN}\n" + json.dumps(
            {"name": s["tool"], "arguments": s["args"]}, separators=(",", ":")) +
                f"\n{toolcall.CALL_CLOSE}" for s in transcripts.plan(t, variant)]
  return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(directory, transformers' tokenizer, <|im_end|> id, <|endoftext|> id)."""
  assert "<|im_start|>tool" in TEMPLATE
  d = str(tmp_path_factory.mktemp("qwen3_chat_agent"))
  # Trained on the tasks' text and the oracle's tool calls, as a code model's tokenizer knows
  # code and JSON: the transcripts' longest call then fits a turn.
  texts = ([toolcall.system_prompt(suite_repo.TOOLS)] * 4 + [t.instructions for t in TASKS] +
           [c for t in TASKS for c in t.files.values()] + _oracle_calls())
  ref = testutil.bpe_tokenizer(texts=list(testutil.TOKENIZER_TEXTS) + texts, vocab_size=600,
                               chat_template=TEMPLATE)
  end, eos = ref.convert_tokens_to_ids(END), ref.eos_token_id
  cfg = testutil.qwen3_config(vocab_size=len(ref) + 16, eos_token_id=eos,
                              pad_token_id=ref.pad_token_id, bos_token_id=None)
  model = testutil.make_model(cfg, seed=1)
  with torch.no_grad():  # <|im_end|>'s logit: about 4 wherever the state is near its mean
    states = torch.cat([model(torch.tensor([_opening_ids(ref, t)]), output_hidden_states=True)
                        .hidden_states[-1][0] for t in TASKS])
    mean = states.mean(0)
    model.lm_head.weight[end] = 4.0 * mean / mean.norm() ** 2
  testutil.save(model, d)
  ref.save_pretrained(d)
  transformers.GenerationConfig(eos_token_id=[end, eos], pad_token_id=eos).save_pretrained(d)
  return d, ref, end, eos


def _records(directory: str) -> list:
  return [Episode.from_record(r) for s in trajectory_io.list_shards(directory)
          for r in trajectory_io.read_shard(os.path.join(directory, s))]


def test_rl_of_a_chat_model_in_its_template_token_exact(checkpoint, tmp_path, monkeypatch):
  d, ref, end, eos = checkpoint
  # Every request the RL samplers take and what they answer (the in-process samplers: the
  # evaluations use their own engine).
  wire = []
  submit = samplers_lib.EngineSampler.submit

  def recorded(self, prompt_ids, params, timeout=None):
    fut = submit(self, prompt_ids, params, timeout)
    prompt = [int(t) for t in prompt_ids]
    fut.add_done_callback(lambda f: f.exception() is None and wire.append(
        (prompt, params, [(list(c.token_ids), list(c.logprobs)) for c in f.result()])))
    return fut

  monkeypatch.setattr(samplers_lib.EngineSampler, "submit", recorded)
  evaluated = []
  evaluate = evaluate_lib.evaluate

  def recorded_evaluate(*args, **kw):
    evaluated.append(kw["loop_config"])
    return evaluate(*args, **kw)

  monkeypatch.setattr(evaluate_lib, "evaluate", recorded_evaluate)

  cfg = ExperimentConfig(
      model=ModelConfig(max_seq_len=448), hf_checkpoint=d, suite="repo", sandbox_pool=2,
      agent=AgentConfig(max_turns=4, max_context_tokens=WINDOW, summary_max_tokens=24,
                        summary_request=SUMMARY, observation_max_chars=160),
      pretrain=PretrainConfig(steps=1, batch_rows=2, seq_len=WINDOW, corpus_snippets=2,
                              corpus_repeats=1, transcript_summarised_share=1.0,
                              warmup_steps=1),
      rl=RLConfig(steps=2, sampler_slots=8, pipeline=PipelineConfig(
          max_staleness=1, prompts_per_step=2, attempts=2, max_new_tokens=PER_TURN,
          seq_len=WINDOW + 32, batch_rows=8, grade_workers=2)),
      eval=EvalConfig(samples=1, max_tokens=PER_TURN, k_list=(1,)))
  lines = []
  run_dir = str(tmp_path / "run")
  summary = run_lib.run(cfg, run_dir, progress=False, echo=lines.append, tasks=list(TASKS))
  assert any(l.startswith("agent episodes in the model's chat template (") and
             l.endswith(f"chat_template.jinja), each turn ending at '{END}'") for l in lines), lines
  assert summary["rl"]["episodes_trained"] == 8 and summary["rl"]["policy_version"] == 2

  # -- the same turns everywhere: both evaluations, and the pre-training transcripts ----------
  assert len(evaluated) == 2 and all(
      c.chat is not None and c.chat.end_of_turn == END for c in evaluated)
  tok = tokenizer_lib.for_model(d, len(ref) + 16)
  docs = [open(p, encoding="utf-8").read()
          for p in sorted(glob.glob(os.path.join(run_dir, "corpus", "*.py")))]
  agent_docs = [x for x in docs if x.startswith("<|im_start|>system\n")]
  assert agent_docs, "no transcript in the corpus"
  openings = {tok.decode(_opening_ids(ref, t), skip_special=False)
              for t in TASKS if t.split == "train"}
  assert all(any(x.startswith(o) for x in agent_docs) for o in openings)
  # Tool results are tool turns (a context after a summary may hold only the submit call).
  assert all("<tool_response>" not in x for x in agent_docs)
  assert sum("<|im_start|>tool\n" in x for x in agent_docs) >= len(openings)
  assert any(f"<|im_start|>tool\n{SUMMARY}{END}\n" in x for x in agent_docs), (
      "no summarised transcript asks for its summary in a tool message")

  # -- the sampler was asked for turns that stop at <|im_end|> as a token --------------------
  assert wire
  for _, params, _ in wire:
    assert params.stop == () and end in params.stop_token_ids, params

  # -- the learner's records: the template's conversation, token in / token out --------------
  eps = _records(os.path.join(run_dir, "rl", "trajectories"))
  assert len(eps) == 8 and not any(e.infra_failure for e in eps)
  by_id = {t.task_id: t for t in TASKS}
  model_ends = harness_ends = summarised = 0
  used = set()
  for e in eps:
    task = by_id[e.group_id.split("-", 1)[1]]
    tokens = e.tokens.tolist()
    texts = []
    for s, (a, b) in enumerate(e.segment_bounds()):
      seg, mask = tokens[a:b], e.loss_mask[a:b].tolist()
      logp = e.behaviour_logprobs[a:b].tolist()
      if s == 0:
        opening = _opening_ids(ref, task)
        assert seg[:len(opening)] == opening, e.episode_id
      else:  # a fresh context: the system message, then the task with the summary
        assert tok.decode(seg, skip_special=False).startswith(
            "<|im_start|>system\n" + toolcall.system_prompt(suite_repo.TOOLS) + END)
      text = tok.decode(seg, skip_special=False)
      texts.append(text)
      if f"<|im_start|>tool\n{SUMMARY}{END}\n<|im_start|>assistant\n" in text:
        summarised += 1
      # The requests of this context, in order: each prompt is the context so far.
      mine = [(i, p, c) for i, (p, _, out) in enumerate(wire) for c in out
              if seg[:len(p) + len(c[0])] == p + c[0]]
      assert mine, f"{e.episode_id}: no request made this context"
      mine.sort(key=lambda r: len(r[1]))
      want_mask = [0] * len(seg)
      for k, (i, p, (ids, lps)) in enumerate(mine):
        used.add(i)
        want_mask[len(p):len(p) + len(ids)] = [1] * len(ids)
        np.testing.assert_array_equal(np.float32(logp[len(p):len(p) + len(ids)]),
                                      np.float32(lps))
        if k + 1 < len(mine):  # the next prompt: this one, the completion, the harness's text
          assert mine[k + 1][1][:len(p) + len(ids)] == p + ids
        if ids[-1] == end:  # the model ended its turn: its token, trained
          model_ends += 1
          assert mask[len(p) + len(ids) - 1] == 1
        else:  # cut short (or the tokenizer's EOS): the harness closes the turn
          harness_ends += 1
          close = len(p) + len(ids)
          assert seg[close] == end and mask[close] == 0, (e.episode_id, ids[-3:])
      assert mask == want_mask, e.episode_id
      last_p, (last_ids, _) = mine[-1][1], mine[-1][2]
      assert not any(mask[len(last_p) + len(last_ids):])  # after the last turn: template only
    # Tool results (errors for a random model's turns) are tool messages.
    episode = "".join(texts)
    assert "<|im_start|>tool\n" in episode and "<tool_response>" not in episode, episode
  assert model_ends >= 4 and harness_ends >= 1, (model_ends, harness_ends)
  assert summarised >= 1, "no RL episode summarised itself"


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
