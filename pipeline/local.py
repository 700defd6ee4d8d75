"""The whole asynchronous RL pipeline in one process: samplers, controller, learner, weight sync.

Every part is the real one, connected through the real transports: trajectories go through
record files on disk (rl.trajectory_io -> pipeline.step_batches), weights through a sync.Publisher
store (file:// kvstore) that each sampler's sync.Subscriber polls and swaps in while serving. The
parts run as threads here (tests, the CPU demo, the benchmark); the same classes run as separate
processes through pipeline.processes (`bazel run //tools:rl_part`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from envs import reward as reward_lib
from envs.harness import agent_loop
from pipeline import controller as controller_lib
from pipeline import grading
from pipeline import samplers as samplers_lib
from pipeline.config import PipelineConfig
from pipeline.learner_loop import LearnerLoop
from pipeline.step_batches import StepBatcher
from moe import checkpoint as moe_checkpoint
from moe.tokenizer import ByteTokenizer
from rl import trajectory_io
from rl.episodes import ValidationSpec
from rollout.engine import EngineConfig, EngineStopped
from sync import publisher as publisher_lib
from sync import store as store_lib
from sync import subscriber as subscriber_lib

log = logging.getLogger(__name__)


class WeightChannel:
  """Learner -> samplers: a sync.Publisher over a store; checks version numbers line up."""

  def __init__(self, url: str, *, snapshot_every: int = 20, model_cfg=None):
    self.store = store_lib.Store(url)
    self.model_info = {} if model_cfg is None else {
        "model_config": moe_checkpoint.config_to_json(model_cfg)}
    # answer_requests_s: a sampler stuck behind a damaged delta asks for a snapshot; the learner
    # may be idle (waiting for that sampler's data), so a thread answers (sync.publisher).
    self.publisher = publisher_lib.Publisher(self.store, snapshot_every=snapshot_every,
                                             answer_requests_s=0.5)
    self.reports = []

  @staticmethod
  def weights_of(learner):
    """What `publish` takes: the learner's whole flat weights and its policy version."""
    return learner.sampler_weights()

  def latest(self) -> Optional[int]:
    return self.publisher.version

  def hold(self, flat: dict) -> None:
    """Offers the learner's weights at the newest published version to a publisher that could
    not rebuild them on restart (a damaged delta in the chain), so it can answer samplers'
    snapshot requests and publish deltas again (sync.publisher.Publisher.hold)."""
    if self.publisher.holds_latest:
      return
    if self.publisher.hold(flat):
      log.warning("weight sync: the restarted learner's weights at version %d now back the "
                  "publisher (it could not rebuild them from the store)", self.publisher.version)

  def publish(self, flat: dict, version: int):
    expect = 0 if self.publisher.version is None else self.publisher.version + 1
    if version != expect:
      raise RuntimeError(f"learner version {version} does not follow the published "
                         f"{self.publisher.version}")
    report = self.publisher.publish(flat, {"learner_version": int(version), **self.model_info})
    self.reports.append(report)
    return report


