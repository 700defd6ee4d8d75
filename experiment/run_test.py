"""The main job end to end on a tiny model and a handful of tasks: every phase runs, trains (its
records show episodes, tokens and a non-zero loss every step, and the weights moved), RL learns
from rewards that vary within groups (non-zero advantages and policy gradient every step, with
the router loss off), and the run directory holds what the README promises."""

import collections
import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from envs.tasks import task_format
from experiment import run as run_lib
from experiment import testing as experiment_testing
from experiment.config import EvalConfig, ExperimentConfig, PretrainConfig, RLConfig
from moe import build
from moe import checkpoint as moe_checkpoint
from moe import sharding
from moe.config import ModelConfig
from pipeline import resources
from pipeline.config import PipelineConfig
from rl.learner import LearnerConfig
from rl.objectives import PolicyLossConfig
from rl.train_state import OptimizerConfig
from rl.train_step import LossConfig

TINY = ModelConfig(vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                   intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                   num_experts_per_tok=2, max_seq_len=128, tie_word_embeddings=True)


def test_tiny_experiment_end_to_end(tmp_path):
  # The built-in suite would give this model reward 0 on every attempt, hence no policy gradient;
  # on these tasks attempts at one prompt get different rewards (see experiment.testing).
  tasks = experiment_testing.even_code_tasks(n_train=6, n_test=3)
  cfg = ExperimentConfig(
      model=TINY,
      pretrain=PretrainConfig(steps=3, batch_rows=4, seq_len=64, corpus_snippets=20,
                              corpus_repeats=1),
      rl=RLConfig(steps=2, sampler_slots=8, pipeline=PipelineConfig(
          max_staleness=1, prompts_per_step=2, attempts=4, max_new_tokens=8, seq_len=64,
          batch_rows=8, grade_workers=2)),
      eval=EvalConfig(samples=2, max_tokens=8, k_list=(1, 2)),
      train_tasks=6, heldout_tasks=3, sandbox_pool=2)
  loss = cfg.rl.learner.loss
  assert not loss.aux_loss and loss.policy.kl_coef == 0  # the policy gradient is the only loss
  lines = []
  summary = run_lib.run(cfg, str(tmp_path), progress=False, echo=lines.append, tasks=tasks)
  assert summary["heldout_tasks"] == 3 and summary["before"]["samples"] == 6
  assert summary["after"]["samples"] == 6
  line = run_lib.final_line(summary)
  assert line.startswith("held-out pass@1: before ") and "/6 -> after " in line
  files = set(os.listdir(tmp_path))
  for want in ("metrics.jsonl", "summary.json", "config.json", "eval_before.jsonl",
               "eval_after.jsonl", "tensorboard", "reward.png", "heldout_pass_rate.png",
               "pretrain_loss.png", "pretrained_model", "final_model"):
    assert want in files, want
  phases = [json.loads(l)["phase"] for l in open(tmp_path / "metrics.jsonl")]
  assert phases.count("pretrain") == 3 and phases.count("rl") == 2 and phases.count("eval") == 2
  experiment_testing.assert_trained(str(tmp_path), cfg)
  experiment_testing.assert_learned_from_rewards(str(tmp_path), cfg)
  assert summary["rl"]["trained_episodes"] == 2 * 8  # 2 steps x 2 prompts x 4 attempts
  # Groups without signal and flagged attempts: per step in metrics.jsonl, totalled in summary.
  rl_steps = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if r["phase"] == "rl"]
  for key in ("zero_variance_groups", "zero_variance_filtered", "hack_flagged"):
    assert summary["rl"][key] == sum(r[key] for r in rl_steps), key
  assert summary["rl"]["zero_variance_filtered"] == 0  # filtering is off by default
  assert all(r["zero_variance_groups"] + r["signal_groups"] <= 2 for r in rl_steps)
  assert any("pass@1 before RL" in l for l in lines)

  # RL from the saved pre-trained model: no pre-training, the saved model's config (not the
  # one given) and tokenizer; its evaluation before RL is the first run's (same model, seeds).
  again = tmp_path / "again"
  cfg2 = dataclasses.replace(cfg, model=TINY.replace(hidden_size=16),
                             pretrained_model=str(tmp_path / "pretrained_model"),
                             rl=dataclasses.replace(cfg.rl, steps=1))
  second = run_lib.run(cfg2, str(again), progress=False, echo=lambda _: None, tasks=tasks)
  assert second["before"] == summary["before"]
  assert second["rl"]["trained_episodes"] == 8 and second["rl"]["policy_version"] == 1
  phases = [json.loads(l)["phase"] for l in open(again / "metrics.jsonl")]
  assert "pretrain" not in phases and phases.count("rl") == 1
  assert not (again / "corpus.json").exists()
  assert moe_checkpoint.load_config(str(again / "final_model")) == TINY


