"""Settings of an end-to-end experiment (plain dataclasses; gin binds them in tools/)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from envs.harness import agent_loop
from envs.harness import turn_format
from moe.config import ModelConfig
from pipeline.config import PipelineConfig
from rl.learner import LearnerConfig
from rl.train_state import OptimizerConfig
from rl.train_step import LossConfig


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
  """Continual pre-training on the generated code corpus (next-token loss).

  Attributes:
    steps: optimizer steps (0 skips pre-training).
    batch_rows / seq_len: rows of packed documents per step.
    learning_rate / warmup_steps / end_lr_factor / weight_decay: AdamW with cosine decay.
    corpus_snippets: extra generated snippets besides the train-split tasks' solutions.
    corpus_repeats: copies of the train-split solutions in the corpus (single-turn suite), or of
      the agent transcripts of the train tasks (repository suite).
    transcript_summarised_share: share of train tasks that get a second, self-summarised
      transcript (repository suite), so the model learns to summarise itself.
    capacity_factor: expert capacity during pre-training (drops are harmless there and save
      compute on the CPU); RL uses the model config's (dropless by default).
    random_name_tasks: repository suite: also transcripts of this many tasks per template whose
      every file, function and constant name is made up (envs.tasks.suite_repo.generate(
      names="random")), so that names can only be copied from the context, not recalled: the
      model learns to copy them (the suite's 238 train tasks alone are memorised instead).
    model_turns_only: in agent transcripts, train only the model's turns (tool calls, fixes,
      summaries), as supervised fine-tuning on agent trajectories does; the system prompt,
      instructions and tool output are context. False trains every token.
    probe_tasks / probe_every: repository suite: every `probe_every` steps (and at the end),
      the teacher-forced probe (evaluation.teacher_forced) on oracle transcripts of this many
      fresh made-up-name tasks per template (a seed no corpus task uses): the share of the
      model's turns it reproduces exactly, per tool. An exact read or edit of a made-up name
      means the model copied it from its context. 0 tasks: no probe.
  """
  steps: int = 400
  batch_rows: int = 32
  seq_len: int = 128
  learning_rate: float = 3e-3
  warmup_steps: int = 30
  end_lr_factor: float = 0.1
  weight_decay: float = 0.01
  corpus_snippets: int = 3000
  corpus_repeats: int = 3
  transcript_summarised_share: float = 0.25
  capacity_factor: Optional[float] = 2.0
  model_turns_only: bool = True
  random_name_tasks: int = 0
  probe_tasks: int = 0
  probe_every: int = 100

  def __post_init__(self):
    if self.steps < 0 or self.batch_rows < 1 or self.seq_len < 8 or self.learning_rate <= 0:
      raise ValueError("PretrainConfig: need steps >= 0, batch_rows >= 1, seq_len >= 8, lr > 0")
    if self.probe_tasks < 0 or self.probe_every < 1:
      raise ValueError("PretrainConfig: need probe_tasks >= 0 and probe_every >= 1, got "
                       f"{self.probe_tasks} and {self.probe_every}")

  def learner_config(self) -> LearnerConfig:
    """The pre-training learner: next-token loss, AdamW with cosine decay over `steps`."""
    return LearnerConfig(
        optimizer=OptimizerConfig(learning_rate=self.learning_rate, schedule="cosine",
                                  warmup_steps=self.warmup_steps, decay_steps=max(self.steps, 1),
                                  end_lr_factor=self.end_lr_factor,
                                  weight_decay=self.weight_decay),
        loss=LossConfig(objective="next_token"))


# The RL learner's defaults. The router's load-balancing and z losses are off: with router replay
# the learner uses the sampler's experts, and the balancing gradient would only pull the router
# away from the routing the samples were drawn with. Weights are published in float32, the
# learner's own precision, so the samplers run exactly the trained policy.
RL_LEARNER = LearnerConfig(loss=LossConfig(objective="policy", aux_loss=False),
                           sampler_dtype="float32")


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """Asynchronous RL on the train split of the built-in programming tasks.

  Attributes:
    steps: learner steps (0 skips RL).
    pipeline: rollout / staleness / batching settings; its max_staleness is also the learner's
      staleness bound.
    learner: optimizer, policy loss, router replay (rl.learner.LearnerConfig, built by
      rl.learner.build_learner in-process and in the multi-process learner alike).
    num_samplers: in-process samplers.
    sampler_replicas: data-parallel engines per sampler, each on its own device of the
      samplers' share (pipeline.samplers.build_engines): more rollouts per version where the
      learner is sharded over its own devices; 1 keeps the sampler on the default device.
    sampler_expert, sampler_tensor: each engine's mesh (rollout.placement): the model's
      experts sharded over `sampler_expert` devices, attention heads and expert hidden units
      over `sampler_tensor`, for a model that does not fit one device; 1 x 1 is one device.
      A sampler then takes num_samplers x sampler_replicas x expert x tensor devices in all.
    sampler_slots: decode slots per engine.
    sampler_prefill_rows: prompts per prefill call of the repository suite's engines, which
      run deterministic (fixed shapes: every call has exactly this many rows); 1 suits agent
      turns, which reach the engine one to three at a time (BENCHMARKS.md, "Agentic RL",
      "Sampler shapes"). Evaluation's engines always use 1.
  """
  steps: int = 60
  pipeline: PipelineConfig = PipelineConfig()
  learner: LearnerConfig = RL_LEARNER
  num_samplers: int = 1
  sampler_replicas: int = 1
  sampler_expert: int = 1
  sampler_tensor: int = 1
  sampler_slots: int = 64
  sampler_prefill_rows: int = 1

  def __post_init__(self):
    if self.sampler_prefill_rows < 1:
      raise ValueError(f"RLConfig.sampler_prefill_rows must be >= 1, got "
                       f"{self.sampler_prefill_rows}")
    if self.steps < 0 or self.num_samplers < 1 or self.sampler_replicas < 1:
      raise ValueError("RLConfig: need steps >= 0, num_samplers >= 1 and sampler_replicas >= 1")
    if self.sampler_expert < 1 or self.sampler_tensor < 1:
      raise ValueError(f"RLConfig: need sampler_expert >= 1 and sampler_tensor >= 1, got "
                       f"{self.sampler_expert} and {self.sampler_tensor}")
    if self.learner.loss.objective != "policy":
      raise ValueError(f"RLConfig: the learner's objective must be 'policy', got "
                       f"{self.learner.loss.objective!r}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out evaluation before and after RL.

  Attributes:
    samples: completions per task (pass@1 is estimated from all of them).
    temperature: sampling temperature (the rollouts' temperature by default).
    max_tokens: generation budget per completion.
    k_list: pass@k values to report.
  """
  samples: int = 4
  temperature: float = 1.0
  max_tokens: int = 48
  k_list: tuple = (1, 4)

  def __post_init__(self):
    if self.samples < 1 or any(k > self.samples or k < 1 for k in self.k_list):
      raise ValueError(f"EvalConfig: every k in {self.k_list} must lie in [1, samples]")