def check_capacity(tasks: Sequence, config: PipelineConfig, tokenizer=None,
                   loop_config: Optional[agent_loop.LoopConfig] = None) -> None:
  """Raises ValueError unless a step's episodes surely fit its [batch_rows, seq_len] batch.

  Multi-turn tasks (no single-turn prompt) train one sequence per context segment, each at most
  the agent loop's context window (plus the closing template tokens), so seq_len must hold one;
  how many segments an episode has depends on the model, so a step that overflows its rows
  drops whole episodes and counts them (StepStats.overflow_episodes) rather than failing here.
  """
  tok = tokenizer or ByteTokenizer()
  if any(not t.prompt for t in tasks):
    window = (loop_config or agent_loop.LoopConfig()).max_context_tokens + _CLOSING_TOKENS
    if window > config.seq_len:
      raise ValueError(f"multi-turn episodes train context segments of up to {window} tokens "
                       f"(the agent loop's max_context_tokens + {_CLOSING_TOKENS}) but seq_len "
                       f"is {config.seq_len}")
    tasks = [t for t in tasks if t.prompt]
    if not tasks:
      return
  longest = 1 + max(len(tok.encode(t.prompt)) for t in tasks) + config.max_new_tokens
  if longest > config.seq_len:
    raise ValueError(f"an episode can take {longest} tokens (prompt + max_new_tokens) but "
                     f"seq_len is {config.seq_len}")
  per_row = config.seq_len // longest
  need = -(-config.episodes_per_step // per_row)
  if config.batch_rows < need:
    raise ValueError(f"{config.episodes_per_step} episodes of up to {longest} tokens need "
                     f"{need} rows of {config.seq_len}; batch_rows is {config.batch_rows}")


# Template tokens the agent loop may add after the last completion of a segment ("<|im_end|>\n").
_CLOSING_TOKENS = 16


def swap_into(engine):
  """The subscriber's apply_fn: a stopped (dead) sampler has nothing left to update."""
  def apply(flat, version):
    try:
      engine.swap_weights(flat, version)
    except EngineStopped:
      log.info("sampler stopped; weight update %d not applied", version)
  return apply


def group_sink(writer):
  """The controller's sink: a group's episodes become visible to the learner as one shard.

  Safe to call again with the same episodes after it raised (the controller retries failed
  writes): episodes already handed to the writer stay in its buffer (TrajectoryWriter.write
  buffers before it flushes, and a failed flush keeps the buffer), so a retry hands over only
  the rest and flushes, and no record is written twice.
  """
  pending = {"episodes": None, "handed": 0}

  def sink(episodes):
    if pending["episodes"] is not episodes:
      pending.update(episodes=episodes, handed=0)
    while pending["handed"] < len(episodes):
      pending["handed"] += 1
      writer.write(episodes[pending["handed"] - 1])
    writer.flush()
    pending.update(episodes=None, handed=0)
  return sink


@dataclasses.dataclass
class RunResult:
  """What a pipeline run did."""
  wall_s: float
  steps: int
  groups: int
  learner_wait_s: float
  learner_train_s: float
  learner_publish_s: float
  controller_wait_s: float
  sampler_retries: int
  swaps: list
  batcher: dict
  learner_restarts: int
  learner: object  # the learner at the end (a restarted one after a crash)
  controller: dict = dataclasses.field(default_factory=dict)  # RolloutController.summary()
  samplers: dict = dataclasses.field(default_factory=dict)  # the engines' summed counters
  grading: dict = dataclasses.field(default_factory=dict)  # grading.Sandboxes.summary()


def run(*, learner, tasks: Sequence, pool, workdir: str, config: PipelineConfig, num_steps: int,
        num_samplers: int = 1, sampler_replicas: int = 1, sampler_expert: int = 1,
        sampler_tensor: int = 1,
        engine_config: EngineConfig = EngineConfig(),
        reward_config=reward_lib.RewardConfig(), include_routing: bool = True,
        checkpoints=None, checkpoint_every: int = 0,
        on_step: Optional[Callable] = None, on_group: Optional[Callable] = None,
        grade_fn: Optional[Callable] = None, sync_interval_s: float = 0.02,
        stop: Optional[threading.Event] = None,
        after_start: Optional[Callable[[dict], None]] = None,
        learner_factory: Optional[Callable[[], object]] = None,
        loop_config: agent_loop.LoopConfig = agent_loop.LoopConfig(), tokenizer=None,
        max_learner_restarts: int = 3) -> RunResult:
  """Runs `num_steps` learner steps of asynchronous RL (max staleness config.max_staleness).

  Args:
    learner: an rl.learner.Learner with objective "policy" (its policy is the starting policy).
    tasks: the tasks (envs.tasks.task_format.Task): single-turn ones and multi-turn repository
      tasks alike (every attempt runs through envs.harness.attempts).
    pool: envs WarmPool for the agent's tools and, with config.grader "local", grading
      (pipeline/grading.py; "ray" grades in a Ray sandbox fleet, closed when the run ends).
    workdir: trajectories, weights and checkpoints go under it.
    config: PipelineConfig.
    num_steps: learner steps to run (counted from the learner's current step).
    num_samplers: in-process samplers.
    sampler_replicas: data-parallel engines per sampler, each on its own device
      (`pipeline.samplers.build_engines`; needs num_samplers x sampler_replicas devices).
    sampler_expert, sampler_tensor: each engine sharded over that many devices (expert and
      tensor parallel, `rollout.placement`); multiplies the devices needed.
    engine_config: their settings.
    checkpoints / checkpoint_every: learner checkpointing (restored first if one exists).
    on_step(step, metrics, info) / on_group(GroupResult): progress callbacks.
    grade_fn: override grading (fault-injection tests).
    after_start: called with {"engines", "samplers", "controller", "learner_loop", "stop",
      "sandboxes"} once
      everything is built, before the controller starts (tests use it to inject faults).
    learner_factory: builds a fresh learner after the learner loop dies; the new one restores the
      latest checkpoint and the pipeline carries on (samplers and controller keep running).
    loop_config: the agent loop's settings for multi-turn tasks.
    tokenizer: the model's tokenizer (moe.tokenizer; default: bytes), for the controller's
      prompts and the engines' stop strings.

  Raises:
    ValueError: the learner's staleness bound is not config.max_staleness (the run's one bound;
      rl.learner.build_learner(..., max_staleness=config.max_staleness) sets it).
  """
  t_start = time.perf_counter()
  if learner.loss_cfg.max_staleness != config.max_staleness:
    raise ValueError(f"the learner's staleness bound ({learner.loss_cfg.max_staleness}) is not "
                     f"the pipeline's (PipelineConfig.max_staleness = {config.max_staleness}); "
                     "build it with rl.learner.build_learner(..., max_staleness=...)")
  tokenizer = tokenizer or ByteTokenizer()
  check_capacity(tasks, config, tokenizer, loop_config=loop_config)
  stop = stop or threading.Event()
  os.makedirs(workdir, exist_ok=True)
  traj_dir = os.path.join(workdir, "trajectories")
  cfg = learner.model_cfg
  channel = WeightChannel("file://" + os.path.join(os.path.abspath(workdir), "weights"),
                          model_cfg=cfg)
  spec = ValidationSpec(vocab_size=cfg.vocab_size, max_len=config.seq_len,
                        routing_shape=(cfg.num_moe_layers, cfg.num_experts_per_tok),
                        num_experts=cfg.num_experts, require_routing=include_routing)
  def make_loop(learner):
    batcher = StepBatcher(traj_dir, config=config, spec=spec, include_routing=include_routing)
    return LearnerLoop(learner, batcher, publish=channel.publish,
                       published_version=channel.latest, weights_of=channel.weights_of,
                       hold=channel.hold,
                       checkpoints=checkpoints,
                       checkpoint_every=checkpoint_every, on_step=on_step)

  loop = make_loop(learner)
  loop.restore()
  if channel.latest() is None:
    loop.publish_current()
  target = learner.step + num_steps

  # Samplers start from the newest published weights and follow the channel.
  flat0, v0 = publisher_lib.restore(channel.store)
  engines, subscribers, threads = [], [], []
  for i, eng in enumerate(samplers_lib.build_engines(
      flat0, cfg, count=num_samplers, replicas=sampler_replicas, expert=sampler_expert,
      tensor=sampler_tensor, config=engine_config,
      version=v0, tokenizer=tokenizer)):
    sub = subscriber_lib.Subscriber(channel.store, swap_into(eng))
    sub.adopt(flat0, v0, publisher_lib.read_manifest(channel.store, v0).digest)
    engines.append(eng)
    subscribers.append(sub)
    t = threading.Thread(target=sub.run, args=(stop, sync_interval_s), daemon=True,
                         name=f"subscriber-{i}")
    threads.append(t)
  sampler_set = samplers_lib.SamplerSet(
      [samplers_lib.EngineSampler(e, f"sampler-{i}") for i, e in enumerate(engines)],
      max_attempts=config.max_request_attempts)

  done_groups = learner.step * config.prompts_per_step
  writer = trajectory_io.TrajectoryWriter(traj_dir, f"controller-{int(time.time() * 1e3)}",
                                          records_per_shard=config.attempts)

  # The agent's tools run in `pool`; grading too, or in a Ray fleet (config.grader).
  sandboxes = grading.open_sandboxes(config, pool=pool)
  controller = controller_lib.RolloutController(
      tasks, sampler_set, sandboxes.pool, group_sink(writer), config=config,
      reward_config=reward_config, on_group=on_group, grade_fn=grade_fn or sandboxes.grade_fn,
      loop_config=loop_config, tokenizer=tokenizer)
  controller.groups_written = done_groups
  errors: list = []

  def run_controller():
    try:
      controller.run(target, stop)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
      stop.set()

  ct = threading.Thread(target=run_controller, daemon=True, name="controller")
  if after_start is not None:
    after_start({"engines": engines, "samplers": sampler_set, "controller": controller,
                 "learner_loop": loop, "stop": stop, "sandboxes": sandboxes})
  for t in threads:
    t.start()
  ct.start()
  restarts = 0
  waits = [0.0, 0.0, 0.0]
  try:
    while True:
      try:
        loop.run(target, stop)
        break
      except Exception as e:  # pylint: disable=broad-except
        if learner_factory is None or restarts >= max_learner_restarts or stop.is_set():
          raise
        restarts += 1
        log.warning("learner died (%s); restarting from the last checkpoint", e)
        waits = [w + x for w, x in zip(waits, (loop.wait_s, loop.train_s, loop.publish_s))]
        if checkpoints is not None:
          checkpoints.wait()
        learner = learner_factory()
        loop = make_loop(learner)
        loop.restore()
  finally:
    stop.set()
    ct.join(timeout=60)
    for t in threads:
      t.join(timeout=10)
    sampler_counts = sampler_totals(engines)
    for e in engines:
      e.stop()
    writer.close()
    if checkpoints is not None:
      checkpoints.wait()
    grading_summary = sandboxes.summary()
    sandboxes.close()
  if errors:
    raise RuntimeError("the rollout controller failed") from errors[0]
  swaps = [dataclasses.asdict(r) for s in subscribers for r in s.reports]
  waits = [w + x for w, x in zip(waits, (loop.wait_s, loop.train_s, loop.publish_s))]
  return RunResult(
      wall_s=time.perf_counter() - t_start, steps=learner.step, groups=controller.groups_written,
      learner_wait_s=waits[0], learner_train_s=waits[1], learner_publish_s=waits[2],
      controller_wait_s=controller.wait_s, sampler_retries=sampler_set.retries, swaps=swaps,
      batcher=dataclasses.asdict(loop.batcher.stats), learner_restarts=restarts,
      learner=learner, controller=controller.summary(), samplers=sampler_counts,
      grading=grading_summary)


def sampler_totals(engines) -> dict:
  """The engines' counters summed (`Engine.metrics()` totals; gauges left out), with the prefix
  cache's hit rate over all of them: prompt tokens served from the cache / tokens looked up."""
  out: dict = {}
  for e in engines:
    for k, v in e.metrics().items():
      if k.endswith("_total") and isinstance(v, (int, float)):
        out[k] = out.get(k, 0) + v
  looked = out.get("prefix_cache_lookup_tokens_total", 0)
  out["prefix_cache_hit_rate"] = (out.get("prefix_cache_hit_tokens_total", 0) / looked
                                  if looked else 0.0)
  return out