def test_validation_mode_evaluates_carved_train_tasks_not_heldout():
  cfg = ExperimentConfig(model=TINY, validation_fraction=1 / 6)
  all_tasks, train, evaluated, name = run_lib.eval_split(cfg)
  assert name == "validation"
  assert evaluated and all(t.split == "validation" for t in evaluated)
  assert not {t.task_id for t in evaluated} & {t.task_id for t in train}
  assert all(t.split == "train" for t in train)
  relabelled = {t.task_id: t.split for t in all_tasks}
  assert all(relabelled[t.task_id] == "validation" for t in evaluated)
  _, _, heldout, name = run_lib.eval_split(ExperimentConfig(model=TINY))
  assert name == "held-out" and all(t.split == "test" for t in heldout)
  given = experiment_testing.even_code_tasks(n_train=4, n_test=2)
  all_given, train, heldout, _ = run_lib.eval_split(ExperimentConfig(model=TINY, train_tasks=3),
                                                    given)
  assert all_given == given and train == given[:3] and heldout == given[4:]
  assert run_lib.final_line({"eval_split": "validation", "before": {"passed": 1, "samples": 4},
                             "after": {"passed": 3, "samples": 4}}) == (
                                 "validation pass@1: before 1/4 -> after 3/4")
  with pytest.raises(ValueError, match="validation_fraction"):
    ExperimentConfig(model=TINY, validation_fraction=1.0)
  with pytest.raises(ValueError, match="tokenizer must be one of"):
    ExperimentConfig(model=TINY, tokenizer="sentencepiece")
  # Bytes keep the model's vocabulary, which must hold them; a BPE sets it.
  with pytest.raises(ValueError, match="smaller than the tokenizer's"):
    run_lib.with_tokenizer(ExperimentConfig(model=TINY.replace(vocab_size=200)),
                           run_lib.ByteTokenizer())


def test_a_task_file_replaces_the_built_in_suite_and_rejected_tasks_are_errors(tmp_path):
  given = experiment_testing.even_code_tasks(n_train=3, n_test=2)
  path = str(tmp_path / "tasks.jsonl")
  task_format.dump_jsonl(given, path)
  cfg = ExperimentConfig(model=TINY, task_file=path)
  all_tasks, train, heldout, _ = run_lib.eval_split(cfg)
  assert all_tasks == given and train == given[:3] and heldout == given[3:]
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps({**given[0].to_json(), "task_id": "bad one"}) + "\n")
  with pytest.raises(ValueError, match=r"1 task\(s\) rejected: .*task_id 'bad one' must match"):
    run_lib.eval_split(cfg)
  with pytest.raises(ValueError, match="does not exist"):
    run_lib.eval_split(dataclasses.replace(cfg, task_file=str(tmp_path / "none.jsonl")))


