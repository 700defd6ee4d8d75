"""The main job, end to end: pre-train the MoE on a generated code corpus, evaluate it on the
held-out programming tasks, improve it with asynchronous RL on the train split, evaluate again.

Library code (plain arguments); `tools/main.py` is the gin-configured entry point. Nothing here is
tuned on the held-out split: it is only ever evaluated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from flax import nnx

from envs.harness import agent_loop
from envs.harness import toolcall
from envs.sandbox import pool as pool_lib
from envs.tasks import suite_pyfunc
from envs.tasks import suite_repo
from envs.tasks import task_format
from envs.tasks import transcripts as transcripts_lib
from evaluation import evaluate as evaluate_lib
from evaluation import teacher_forced
from experiment import hf_checkpoint
from experiment import reporting
from experiment import splits
from experiment.config import ExperimentConfig
from moe import build
from moe import checkpoint as moe_checkpoint
from moe import sharding
from moe.hf import special_tokens
from moe import tokenizer as tokenizer_lib
from moe.tokenizer import BPETokenizer, ByteTokenizer
from pipeline import local
from pipeline import resources
from rl import learner as learner_lib
from rl import pretrain_data
from rl.trainer import Trainer
from rollout.engine import EngineConfig

log = logging.getLogger(__name__)


def write_corpus(docs: list, directory: str) -> list:
  """One file per document (each becomes BOS + text + EOS in the pre-training pipeline)."""
  os.makedirs(directory, exist_ok=True)
  paths = []
  for i, d in enumerate(docs):
    p = os.path.join(directory, f"doc_{i:06d}.py")
    with open(p, "w", encoding="utf-8") as f:
      f.write(d)
    paths.append(p)
  return paths


def _sampler_work(totals: dict) -> dict:
  """Where the RL samplers' time went (their engines' counters summed): device calls, their
  seconds, prompt tokens prefilled and tokens generated."""
  keys = ("prefill_calls_total", "prefill_seconds_total", "prompt_tokens_total",
          "decode_calls_total", "decode_seconds_total", "generated_tokens_total")
  return {k[:-len("_total")]: round(float(totals.get(k, 0)), 2) for k in keys}


def _engine_config(cfg: ExperimentConfig, slots: int, eos_token_ids: tuple = (),
                   prefill_rows: int = 1) -> EngineConfig:
  """The samplers' engine; `eos_token_ids` (a checkpoint's, e.g. a chat model's <|im_end|>) end
  every completion besides the tokenizer's EOS; `prefill_rows` as RLConfig.sampler_prefill_rows
  (the repository suite only)."""
  if cfg.suite == "pyfunc":
    return EngineConfig(max_slots=slots, max_len=cfg.model.max_seq_len, decode_steps=16,
                        eos_token_ids=tuple(eos_token_ids))
  # Agent turns come in every prompt length, batch size and cached-prefix length: left to
  # pick the smallest shape for each call, the engine compiles a program for nearly every
  # combination (seconds each on a CPU; they dominated a multi-turn evaluation). Deterministic
  # mode runs every call at the engine's full shapes (all slots, the whole cache, the full
  # block table), so only the prompt-length buckets compile, and sampling depends on the seed
  # alone. One prompt a prefill call by default: agent turns reach the engine one to three at a
  # time (each when its tool call returns), so calls padded to 8 rows were mostly padding
  # (BENCHMARKS.md, "Agentic RL", "Sampler shapes").
  window = cfg.model.max_seq_len
  return EngineConfig(max_slots=slots, max_len=window, decode_steps=16, deterministic=True,
                      min_prefill_len=max(16, window // 16), prefill_rows=prefill_rows,
                      eos_token_ids=tuple(eos_token_ids))


def _save_model(model, tokenizer, directory: str, eos_token_ids: Sequence[int] = ()) -> None:
  """The model's parameters, and its tokenizer beside them unless it is bytes: a trained BPE's
  tokenizer.json, or a checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json with
  its roles, its chat template), so `moe.tokenizer.for_model(directory)` finds either; and the
  checkpoint's EOS list (`eos_token_ids`, a chat model's end of turn among them) in
  generation_config.json, as a Hugging Face checkpoint keeps it, so whatever serves or samples
  the model from this directory (the multi-process parts, pipeline.processes; a later run's
  pretrained_model) stops where it does and writes its agent turns as this run does."""
  moe_checkpoint.save_params(model, directory)
  if isinstance(tokenizer, BPETokenizer):
    tokenizer.save(directory)
  elif isinstance(tokenizer, tokenizer_lib.JsonTokenizer):
    special_tokens.write_tokenizer(tokenizer, directory, vocab_size=model.config.vocab_size)
  if eos_token_ids:
    special_tokens.write_generation_config(
        directory, special_tokens.token_ids(tokenizer, eos_token_ids))


def evaluate_tasks(model, tasks, cfg: ExperimentConfig, pool, out_path: str, progress=None,
                   tokenizer=None, eos_token_ids: tuple = (), chat=None):
  """(report, passing samples, samples) of `model` on `tasks`, scored as the run scores its
  evaluated split (cfg.eval, cfg.agent's loop); per-task results written to `out_path`."""
  e = cfg.eval
  report = evaluate_lib.evaluate(
      model, tasks, n=e.samples, k_list=e.k_list, temperature=e.temperature,
      max_tokens=e.max_tokens, seed=cfg.seed + 17, pool=pool, out_path=out_path,
      engine_config=_engine_config(cfg, 64 if cfg.suite == "pyfunc" else 16, eos_token_ids),
      progress=progress, loop_config=cfg.agent.loop_config(e.max_tokens, chat), tokenizer=tokenizer,
      add_bos=tokenizer is None or tokenizer.bos_id is not None)
  passed = sum(r.c for r in report.results)
  total = sum(r.n for r in report.results)
  return report, passed, total


def corpus(cfg: ExperimentConfig, all_tasks, pool, tokenizer=None, *,
           tasks_share: int = 1, chat=None) -> tuple[list, dict]:
  """The pre-training documents and what they hold.

  Single-turn suite: the train tasks' prompts and solutions and generated code snippets. The
  repository suite: generated code snippets and agent transcripts of the train tasks (oracle
  episodes run by the harness with the RL run's loop settings and turns, `chat`
  (envs.harness.agent_loop.chat_for), and `tokenizer`, the model's, since the context window
  is counted in its tokens: envs.tasks.transcripts), so the model
  learns the tool-call format, reading test output, fixing and summarising before RL.
  With pretrain.random_name_tasks, transcripts of made-up-name tasks join them (no held-out
  task's names). `tasks_share` k > 1 runs transcripts of every k-th task only (the tokenizer's
  sample).
  Held-out (and validation) tasks never appear.
  """
  p = cfg.pretrain
  if cfg.suite == "pyfunc":
    docs = suite_pyfunc.pretraining_corpus(all_tasks, n_snippets=p.corpus_snippets,
                                           repeats=p.corpus_repeats, seed=cfg.seed)
    return docs, {"documents": len(docs)}
  code = suite_pyfunc.pretraining_corpus([], n_snippets=p.corpus_snippets, repeats=0,
                                         seed=cfg.seed)
  # The oracle takes the turns its plan needs (the task's limit), whatever RL's turn cap.
  loop = dataclasses.replace(cfg.agent.loop_config(cfg.rl.pipeline.max_new_tokens, chat),
                             max_turns=None)
  sources_ = [t for t in all_tasks if t.split == "train"]
  if p.random_name_tasks:
    sources_ += suite_repo.generate(seed=cfg.seed + 1, per_template=p.random_name_tasks,
                                    names="random")
  sources_ = sources_[::tasks_share]
  records = []
  for r in range(p.corpus_repeats):
    records += transcripts_lib.transcript_records(
        sources_, pool, loop_config=loop, tokenizer=tokenizer or ByteTokenizer(),
        seed=cfg.seed + r, summarised_share=p.transcript_summarised_share)
  agent_docs = [d for t in records for d in t.documents]
  docs = code + agent_docs
  np.random.default_rng(cfg.seed).shuffle(docs)
  return docs, {**transcripts_lib.stats(records), "documents": len(docs),
                "code_documents": len(code), "agent_documents": len(agent_docs)}


def make_tokenizer(cfg: ExperimentConfig, all_tasks, pool):
  """The model's tokenizer: bytes, or (cfg.tokenizer == "bpe") byte-level BPE trained on a
  sample of the pre-training corpus (every code snippet, the transcripts of every third
  task, rendered in bytes), the chat template's tags one token each."""
  if cfg.tokenizer == "bytes":
    return ByteTokenizer()
  # The sample is rendered in bytes: the loop's budgets, counted in the BPE's tokens, are
  # scaled to bytes (about four a token on these transcripts) so the same episodes play out.
  a, pl = cfg.agent, cfg.rl.pipeline
  in_bytes = dataclasses.replace(
      cfg, agent=dataclasses.replace(a, max_context_tokens=4 * a.max_context_tokens,
                                     summary_max_tokens=4 * a.summary_max_tokens),
      rl=dataclasses.replace(cfg.rl, pipeline=dataclasses.replace(
          pl, max_new_tokens=4 * pl.max_new_tokens, seq_len=4 * pl.seq_len)),
      model=cfg.model.replace(max_seq_len=4 * cfg.model.max_seq_len))
  docs, _ = corpus(in_bytes, all_tasks, pool, ByteTokenizer(), tasks_share=3)
  return BPETokenizer.train(docs, cfg.bpe_vocab_size, extra_tokens=toolcall.TEMPLATE_TOKENS)


def with_tokenizer(cfg: ExperimentConfig, tokenizer) -> ExperimentConfig:
  """`cfg` with the model's vocabulary that of `tokenizer` (BPE); bytes must already fit."""
  if isinstance(tokenizer, BPETokenizer):
    return dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=tokenizer.vocab_size))
  if cfg.model.vocab_size < tokenizer.vocab_size:
    raise ValueError(f"the model's vocab_size ({cfg.model.vocab_size}) is smaller than the "
                     f"tokenizer's ({tokenizer.vocab_size})")
  return cfg