SUITES = ("pyfunc", "repo")
TOKENIZERS = ("bytes", "bpe")
RL_TASKS = ("train", "held_back")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
  """The agent loop of multi-turn (repository) tasks, shared by RL and evaluation.

  Attributes:
    max_turns: model turns per episode.
    max_context_tokens: the context window; an episode that would outgrow it summarises itself
      and goes on in a fresh context (each context trains as its own sequence).
    summary_max_tokens / max_summaries: the summary's budget and how many an episode may write.
    observation_max_chars: tool output is clipped to this.
    max_calls_per_turn: tool calls executed per model turn.
    tools: the tools the system prompt lists and the agent may call (None: every tool, listed
      with its JSON spec).
    summary_request: the user turn asking for the summary (short: the loop keeps room for it
      in every context).
  The tokens per model turn are the pipeline's max_new_tokens in RL and the evaluation's
  max_tokens, as for single-turn tasks.
  """
  max_turns: int = 6
  max_context_tokens: int = 512
  summary_max_tokens: int = 64
  max_summaries: int = 1
  observation_max_chars: int = 240
  max_calls_per_turn: int = 1
  tools: Optional[tuple] = ("run_tests", "read_file", "edit_file", "list_files", "submit")
  summary_request: str = ("Context full. Summarise for yourself: the task, what you found, what "
                          "you changed, what is left.")

  def loop_config(self, max_tokens_per_turn: int,
                  chat: Optional[turn_format.ChatTurns] = None) -> agent_loop.LoopConfig:
    """The loop's settings; `chat`: the model's chat turns (`turn_format.chat_turns` of its
    tokenizer, decided once per run: experiment.run), None for the project's template."""
    return agent_loop.LoopConfig(
        max_turns=self.max_turns, max_context_tokens=self.max_context_tokens,
        summary_max_tokens=self.summary_max_tokens, max_summaries=self.max_summaries,
        observation_max_chars=self.observation_max_chars,
        max_calls_per_turn=self.max_calls_per_turn,
        tools=None if self.tools is None else tuple(self.tools),
        summary_request=self.summary_request,
        max_tokens_per_turn=max_tokens_per_turn, chat=chat)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything the main job needs.

  `suite` picks the tasks: "pyfunc" (single-turn function bodies, envs.tasks.suite_pyfunc) or
  "repo" (multi-turn repository tasks where the tools matter, envs.tasks.suite_repo: the agent
  loop with `agent`'s settings in RL and evaluation, and agent transcripts in pre-training).
  """
  model: ModelConfig
  pretrain: PretrainConfig = PretrainConfig()
  rl: RLConfig = RLConfig()
  eval: EvalConfig = EvalConfig()
  seed: int = 0
  mesh_shape: tuple = (1, 1, 1, 1)
  sandbox_pool: int = 4
  # Share of the devices that serve inference (samplers); the rest form the learner's mesh. With
  # one device (this CPU) both share it. See pipeline/resources.py.
  inference_fraction: float = 1 / 3
  train_tasks: Optional[int] = None    # use only the first N train tasks (None: all)
  heldout_tasks: Optional[int] = None  # evaluate only the first N held-out tasks (None: all)
  # 0: evaluate on the held-out split. > 0: for choosing settings without the held-out split,
  # this share of the train tasks becomes a validation split (experiment/splits.py) that is kept
  # out of pre-training and RL and evaluated instead; the held-out split is then never evaluated.
  validation_fraction: float = 0.0
  suite: str = "pyfunc"
  agent: AgentConfig = AgentConfig()
  # "bytes": moe.tokenizer.ByteTokenizer (the model's vocab_size must be its 259). "bpe": a
  # byte-level BPE of at most `bpe_vocab_size` ids trained on the pre-training corpus
  # (moe.tokenizer.BPETokenizer, saved with the models); the model's vocab_size is set to it.
  tokenizer: str = "bytes"
  bpe_vocab_size: int = 2048
  # A saved model directory (an earlier run's pretrained_model/, say) to start RL from: the
  # tokenizer is the one saved beside it (tokenizer.json, else bytes), its config replaces
  # `model`, and tokenizer training and pre-training are skipped. "": pre-train as configured.
  pretrained_model: str = ""
  # A Hugging Face checkpoint directory (Qwen3-MoE or Mixtral, moe.hf) to start from
  # (experiment/hf_checkpoint.py): its config.json replaces `model`, all but max_seq_len (the
  # run's context, which sizes the samplers' KV caches; weights train in float32); its own
  # tokenizer.json and chat template are the tokenizer (`tokenizer` is ignored, no BPE is
  # trained); its EOS ids (generation_config.json's list) end every sampled completion.
  # Pre-training runs only when configured (continual pre-training of the checkpoint). The
  # final model is also exported as a Hugging Face checkpoint to `hf_export`.
  hf_checkpoint: str = ""
  # Where an hf_checkpoint run exports its final model (moe.hf.save_pretrained: weights,
  # tokenizer files, chat template, generation_config.json). "": <run_dir>/hf_export.
  hf_export: str = ""
  # Tasks from a file instead of the built-in suite: JSONL, a task directory or a directory of
  # them (envs/tasks/task_format.py); each task's `split` ("train" / "test") says whether RL
  # trains on it or evaluation holds it out. `suite` still says how they run: "pyfunc" for
  # single-turn tasks (each with a `prompt`), "repo" for multi-turn repository tasks. A task the
  # loader rejects is an error, not left out. "": the built-in suite.
  task_file: str = ""
  # What RL trains on. "train": the split's train tasks (the ones pre-training's transcripts
  # show). "held_back": a `rl_held_back_fraction` share of the train tasks (by a hash of the
  # id, experiment/splits.py) that pre-training and the tokenizer never see, so no attempt can
  # pass by recalling a transcript it was pre-trained on and RL rewards reading and copying
  # from the context, which every evaluated task needs.
  rl_tasks: str = "train"
  rl_held_back_fraction: float = 0.4
  # RL trains only on the tasks whose `metadata["template"]` is one of these (empty: every
  # task). A template the pre-trained model never solves gives GRPO no signal (every group
  # all-fail) yet costs the samplers whole episodes; leaving it out of RL spends them on
  # tasks that can teach. Evaluation always covers every template.
  rl_templates: tuple = ()
  # Repository suite: RL also trains on up to this many fresh tasks of each RL template
  # (envs.tasks.suite_repo.generate_fresh, seed + 3): the suite's names, but no combination,
  # visible assertion or fix of any suite task (held-out, validation or train), and none in the
  # corpus. With them RL's groups are mostly tasks it meets once, so its gains must be skills
  # that carry to unseen repositories, not recall of a few dozen tasks met again and again.
  # op and rename have few left to draw (their combinations run out), helper and imports many.
  rl_fresh_tasks: int = 0

  def __post_init__(self):
    if self.suite not in SUITES:
      raise ValueError(f"suite must be one of {SUITES}, got {self.suite!r}")
    if self.tokenizer not in TOKENIZERS:
      raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
    if self.suite == "repo":
      window = self.agent.max_context_tokens
      if window + 16 > self.rl.pipeline.seq_len or window > self.model.max_seq_len:
        raise ValueError(f"agent.max_context_tokens ({window}) + 16 must fit "
                         f"rl.pipeline.seq_len ({self.rl.pipeline.seq_len}) and the model's "
                         f"max_seq_len ({self.model.max_seq_len})")
    if self.hf_checkpoint and self.pretrained_model:
      raise ValueError("give at most one of pretrained_model and hf_checkpoint (the model RL "
                       "starts from)")
    if self.hf_export and not self.hf_checkpoint:
      raise ValueError("hf_export needs hf_checkpoint (the architecture and tokenizer an export "
                       "is written in)")
    if self.rl_tasks not in RL_TASKS:
      raise ValueError(f"rl_tasks must be one of {RL_TASKS}, got {self.rl_tasks!r}")
    if isinstance(self.rl_templates, str) or not all(
        isinstance(t, str) and t for t in self.rl_templates):
      raise ValueError(f"rl_templates must be a tuple of template names, got "
                       f"{self.rl_templates!r}")
    if self.rl_fresh_tasks < 0 or (self.rl_fresh_tasks and self.suite != "repo"):
      raise ValueError(f"rl_fresh_tasks must be >= 0, and 0 unless suite is 'repo' (got "
                       f"{self.rl_fresh_tasks} with suite {self.suite!r})")
    if not 0.0 < self.rl_held_back_fraction < 1.0:
      raise ValueError(f"rl_held_back_fraction must lie in (0, 1), got "
                       f"{self.rl_held_back_fraction}")
    if len(self.mesh_shape) != 4 or any(int(s) < 1 for s in self.mesh_shape):
      raise ValueError(f"mesh_shape must be four positive sizes (data, fsdp, expert, tensor), "
                       f"got {self.mesh_shape}")
    if not 0.0 < self.inference_fraction < 1.0:
      raise ValueError(f"inference_fraction must lie in (0, 1), got {self.inference_fraction}")
    if not 0.0 <= self.validation_fraction < 1.0:
      raise ValueError(f"validation_fraction must lie in [0, 1), got {self.validation_fraction}")
    longest = self.rl.pipeline.seq_len
    if longest > self.model.max_seq_len:
      raise ValueError(f"rl.pipeline.seq_len ({longest}) exceeds the model's max_seq_len "
                       f"({self.model.max_seq_len})")