def test_held_back_rl_tasks_are_out_of_the_corpus_and_the_evaluated_split():
  from envs.tasks import suite_repo  # pylint: disable=g-import-not-at-top
  from experiment.config import AgentConfig  # pylint: disable=g-import-not-at-top
  repo = dict(model=TINY, suite="repo", agent=AgentConfig(max_context_tokens=100))
  for fraction in (0.15, 0.0):
    cfg = ExperimentConfig(**repo, validation_fraction=fraction, rl_tasks="held_back",
                           rl_held_back_fraction=0.4)
    all_tasks, rl, evaluated, _ = run_lib.eval_split(cfg)
    _, plain_train, plain_eval, _ = run_lib.eval_split(dataclasses.replace(cfg, rl_tasks="train"))
    assert [t.task_id for t in evaluated] == [t.task_id for t in plain_eval]
    corpus_ids = {t.task_id for t in all_tasks if t.split == "train"}
    rl_ids = {t.task_id for t in rl}
    # About 40% of the train tasks, none in the corpus's split nor evaluated; together with the
    # corpus's they are the train tasks of the plain split.
    assert 0.3 < len(rl) / len(plain_train) < 0.5
    assert not rl_ids & corpus_ids and not rl_ids & {t.task_id for t in evaluated}
    assert rl_ids | corpus_ids == {t.task_id for t in plain_train}
    assert all(t.split == "rl_only" for t in rl)
    # The corpus itself holds none of them: its transcripts come from the train split only.
    sources = [t for t in all_tasks if t.split == "train"]
    assert len(sources) == len(plain_train) - len(rl)
  assert len(suite_repo.generate()) == len(all_tasks)
  with pytest.raises(ValueError, match="rl_tasks must be one of"):
    ExperimentConfig(**repo, rl_tasks="held_out")
  with pytest.raises(ValueError, match="rl_held_back_fraction"):
    ExperimentConfig(**repo, rl_tasks="held_back", rl_held_back_fraction=1.0)


def test_rl_templates_filter_rl_tasks_only():
  from experiment.config import AgentConfig  # pylint: disable=g-import-not-at-top
  repo = dict(model=TINY, suite="repo", agent=AgentConfig(max_context_tokens=100),
              validation_fraction=0.15, rl_tasks="held_back")
  all_tasks, rl, evaluated, _ = run_lib.eval_split(ExperimentConfig(**repo))
  kept = ("rename", "op")
  f_all, f_rl, f_eval, _ = run_lib.eval_split(ExperimentConfig(**repo, rl_templates=kept))
  assert [t.task_id for t in f_rl] == [t.task_id for t in rl
                                       if t.metadata["template"] in kept]
  assert {t.metadata["template"] for t in f_rl} == set(kept)
  # The corpus (train split) and the evaluated split keep every template.
  assert [t.task_id for t in f_eval] == [t.task_id for t in evaluated]
  assert [(t.task_id, t.split) for t in f_all] == [(t.task_id, t.split) for t in all_tasks]
  assert {t.metadata["template"] for t in f_eval} > set(kept)
  with pytest.raises(ValueError, match="match no RL task"):
    run_lib.eval_split(ExperimentConfig(**repo, rl_templates=("rename", "nope")))
  with pytest.raises(ValueError, match="tuple of template names"):
    ExperimentConfig(**repo, rl_templates="rename")


def test_rl_fresh_tasks_add_new_repositories_to_rl_only():
  from experiment.config import AgentConfig  # pylint: disable=g-import-not-at-top
  repo = dict(model=TINY, suite="repo", agent=AgentConfig(max_context_tokens=100),
              validation_fraction=0.15, rl_tasks="held_back", rl_templates=("helper", "op"))
  all_tasks, rl, evaluated, _ = run_lib.eval_split(ExperimentConfig(**repo))
  f_all, f_rl, f_eval, _ = run_lib.eval_split(ExperimentConfig(**repo, rl_fresh_tasks=10))
  fresh = [t for t in f_rl if t.task_id.startswith("repo-fresh-")]
  # The held-back tasks as before, then fresh ones of the RL templates only; the corpus's and
  # the evaluated split's tasks are unchanged, and no fresh task is any of theirs.
  assert [t.task_id for t in f_rl[:len(rl)]] == [t.task_id for t in rl]
  assert len(f_rl) == len(rl) + len(fresh) and len(fresh) > 10
  assert collections.Counter(t.metadata["template"] for t in fresh)["helper"] == 10
  assert {t.metadata["template"] for t in fresh} == {"helper", "op"}
  assert [(t.task_id, t.split) for t in f_all] == [(t.task_id, t.split) for t in all_tasks]
  assert [t.task_id for t in f_eval] == [t.task_id for t in evaluated]
  known = {tuple(sorted(t.metadata["fix"].items())) for t in all_tasks}
  assert not known & {tuple(sorted(t.metadata["fix"].items())) for t in fresh}
  with pytest.raises(ValueError, match="rl_fresh_tasks"):
    ExperimentConfig(**repo, rl_fresh_tasks=-1)
  with pytest.raises(ValueError, match="rl_fresh_tasks"):
    ExperimentConfig(model=TINY, rl_fresh_tasks=5)  # the pyfunc suite has no fresh tasks