def pretrain(cfg: ExperimentConfig, run_dir: str, all_tasks, mesh, *,
             rep: Optional[reporting.Reporter] = None,
             echo: Callable[[str], None] = print, pool=None, tokenizer=None, init_model=None,
             chat=None):
  """Continual pre-training on the generated corpus (`corpus`, in `tokenizer`'s tokens, its
  agent transcripts in the turns `chat`: envs.harness.agent_loop.chat_for) of `init_model` (an
  imported checkpoint), else of a fresh model; returns the model (`init_model` or the fresh one
  if steps == 0). cfg.model's vocabulary must hold the tokenizer's."""
  t0 = time.time()
  tokenizer = tokenizer or ByteTokenizer()
  pre_cfg = cfg.model.replace(capacity_factor=cfg.pretrain.capacity_factor)
  p = cfg.pretrain
  if init_model is not None:  # the same weights under the pre-training capacity
    init_model = nnx.merge(nnx.graphdef(build.abstract(pre_cfg)), nnx.state(init_model))
  pre = learner_lib.build_learner(p.learner_config(), pre_cfg, mesh=mesh, seed=cfg.seed,
                                  init_model=init_model)
  if p.steps:
    docs, about = corpus(cfg, all_tasks, pool, tokenizer, chat=chat)
    about["tokenizer"] = {"kind": "checkpoint" if cfg.hf_checkpoint else cfg.tokenizer,
                          "class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size}
    with open(os.path.join(run_dir, "corpus.json"), "w", encoding="utf-8") as f:
      json.dump(about, f, indent=1)
    if cfg.suite != "pyfunc":
      echo(f"corpus: {about['code_documents']} code documents, {about['agent_documents']} agent "
           f"transcript segments ({about['transcripts']} oracle episodes, "
           f"{about['summarised_episodes']} summarised; median "
           f"{about['median_segment_tokens']:.0f} tokens) in {time.time() - t0:.0f}s")
    files = write_corpus(docs, os.path.join(run_dir, "corpus"))
    trainer = Trainer(pre, pretrain_data.pretrain_dataset(
        files, seq_len=p.seq_len, batch_rows=p.batch_rows, seed=cfg.seed, tokenizer=tokenizer,
        trained_spans=toolcall.assistant_spans if p.model_turns_only else None))
    probe = (copy_probe(cfg, pool, tokenizer, chat) if p.probe_tasks and cfg.suite == "repo"
             else None)
    if rep is not None:
      rep.start_phase("pretrain", p.steps)
    for i in range(1, p.steps + 1):
      m = trainer.step()
      if probe is not None and (i % p.probe_every == 0 or i == p.steps):
        result = probe(pre.model())
        m = {**m, **{f"probe_{k}": ok / n for k, (ok, n) in result.items()}}
      if rep is not None:
        rep.log("pretrain", pre.step, m)
    if rep is not None:
      rep.end_phase()
    echo(f"pre-training: {p.steps} steps on {len(docs)} documents in {time.time() - t0:.0f}s, "
         f"final loss {m['loss']:.3f}")
    if probe is not None:
      with open(os.path.join(run_dir, "copy_probe.json"), "w", encoding="utf-8") as f:
        json.dump({k: {"exact": ok, "turns": n} for k, (ok, n) in result.items()}, f, indent=1)
      echo(f"copy probe (teacher-forced model turns, {p.probe_tasks * len(suite_repo.TEMPLATES)}"
           f" made-up-name tasks): {teacher_forced.summary(result)}")
  # The RL model is dropless (the config's capacity), the pre-training one may drop: same weights.
  return nnx.merge(nnx.graphdef(build.abstract(cfg.model)), nnx.state(pre.model()))


def copy_probe(cfg: ExperimentConfig, pool, tokenizer, chat=None):
  """The pre-training probe (PretrainConfig.probe_tasks): model -> {label: (exact, turns)} over
  the oracle transcripts (direct plan where it succeeds) of fresh made-up-name tasks (seed + 2;
  the corpus's made-up-name tasks use seed + 1, and the suite's names are never made up), in
  rows of the pre-training length, in the run's agent turns (`chat`)."""
  p = cfg.pretrain
  tasks = suite_repo.generate(seed=cfg.seed + 2, per_template=p.probe_tasks, names="random")
  loop = dataclasses.replace(cfg.agent.loop_config(cfg.rl.pipeline.max_new_tokens, chat),
                             max_turns=None)
  docs = []
  for t in tasks:  # The direct plan, else another that succeeds under this loop config.
    try:
      docs += [d for r in transcripts_lib.transcript_records(
          [t], pool, loop_config=loop, tokenizer=tokenizer, seed=cfg.seed, mix={"direct": 1.0},
          summarised_share=0.0) for d in r.documents]
    except transcripts_lib.OracleError as e:
      log.info("copy probe: %s left out (%s)", t.task_id, e)
  if not docs:
    raise ValueError("copy probe: no probe task has an oracle transcript under this config")
  rows = teacher_forced.rows(docs, tokenizer, p.seq_len)
  return lambda model: teacher_forced.exact_turns(teacher_forced.greedy_predictor(model), rows,
                                                  batch_rows=p.batch_rows)


def make_rl_learner(cfg: ExperimentConfig, model, mesh) -> learner_lib.Learner:
  """The RL learner, starting from `model` (the pre-trained policy).

  The same call as the multi-process learner's (pipeline.processes.run_learner): cfg.rl.learner
  with the pipeline's staleness bound.
  """
  return learner_lib.build_learner(cfg.rl.learner, cfg.model, mesh=mesh, seed=cfg.seed,
                                   init_model=model,
                                   max_staleness=cfg.rl.pipeline.max_staleness)


def check_sampler_devices(cfg: ExperimentConfig, split: resources.ResourceSplit) -> None:
  """Raises ValueError unless the samplers' engines fit the samplers' share of the devices.

  Each sampler replica takes sampler_expert x sampler_tensor devices, the first of the machine
  (pipeline.samplers.build_engines); more of them than the share holds would run on the
  learner's devices.
  """
  r = cfg.rl
  per = r.sampler_expert * r.sampler_tensor
  need = r.num_samplers * r.sampler_replicas * per
  if (r.sampler_replicas > 1 or per > 1) and need > len(split.sampler_devices):
    raise ValueError(f"{r.num_samplers} sampler(s) x {r.sampler_replicas} replicas x {per} "
                     f"devices need {need} "
                     f"devices but the samplers' share is {len(split.sampler_devices)} "
                     f"(ExperimentConfig.inference_fraction = {cfg.inference_fraction:.3g} of "
                     f"{len(split.sampler_devices) + len(split.learner_devices)})")


def eval_split(cfg: ExperimentConfig, tasks: Optional[Sequence] = None):
  """(all tasks, RL train tasks, evaluated tasks, their split's name).

  With cfg.rl_tasks == "held_back" the RL tasks are a share of the train tasks relabelled
  split="rl_only" in `all tasks`, so the corpus and the tokenizer, which read the train split,
  never see them. cfg.rl_templates then keeps the RL tasks of those templates only (the corpus
  and the evaluated split keep every template).

  `tasks`: the tasks to use (default: cfg.task_file's, else the built-in suite of cfg.suite,
  envs.tasks.suite_pyfunc or envs.tasks.suite_repo),
  their `split` saying which are train and which held out. Normally the evaluated tasks are the
  held-out split. With cfg.validation_fraction > 0 they are a validation split carved from the train
  tasks (relabelled in `all tasks`, so the pre-training corpus leaves them out as it leaves out
  held-out tasks) and the held-out split is not used.
  """
  if tasks is None and cfg.task_file:
    tasks = load_task_file(cfg.task_file)
  if tasks is None:
    all_tasks = suite_repo.generate() if cfg.suite == "repo" else suite_pyfunc.generate()
  else:
    all_tasks = list(tasks)
  if cfg.validation_fraction > 0:
    all_tasks, train, evaluated = splits.carve_validation(all_tasks, cfg.validation_fraction)
    name = splits.VALIDATION
  else:
    train = [t for t in all_tasks if t.split == "train"]
    evaluated = [t for t in all_tasks if t.split == "test"]
    name = "held-out"
  if cfg.rl_tasks == "held_back":  # RL's tasks leave the train split, so the corpus lacks them
    all_tasks, _, train = splits.carve(all_tasks, cfg.rl_held_back_fraction, splits.RL_ONLY)
  if cfg.rl_templates:
    known = {t.metadata.get("template") for t in train}
    if unknown := sorted(set(cfg.rl_templates) - known):
      raise ValueError(f"rl_templates {unknown} match no RL task (their templates: "
                       f"{sorted(map(str, known))})")
    train = [t for t in train if t.metadata.get("template") in cfg.rl_templates]
  if cfg.rl_fresh_tasks:
    train += suite_repo.generate_fresh(all_tasks, seed=cfg.seed + 3,
                                       per_template=cfg.rl_fresh_tasks,
                                       templates=tuple(cfg.rl_templates) or suite_repo.TEMPLATES)
  return all_tasks, train[:cfg.train_tasks], evaluated[:cfg.heldout_tasks], name


def load_task_file(path: str) -> list:
  """The tasks of ExperimentConfig.task_file (envs.tasks.task_format.load_tasks).

  Raises:
    ValueError: no such file or directory, no tasks in it, or tasks the loader rejects (each
      with its reasons): a run must not quietly train on fewer tasks than it was given.
  """
  if not os.path.exists(path):
    raise ValueError(f"task_file {path!r} does not exist")
  loaded = task_format.load_tasks(path)
  if loaded.rejected:
    raise ValueError(f"task_file {path}: {len(loaded.rejected)} task(s) rejected: " + "; ".join(
        f"{r.task_id or r.source}: {', '.join(r.reasons)}" for r in loaded.rejected))
  if not loaded.tasks:
    raise ValueError(f"task_file {path} holds no tasks")
  return loaded.tasks


def run(cfg: ExperimentConfig, run_dir: str, *, progress: bool = True,
        echo: Callable[[str], None] = print, evaluate: bool = True,
        tasks: Optional[Sequence] = None) -> dict:
  """Runs the experiment; returns the summary (also written to run_dir/summary.json).

  `tasks` replaces the built-in suite (see `eval_split`); the pre-training corpus is then their
  train tasks' prompts and solutions and the generated snippets.

  Each RL step's record has, besides the learner's metrics, the mean reward and pass rate of its
  groups, `reward_std` (the mean over its groups of the rewards' standard deviation within the
  group) and `signal_groups` (groups with a non-zero GRPO advantage; the others add nothing to
  the policy gradient), `zero_variance_groups` (groups whose valid attempts all got the same
  reward; `zero_variance_filtered` of them were left out of the batch when the pipeline filters
  them) and `hack_flagged` (attempts envs.hacks flagged, their rewards penalised).

  summary["rl"] holds the RL phase's totals: steps, groups written, episodes trained, episodes
  masked as infrastructure failures, zero-variance groups (and filtered ones), attempts flagged
  for reward hacking, where the attempts were graded (`grading`: the local pool, or the Ray
  fleet's grades per host, retries and host failures; PipelineConfig.grader), and the final
  policy version (what shows RL trained).

  With evaluate=False only the training phases run (the `//tools:train` entry point).

  With cfg.hf_checkpoint the run starts from that Hugging Face checkpoint and its tokenizer
  (experiment.hf_checkpoint) and ends by exporting the final model as one (cfg.hf_export, else
  run_dir/hf_export; summary["hf_export"]).
  """
  t_start = time.time()
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=1, default=str)
  rep = reporting.Reporter(run_dir, progress=progress)
  all_tasks, train, heldout, split_name = eval_split(cfg, tasks)
  # Samplers use the first devices of the split (the engines run on the default device, the
  # first of them); the learner's mesh is laid over the rest. One device: both share it.
  split = resources.split_devices(jax.devices(), cfg.inference_fraction)
  mesh = sharding.make_mesh(cfg.mesh_shape, devices=split.learner_devices)
  check_sampler_devices(cfg, split)
  pool = pool_lib.WarmPool(size=cfg.sandbox_pool)
  timings = {}
  try:
    # -- 0. the tokenizer (BPE: trained on a sample of the corpus; its size sets the vocabulary)
    t0 = time.time()
    source = None  # the Hugging Face checkpoint the run starts from, if any
    model = None
    if cfg.pretrained_model:  # Start from a saved model: no tokenizer training, no pre-training.
      model = moe_checkpoint.load_model(cfg.pretrained_model)
      tok = tokenizer_lib.for_model(cfg.pretrained_model, model.config.vocab_size)
      cfg = dataclasses.replace(cfg, model=model.config)
      echo(f"pre-trained model: {cfg.pretrained_model} ({type(tok).__name__}, "
           f"{tok.vocab_size} ids); tokenizer training and pre-training skipped")
    elif cfg.hf_checkpoint:  # Its own tokenizer; pre-training only if configured.
      model, tok, source = hf_checkpoint.load(cfg)
      cfg = dataclasses.replace(cfg, model=model.config)
      timings["import_s"] = time.time() - t0
      echo(f"Hugging Face checkpoint: {cfg.hf_checkpoint} ({source.architecture}, "
           f"{tok.vocab_size} token ids, EOS ids {list(source.eos_token_ids)}) in "
           f"{time.time() - t0:.0f}s; tokenizer training skipped")
    else:
      tok = make_tokenizer(cfg, all_tasks, pool)
      cfg = with_tokenizer(cfg, tok)
      if isinstance(tok, BPETokenizer):
        timings["tokenizer_s"] = time.time() - t0
        echo(f"tokenizer: byte-level BPE of {tok.vocab_size} ids in {time.time() - t0:.0f}s")
    # The checkpoint's EOS list (a saved model keeps its source's: _save_model), and the turns
    # of every agent episode of the run, decided once here.
    if source is not None:
      eos = source.eos_token_ids
    else:
      eos = special_tokens.eos_token_ids(cfg.pretrained_model) if cfg.pretrained_model else ()
    chat = agent_loop.chat_for(all_tasks, tok, eos)
    if chat is not None:
      echo(f"agent episodes in the model's chat template ({chat.name}), each turn ending at "
           f"{chat.end_of_turn!r}")
    # -- 1. continual pre-training on code -------------------------------------------------
    if not cfg.pretrained_model and (model is None or cfg.pretrain.steps):
      t0 = time.time()
      model = pretrain(cfg, run_dir, all_tasks, mesh, rep=rep, echo=echo, pool=pool,
                       tokenizer=tok, init_model=model, chat=chat)
      timings["pretrain_s"] = time.time() - t0
    if isinstance(tok, BPETokenizer):
      tok.save(os.path.join(run_dir, "tokenizer"))
    _save_model(model, tok, os.path.join(run_dir, "pretrained_model"), eos)

    # -- 2. held-out evaluation before RL ------------------------------------------------------
    t0 = time.time()
    if evaluate:
      before, b_pass, b_total = evaluate_tasks(
          model, heldout, cfg, pool, os.path.join(run_dir, "eval_before.jsonl"), tokenizer=tok,
          eos_token_ids=eos, chat=chat)
      rep.log("eval", 0, {"pass1": b_pass / b_total, "passed": b_pass, "samples": b_total,
                          **{f"pass@{k}": v for k, v in before.pass_at_k.items()
                             if v is not None}}, advance=0)
      echo(f"{split_name} before RL: {b_pass}/{b_total} samples pass "
           f"({len(heldout)} tasks x {cfg.eval.samples}), solved {before.solved}/{len(heldout)}")
      timings["eval_before_s"] = time.time() - t0

    # -- 3. asynchronous RL on the train split ---------------------------------------------------
    t0 = time.time()
    r = cfg.rl
    rl_learner = make_rl_learner(cfg, model, mesh)
    rl_totals = {"steps": 0, "groups": 0, "trained_episodes": 0, "episodes_trained": 0,
                 "infra_failures": 0, "zero_variance_groups": 0, "zero_variance_filtered": 0,
                 "hack_flagged": 0, "policy_version": rl_learner.policy_version}
    step_groups: dict = {}
    feedback: list = []  # per step: (attempts that saw a visible test fail, of them passed)
    # Per step: (attempts on tasks RL had not trained on before, of them passed): the training
    # pass rate on repeats can rise by recall; on first visits only by skill.
    first_visits: list = []
    visited: set = set()

    def on_group(g):
      step_groups.setdefault(g.step, []).append(g)

    def on_step(step, metrics, info):
      groups = step_groups.pop(step - 1, [])
      rewards = [x for g in groups for x in g.rewards if x is not None]
      passed = [x for g in groups for x in g.passed]
      out = dict(metrics)
      new = [x for g in groups if g.task_id not in visited for x in g.passed]
      visited.update(g.task_id for g in groups)
      first_visits.append((len(new), sum(new)))
      if new:
        out["first_visit_pass_rate"] = float(np.mean(new))
      graded = [[x for x in g.rewards if x is not None] for g in groups]
      stds = [float(np.std(v)) for v in graded if v]
      out.update(reward=float(np.mean(rewards)) if rewards else 0.0,
                 pass_rate=float(np.mean(passed)) if passed else 0.0,
                 reward_std=float(np.mean(stds)) if stds else 0.0,
                 signal_groups=info["signal_groups"],
                 zero_variance_groups=info["zero_variance_groups"],
                 zero_variance_filtered=info["zero_variance_filtered"],
                 hack_flagged=info["hack_flagged"],
                 staleness_mean=info["mean_lag"], staleness_max=info["max_lag"],
                 trained_episodes=info["trained_episodes"], learner_wait_s=info["wait_s"],
                 batch_rows=info["rows"],
                 gen_tokens=sum(g.gen_tokens for g in groups),
                 infra_failures=sum(g.infra_failures for g in groups))
      turns = [x for g in groups for x in g.turns]
      if cfg.suite != "pyfunc" and turns:
        saw = sum(g.saw_failing_test for g in groups)
        feedback.append((saw, sum(g.fixed_after_failure for g in groups)))
        out.update(mean_turns=float(np.mean(turns)),
                   tool_calls=float(np.mean([x for g in groups for x in g.tool_calls])),
                   summarised=sum(g.summarised for g in groups), saw_failing_test=saw,
                   fixed_after_failure=sum(g.fixed_after_failure for g in groups))
      rep.log("rl", step, out)

    if r.steps:
      rep.start_phase("rl", r.steps)
      result = local.run(
          learner=rl_learner, tasks=train, pool=pool,
          workdir=os.path.join(run_dir, "rl"),
          config=r.pipeline, num_steps=r.steps, num_samplers=r.num_samplers,
          sampler_replicas=r.sampler_replicas, sampler_expert=r.sampler_expert,
          sampler_tensor=r.sampler_tensor,
          engine_config=_engine_config(cfg, r.sampler_slots, eos, r.sampler_prefill_rows),
          on_step=on_step,
          on_group=on_group, loop_config=cfg.agent.loop_config(r.pipeline.max_new_tokens, chat),
          tokenizer=tok)
      rep.end_phase()
      rl_learner = result.learner
      c = result.controller
      rl_totals = {"steps": result.steps, "groups": result.groups,
                   "trained_episodes": result.batcher["trained_episodes"],
                   "episodes_trained": result.batcher["trained_episodes"],
                   "episodes_generated": c["episodes_generated"],
                   "mean_turns": c["mean_turns"],
                   "tool_calls_per_episode": c["tool_calls_per_episode"],
                   "summarised_episodes": c["summarised_episodes"],
                   "saw_failing_test": c["saw_failing_test"],
                   "fixed_after_failure": c["fixed_after_failure"],
                   "prefix_cache_hit_rate": round(result.samplers["prefix_cache_hit_rate"], 4),
                   "sampler": _sampler_work(result.samplers),
                   "overflow_episodes": result.batcher["overflow_episodes"],
                   "feedback": _feedback_trend(feedback),
                   "first_visit": _first_visit_trend(first_visits),
                   "infra_failures": result.batcher["infra_failures"],
                   "zero_variance_groups": result.batcher["zero_variance_groups"],
                   "zero_variance_filtered": result.batcher["zero_variance_filtered"],
                   "hack_flagged": result.batcher["hack_flagged"],
                   "grading": result.grading,
                   "policy_version": rl_learner.policy_version}
      echo(f"RL: {result.steps} steps, {result.groups} groups in {result.wall_s:.0f}s "
           f"(learner waited {result.learner_wait_s:.0f}s, trained {result.learner_train_s:.0f}s)")
    timings["rl_s"] = time.time() - t0

    # -- 4. held-out evaluation after RL ------------------------------------------------------
    t0 = time.time()
    if evaluate:
      after, a_pass, a_total = evaluate_tasks(
          rl_learner.model(), heldout, cfg, pool, os.path.join(run_dir, "eval_after.jsonl"),
          tokenizer=tok, eos_token_ids=eos, chat=chat)
      rep.log("eval", max(r.steps, 1), {
          "pass1": a_pass / a_total, "passed": a_pass, "samples": a_total,
          **{f"pass@{k}": v for k, v in after.pass_at_k.items() if v is not None}}, advance=0)
      timings["eval_after_s"] = time.time() - t0
    _save_model(rl_learner.model(), tok, os.path.join(run_dir, "final_model"), eos)
    if source is not None:
      t0 = time.time()
      export_dir = cfg.hf_export or os.path.join(run_dir, "hf_export")
      hf_checkpoint.export(rl_learner.model(), tok, source, export_dir)
      timings["export_s"] = time.time() - t0
      echo(f"Hugging Face export: {export_dir}")
  finally:
    pool.close()
    rep.close()
  plots = reporting.make_plots(run_dir)
  summary = {
      "eval_split": split_name, "heldout_tasks": len(heldout), "train_tasks": len(train),
      "samples_per_task": cfg.eval.samples,
      "timings_s": {k: round(v, 1) for k, v in timings.items()},
      "plots": [os.path.basename(x) for x in plots],
      "final_model": os.path.join(run_dir, "final_model"),
      "rl": rl_totals,
  }
  if source is not None:
    summary["hf_export"] = export_dir
  probe_path = os.path.join(run_dir, "copy_probe.json")  # written by pretrain (probe_tasks)
  if os.path.exists(probe_path):
    with open(probe_path, encoding="utf-8") as f:
      summary["copy_probe"] = json.load(f)
  rows = []
  if evaluate:
    summary["before"] = {"passed": b_pass, "samples": b_total, "pass_at_k": before.pass_at_k,
                         "solved": before.solved}
    summary["after"] = {"passed": a_pass, "samples": a_total, "pass_at_k": after.pass_at_k,
                        "solved": after.solved}
    rows += [(f"{split_name} tasks", f"{len(heldout)} ({cfg.eval.samples} samples each, "
                                f"temperature {cfg.eval.temperature})"),
             ("pass@1 before RL", f"{b_pass}/{b_total} = {b_pass / b_total:.3f}"),
             ("pass@1 after RL", f"{a_pass}/{a_total} = {a_pass / a_total:.3f}"),
             ("solved before / after", f"{before.solved} / {after.solved} of {len(heldout)}")]
  summary["total_s"] = round(time.time() - t_start, 1)
  with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1, default=str)
  rows += [(k.replace("_s", " (s)"), f"{v:.0f}") for k, v in timings.items()]
  rows += [("total (s)", f"{summary['total_s']:.0f}"), ("run directory", run_dir)]
  echo(reporting.summary_table(rows))
  return summary