def test_first_visit_trend_counts_only_steps_with_new_tasks():
  # 8 steps: new tasks in the first three only (later steps repeat them).
  per_step = [(8, 2), (8, 4), (4, 3)] + [(0, 0)] * 5
  t = run_lib._first_visit_trend(per_step)  # pylint: disable=protected-access
  assert t == {"first_quarter": 0.375, "last_quarter": None, "attempts": 20, "passed": 9}
  f = run_lib._feedback_trend([(4, 1), (2, 0), (5, 5), (5, 4)])  # pylint: disable=protected-access
  assert f == {"first_quarter": 0.25, "last_quarter": 0.8, "saw_failing_test": 16,
               "fixed_after_failure": 10}


def test_rl_learner_takes_the_rl_settings():
  learner_cfg = LearnerConfig(
      optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=5),
      loss=LossConfig(objective="policy", aux_loss=False, replay="proximal",
                      policy=PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)),
      sampler_dtype="float32")
  cfg = ExperimentConfig(model=TINY, rl=RLConfig(
      learner=learner_cfg, pipeline=PipelineConfig(batch_rows=4, seq_len=64, max_staleness=3)))
  learner = run_lib.make_rl_learner(cfg, build.create(TINY), sharding.make_mesh((1, 1, 1, 1)))
  assert learner.opt_cfg == learner_cfg.optimizer
  assert float(learner.schedule(0)) == 0.0 and float(learner.schedule(5)) == pytest.approx(3e-4)
  # Everything but the staleness bound is the config's; the bound is the pipeline's.
  assert learner.loss_cfg == dataclasses.replace(learner_cfg.loss, max_staleness=3)
  assert learner.sampler_dtype == np.float32
  # The defaults: the policy loss without the router's auxiliary losses.
  same = run_lib.make_rl_learner(ExperimentConfig(model=TINY), build.create(TINY),
                                 sharding.make_mesh((1, 1, 1, 1)))
  assert same.loss_cfg.objective == "policy" and not same.loss_cfg.aux_loss
  assert same.loss_cfg.max_staleness == PipelineConfig().max_staleness
  with pytest.raises(ValueError, match="objective must be 'policy'"):
    RLConfig(learner=LearnerConfig())