def _quarters(per_step: list) -> dict:
  """Over the first and the last quarter of the steps, sum(b) / sum(a) of the steps' (a, b)
  counts (None where a is 0)."""
  q = max(1, len(per_step) // 4)

  def share(rows):
    n = sum(a for a, _ in rows)
    return None if not n else round(sum(b for _, b in rows) / n, 4)
  return {"first_quarter": share(per_step[:q]), "last_quarter": share(per_step[-q:])}


def _feedback_trend(per_step: list) -> dict:
  """Whether the agent uses test feedback more as RL goes on: over the first and the last
  quarter of the steps, the share of attempts that saw a visible test fail and still passed
  every hidden test (None where no attempt saw a failure)."""
  return {**_quarters(per_step), "saw_failing_test": sum(a for a, _ in per_step),
          "fixed_after_failure": sum(b for _, b in per_step)}


def _first_visit_trend(per_step: list) -> dict:
  """The pass rate of attempts on tasks RL had not trained on before, over the first and the
  last quarter of the steps (None where a quarter had none): a rise is skill, not recall."""
  return {**_quarters(per_step), "attempts": sum(a for a, _ in per_step),
          "passed": sum(b for _, b in per_step)}


def final_line(summary: dict) -> str:
  """The main job's last line of output."""
  b, a = summary["before"], summary["after"]
  return (f"{summary.get('eval_split', 'held-out')} pass@1: "
          f"before {b['passed']}/{b['samples']} -> "
          f"after {a['passed']}/{a['samples']}")