def test_sampler_replicas_must_fit_the_samplers_share_of_the_devices():
  """Each replica takes a device of the samplers' share (the machine's first devices); one more
  would run on the learner's. 12 devices at the default 1/3: 4 for samplers, 8 for the learner."""
  devices = list(range(12))
  split = resources.split_devices(devices, 1 / 3)
  assert (len(split.sampler_devices), len(split.learner_devices)) == (4, 8)
  fits = ExperimentConfig(model=TINY, rl=RLConfig(num_samplers=2, sampler_replicas=2))
  run_lib.check_sampler_devices(fits, split)
  too_many = ExperimentConfig(model=TINY, rl=RLConfig(num_samplers=3, sampler_replicas=2))
  with pytest.raises(ValueError, match=r"3 sampler\(s\) x 2 replicas x 1 devices need 6 devices "
                     r"but the samplers' share is 4 \(ExperimentConfig.inference_fraction = "
                     r"0.333 of 12\)"):
    run_lib.check_sampler_devices(too_many, split)
  # Sharded engines: each replica takes expert x tensor devices.
  run_lib.check_sampler_devices(ExperimentConfig(model=TINY, rl=RLConfig(
      sampler_replicas=2, sampler_expert=2)), split)
  with pytest.raises(ValueError, match=r"1 sampler\(s\) x 1 replicas x 8 devices need 8"):
    run_lib.check_sampler_devices(ExperimentConfig(model=TINY, rl=RLConfig(
        sampler_expert=4, sampler_tensor=2)), split)
  with pytest.raises(ValueError, match="sampler_expert >= 1"):
    RLConfig(sampler_tensor=0)
  # One engine per sampler on the default device, shared with the learner on a 1-device machine.
  run_lib.check_sampler_devices(ExperimentConfig(model=TINY, rl=RLConfig(num_samplers=2)),
                                resources.split_devices([0], 1 / 3))
  with pytest.raises(ValueError, match="sampler_replicas >= 1"):
    RLConfig(sampler_replicas=0)



@pytest.mark.parametrize("rows", [1, 3])
def test_agent_engines_prefill_the_configured_prompts_a_call(rows):
  """The repository suite's engines are deterministic and every prefill call holds at most
  RLConfig.sampler_prefill_rows prompts (agent turns arrive one to three at a time, so wider
  calls mostly compute padding): four prompts queued together take ceil(4 / rows) calls, and
  each prompt's completion is what it is alone."""
  from rollout.engine import Engine, SamplingParams  # pylint: disable=g-import-not-at-top
  from experiment.config import AgentConfig  # pylint: disable=g-import-not-at-top
  cfg = ExperimentConfig(model=TINY.replace(max_seq_len=64), suite="repo",
                         agent=AgentConfig(max_context_tokens=48),
                         rl=RLConfig(sampler_prefill_rows=rows,
                                     pipeline=PipelineConfig(max_staleness=1, seq_len=64)))
  ec = run_lib._engine_config(cfg, 4, prefill_rows=cfg.rl.sampler_prefill_rows)
  assert ec.deterministic and ec.prefill_rows == rows
  prompts = [[1, 5, 9, 2], [1, 7], [1, 3, 3, 8, 4, 6], [1, 2, 2]]
  sp = SamplingParams(max_tokens=5, temperature=1.0, seed=3)
  eng = Engine(build.create(TINY.replace(max_seq_len=64), seed=0), config=ec)
  try:
    handles = eng.submit_batch(prompts, sp)  # queued at once: one prompt-length bucket
    together = [h.result(120)[0].token_ids for h in handles]
    assert eng.stats["prefill_calls_total"] == -(-len(prompts) // rows)
    alone = [eng.submit(p, sp).result(120)[0].token_ids for p in prompts]
  finally:
    eng.stop()
  assert together == alone


def test_rl_config_rejects_prefill_rows_below_one():
  with pytest.raises(ValueError, match="sampler_prefill_rows"):
    RLConfig(sampler_prefill_rows=0)


def test_agentic_experiment_end_to_end(tmp_path):
  """The repository suite as agent.gin runs it: a BPE tokenizer trained on the corpus,
  pre-training on code and agent transcripts in its tokens, multi-turn evaluation and multi-turn
  RL through the same harness; summary.json carries the agentic RL fields and the models are
  saved with their tokenizer."""
  from envs.harness import toolcall  # pylint: disable=g-import-not-at-top
  from envs.tasks import suite_repo  # pylint: disable=g-import-not-at-top
  from experiment.config import AgentConfig  # pylint: disable=g-import-not-at-top
  from moe import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  every = suite_repo.generate()
  tasks = suite_repo.split(every, "train")[:6] + suite_repo.split(every, "test")[:2]
  cfg = ExperimentConfig(
      model=TINY.replace(max_seq_len=512),
      pretrain=PretrainConfig(steps=2, batch_rows=2, seq_len=256, corpus_snippets=10,
                              corpus_repeats=1, transcript_summarised_share=1.0,
                              probe_tasks=1, probe_every=1),
      rl=RLConfig(steps=1, sampler_slots=8, pipeline=PipelineConfig(
          max_staleness=1, prompts_per_step=2, attempts=2, max_new_tokens=48, seq_len=368,
          batch_rows=8, grade_workers=2)),
      eval=EvalConfig(samples=1, max_tokens=48, k_list=(1,)),
      suite="repo", agent=AgentConfig(max_turns=3, max_context_tokens=352,
                                      summary_max_tokens=32),
      sandbox_pool=2, tokenizer="bpe", bpe_vocab_size=1024)
  summary = run_lib.run(cfg, str(tmp_path), progress=False, echo=lambda _: None, tasks=tasks)
  assert summary["heldout_tasks"] == 2 and summary["before"]["samples"] == 2
  tok = tokenizer_lib.BPETokenizer.load(str(tmp_path / "tokenizer"))
  assert isinstance(tok, tokenizer_lib.BPETokenizer) and 300 < tok.vocab_size <= 1024
  for tag in toolcall.TEMPLATE_TOKENS:
    assert tok.encode(tag) == [tok.special_id(tag)]
  corpus = json.load(open(tmp_path / "corpus.json"))
  assert corpus["tokenizer"] == {"kind": "bpe", "class": "BPETokenizer",
                                "vocab_size": tok.vocab_size}, corpus
  assert corpus["agent_documents"] >= 6 and corpus["summarised_episodes"] >= 1, corpus
  assert corpus["documents"] == corpus["agent_documents"] + corpus["code_documents"]
  # Transcripts fit the window in the BPE's tokens, several bytes a token.
  assert corpus["max_segment_tokens"] <= 352 and corpus["median_segment_tokens"] > 0
  # The copy probe ran at both pre-training steps, on the made-up-name tasks (one a template).
  probe = json.load(open(tmp_path / "summary.json"))["copy_probe"]
  assert probe["all"]["turns"] >= 10 and 0 <= probe["all"]["exact"] <= probe["all"]["turns"]
  assert {"read_file", "edit_file", "submit"} <= set(probe), probe
  logged = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in logged if r["phase"] == "pretrain" and "probe_all" in r] == [1, 2]
  rl = json.load(open(tmp_path / "summary.json"))["rl"]
  for key in ("episodes_trained", "mean_turns", "tool_calls_per_episode", "summarised_episodes",
              "hack_flagged", "zero_variance_groups", "prefix_cache_hit_rate", "feedback"):
    assert key in rl, key
  # Every attempt of the one step is on a task RL had not seen.
  assert rl["first_visit"]["attempts"] == rl["episodes_generated"] > 0, rl
  assert rl["episodes_trained"] == 4 and rl["mean_turns"] >= 1
  # Later turns of an episode continue the previous request: the samplers' prefix cache hit.
  assert rl["prefix_cache_hit_rate"] > 0, rl
  # Where the samplers' time went: one prompt a prefill call, so at least a call an episode.
  work = rl["sampler"]
  assert work["prefill_calls"] >= rl["episodes_generated"] and work["decode_calls"] > 0, work
  assert work["prompt_tokens"] > 0 and work["generated_tokens"] > 0, work
  assert work["prefill_seconds"] > 0 and work["decode_seconds"] > 0, work
  evals = [json.loads(l) for l in open(tmp_path / "eval_before.jsonl")]
  assert all(r["mode"] == "agent" for r in evals)
  # Each saved model has the tokenizer's vocabulary and its tokenizer.json beside it.
  for name in ("pretrained_model", "final_model"):
    model_dir = str(tmp_path / name)
    assert moe_checkpoint.load_config(model_dir).vocab_size == tok.vocab_size
    again = tokenizer_lib.for_model(model_dir, tok.vocab_size)
    assert isinstance(again, tokenizer_lib.BPETokenizer)
    assert again.encode("def f():") == tok.encode("def f():")
    assert moe_checkpoint.load_model(model_dir).config.vocab_size == tok.vocab_size


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
