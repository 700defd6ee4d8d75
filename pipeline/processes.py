"""The pipeline's parts as separate processes: learner, sampler, controller and weight relay.

Each `run_*` function below is the body of one part of the `//tools:rl_part` binary
(`bazel run //tools:rl_part -- learner|sampler|controller|relay ... [--tokenizer=DIR]`). They
meet through a shared work directory:
  <workdir>/trajectories/   record files (controller writes, learner reads)
  <workdir>/weights/        the sync store (learner publishes, samplers subscribe)
  <workdir>/checkpoints/    the learner's checkpoints (train state + reader position)
and the controller reaches the samplers over HTTP (their OpenAI-compatible API). Samplers read
the weights from the store, or through relays (`run_relay`: a cluster's samplers pull through
its relay, which moves each version from its parent once). Any part can be killed and
restarted: the learner restores its checkpoint, a sampler reloads the newest published weights,
the controller resumes after the last group it wrote, and a relay's samplers hold their version
until it is back (or read through the next relay they were given).

The learner may itself be several processes (`jax.distributed`, one per host; `rl_part learner
--num_processes=N --process_id=I --coordinator=HOST:PORT`) training one model on one mesh: they
read the same records, checkpoint together and each publishes the weight blocks it holds; the
samplers follow that sharded store (`run_learner`, pipeline/sharded_weights.py).

Every part speaks the model's tokenizer (`tokenizer_dir`: a directory holding tokenizer.json, as
a model directory the experiment wrote does; none means bytes). Parts that disagree would encode
prompts in one vocabulary for a model of another, which samples garbage without any error, so
the learner publishes its tokenizer's identity (`tokenizer_info`) with every version of the
weights and a sampler (or a controller, once weights are published) refuses to start on
another one (`TokenizerError`), as it does on a tokenizer larger than the model's vocabulary.

A model started from a Hugging Face checkpoint (a Qwen3 chat model, say) ends its turns at a
token that is not its tokenizer's EOS, and speaks its own chat template. Each part reads both
from the same directory, as the in-process run decides them: the sampler's engine stops at the
directory's EOS list (`eos_token_ids`: generation_config.json, which such a checkpoint and the
model directories of a run started from one hold), and the controller writes agent episodes in
the tokenizer's chat template (envs.harness.agent_loop.chat_for), each turn ending at the end of
turn among those ids. The chat turns are rebuilt in the controller's process from the directory,
never sent to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from moe.config import ModelConfig
from moe.tokenizer import TokenizerError
from pipeline.config import PipelineConfig

if TYPE_CHECKING:
  from rl.learner import LearnerConfig

log = logging.getLogger(__name__)


def paths(workdir: str) -> dict:
  w = os.path.abspath(workdir)
  return {"trajectories": os.path.join(w, "trajectories"),
          "weights": "file://" + os.path.join(w, "weights"),
          "checkpoints": os.path.join(w, "checkpoints")}


STEP_LINE = "learner step "


# The published version's figures a step's metrics carry (pipeline.learner_loop.publish_metrics).
_PUBLISH_KEYS = ("publish_bytes", "publish_raw_bytes", "publish_ratio", "publish_delta",
                 "publish_snapshot", "publish_s")


def step_line(step: int, metrics: dict, info: dict) -> str:
  """The learner's log line per step: `learner step N {json}`, the figures that show the step
  trained (episodes and tokens in its batch, loss and gradient norm, policy version), its data's
  staleness, its groups without signal (zero-variance, and how many were filtered out), its
  attempts flagged for reward hacking, and the version it published: the bytes a sampler
  fetches for it, its raw bytes in the sampler's dtype and their ratio (absent on a replayed
  step, which publishes nothing)."""
  publish = {k: metrics[k] for k in _PUBLISH_KEYS if k in metrics}
  return STEP_LINE + f"{step} " + json.dumps({**publish, 
      "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
      "tokens": float(metrics["tokens"]),
      "trained_episodes": int(info["trained_episodes"]), "episodes": int(info["episodes"]),
      "policy_version": int(metrics["policy_version"]), "max_lag": int(info["max_lag"]),
      "stale_episodes": int(info["stale_episodes"]), "lost_episodes": int(info["lost_episodes"]),
      "zero_variance_groups": int(info["zero_variance_groups"]),
      "zero_variance_filtered": int(info["zero_variance_filtered"]),
      "hack_flagged": int(info["hack_flagged"]),
      "replayed": bool(info.get("replayed", False))})


SUMMARY_LINE = "learner summary "


def summary_line(stats, step: int, publish: Optional[dict] = None) -> str:
  """The learner's last line, `learner summary {json}`: where it ended, what became of every
  record it read (pipeline.step_batches.StepStats): trained, dropped as stale, rejected,
  infrastructure failures, dropped for lack of room, and lost (missing shards), and what it
  published (`publish`: pipeline.learner_loop.LearnerLoop.publish_totals, the versions and, over
  those published as deltas, the bytes samplers fetched, the raw sampler-dtype bytes and their
  ratio)."""
  return SUMMARY_LINE + json.dumps({**(publish or {}), 
      "step": int(step), "episodes": stats.episodes, "trained_episodes": stats.trained_episodes,
      "stale_episodes": stats.stale_episodes, "infra_failures": stats.infra_failures,
      "rejected_episodes": sum(stats.rejections.values()),
      "overflow_episodes": stats.overflow_episodes, "lost_episodes": stats.lost_episodes,
      "lost_shards": list(stats.lost_shards)})


def parse_summary(text: str) -> dict:
  """The `summary_line` record in a learner's output; raises ValueError if there is none."""
  for line in reversed(text.splitlines()):
    if line.startswith(SUMMARY_LINE):
      return json.loads(line[len(SUMMARY_LINE):])
  raise ValueError("the learner's output has no summary line")


def parse_step_lines(text: str) -> list[dict]:
  """The per-step records in a learner's output (`step_line` lines), in order, with `step`."""
  out = []
  for line in text.splitlines():
    if line.startswith(STEP_LINE):
      step, record = line[len(STEP_LINE):].split(" ", 1)
      out.append(dict(json.loads(record), step=int(step)))
  return out


def load_tokenizer(tokenizer_dir: Optional[str], vocab_size: Optional[int] = None):
  """The tokenizer saved in `tokenizer_dir` (a directory holding tokenizer.json), or the byte
  tokenizer when `tokenizer_dir` is None.

  Read as a model directory is (`moe.tokenizer.for_model`): the project's BPE, or a checkpoint's
  tokenizer with the roles of its tokenizer_config.json and its chat template. `vocab_size`: the
  model's ids once a part knows them (the published model config), so ids its embedding has past
  the tokenizer's (Qwen's) decode to nothing; None: the tokenizer's own.

  A named directory without tokenizer.json raises TokenizerError rather than falling back to
  bytes: the caller asked for a trained tokenizer, and bytes in its
  place would be the wrong vocabulary for the model, silently.
  """
  from moe import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  if tokenizer_dir is None:
    return tokenizer_lib.ByteTokenizer()
  path = os.path.join(tokenizer_dir, tokenizer_lib.TOKENIZER_FILE)
  if not os.path.isfile(path):
    raise TokenizerError(f"no {tokenizer_lib.TOKENIZER_FILE} in the tokenizer directory "
                         f"{tokenizer_dir} (expected {path}); name the directory a model was "
                         "saved in with its tokenizer, or leave the tokenizer out for bytes")
  return tokenizer_lib.for_model(tokenizer_dir, vocab_size)


def eos_token_ids(tokenizer_dir: Optional[str], tok) -> tuple:
  """The ids that end every completion of the model: the EOS list saved in `tokenizer_dir`
  (generation_config.json's, else config.json's: `moe.hf.eos_token_ids`; a chat checkpoint's
  names its end of turn, e.g. Qwen3's <|im_end|>, besides <|endoftext|>), else `tok`'s EOS, as
  the in-process run takes them (experiment.hf_checkpoint.load)."""
  from moe import hf  # pylint: disable=g-import-not-at-top
  listed = tuple(hf.eos_token_ids(tokenizer_dir)) if tokenizer_dir else ()
  return listed or ((tok.eos_id,) if tok.eos_id is not None else ())


def tokenizer_info(tok) -> dict:
  """What names `tok` in the published weights' manifests: its kind, its number of ids and a
  digest of its vocabulary (every id's text), so two copies of one tokenizer.json match and
  different tokenizers of one size do not."""
  texts = [tok.decode([i], skip_special=False) for i in range(tok.vocab_size)]
  digest = hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16]
  return {"kind": type(tok).__name__, "vocab_size": int(tok.vocab_size), "digest": digest}


def check_tokenizer(tok, model_cfg: ModelConfig, published: Optional[dict] = None, *,
                    part: str, tokenizer_dir: Optional[str] = None) -> None:
  """Raises TokenizerError unless `tok` fits `model_cfg`'s vocabulary and (when given) is the
  tokenizer `published` in the weights' manifest (`tokenizer_info` of the learner's)."""
  name = tokenizer_dir or "bytes (no tokenizer named)"
  if tok.vocab_size > model_cfg.vocab_size:
    raise TokenizerError(f"{part}: the tokenizer ({name}) has {tok.vocab_size} ids but the "
                         f"model's vocab_size is {model_cfg.vocab_size}; give the model's own "
                         "tokenizer (the directory its tokenizer.json was saved in)")
  mine = tokenizer_info(tok)
  if published is not None and published != mine:
    raise TokenizerError(f"{part}: the learner publishes weights for the tokenizer "
                         f"{_describe(published)} but this part's ({name}) is {_describe(mine)}; "
                         "start every part with the learner's tokenizer (rl_part --tokenizer=DIR)")


def _describe(info: dict) -> str:
  return (f"{info.get('kind')} of {info.get('vocab_size')} ids "
          f"(vocabulary digest {info.get('digest')})")


def run_learner(workdir: str, model_cfg: ModelConfig, config: PipelineConfig,
                learner_config: LearnerConfig, *, steps: int,
                init_checkpoint: Optional[str] = None, checkpoint_every: int = 1,
                seed: int = 0, missing_timeout_s: float = 30.0,
                tokenizer_dir: Optional[str] = None,
                mesh_shape: Sequence[int] = (1, 1, 1, 1)) -> int:
  """Trains until `steps` learner steps are done; returns the final step.

  The learner's mesh is `mesh_shape` (data, fsdp, expert, tensor) over `jax.devices()`: this
  process's devices, or, in a learner of several processes (`rl.distributed.initialize` first,
  as `rl_part learner --num_processes=N` does), every process's. Each process then runs this
  same function: each reads every step's records from the work directory and passes the same
  global batch (the learner checks that they agree), they save and restore one checkpoint
  together, and each publishes the weight blocks it holds
  (pipeline.sharded_weights.ShardedWeightChannel; samplers follow the sharded store). One
  process publishes whole versions (pipeline.local.WeightChannel). A work directory's store
  holds one kind: restarting with another number of processes over it is refused.

  `tokenizer_dir`: where the model's tokenizer.json is (`load_tokenizer`); by default the one
  saved beside `init_checkpoint` if there is one, else bytes. It must fit the model's
  vocabulary, and its `tokenizer_info` goes into every published manifest, where samplers and
  controllers check theirs against it (TokenizerError).

  Its output: one `step_line` per step (replayed ones after a restart marked) and a closing
  `summary_line`, also when it stops with an error (an empty step, a version mismatch). A
  missing trajectory shard is waited for `missing_timeout_s`, then counted as lost.

  The learner is `rl.learner.build_learner(learner_config, ...)` with the pipeline's staleness
  bound, the same call as the in-process experiment's (experiment.run.make_rl_learner), so a
  setting means the same in both.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from moe import checkpoint as moe_checkpoint  # pylint: disable=g-import-not-at-top
  from moe import sharding  # pylint: disable=g-import-not-at-top
  from pipeline.learner_loop import LearnerLoop  # pylint: disable=g-import-not-at-top
  from pipeline.step_batches import StepBatcher  # pylint: disable=g-import-not-at-top
  from rl.checkpointing import CheckpointManager  # pylint: disable=g-import-not-at-top
  from rl import learner as learner_lib  # pylint: disable=g-import-not-at-top
  from rl.episodes import ValidationSpec  # pylint: disable=g-import-not-at-top
  from moe import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  p = paths(workdir)
  if init_checkpoint:
    model_cfg = moe_checkpoint.load_config(init_checkpoint)
  if tokenizer_dir is not None:
    tok = load_tokenizer(tokenizer_dir)
  elif init_checkpoint:  # the one saved with the model; bytes only for a byte vocabulary
    try:
      tok = tokenizer_lib.for_model(init_checkpoint, model_cfg.vocab_size)
    except TokenizerError as e:
      raise TokenizerError(f"learner: {e}") from None
    if isinstance(tok, tokenizer_lib.JsonTokenizer):
      tokenizer_dir = init_checkpoint
  else:
    tok = tokenizer_lib.ByteTokenizer()
  check_tokenizer(tok, model_cfg, part="learner", tokenizer_dir=tokenizer_dir)
  mesh = sharding.make_mesh(mesh_shape, jax.devices())
  # Restored straight onto the mesh: a process of a multi-process learner cannot hold, let
  # alone place, arrays on the other processes' devices.
  init = moe_checkpoint.load_model(init_checkpoint, mesh=mesh) if init_checkpoint else None
  learner = learner_lib.build_learner(learner_config, model_cfg, mesh=mesh, seed=seed,
                                      init_model=init, max_staleness=config.max_staleness)
  spec = ValidationSpec(vocab_size=model_cfg.vocab_size, max_len=config.seq_len,
                        routing_shape=(model_cfg.num_moe_layers, model_cfg.num_experts_per_tok),
                        num_experts=model_cfg.num_experts, require_routing=True)
  channel, hold = _weight_channel(p["weights"], model_cfg)
  channel.model_info["tokenizer"] = tokenizer_info(tok)
  ckpt = CheckpointManager(p["checkpoints"], max_to_keep=2)
  batcher = StepBatcher(p["trajectories"], config=config, spec=spec,
                        missing_timeout_s=missing_timeout_s)
  loop = LearnerLoop(learner, batcher,
                     publish=channel.publish, published_version=channel.latest,
                     weights_of=channel.weights_of, hold=hold, checkpoints=ckpt,
                     checkpoint_every=checkpoint_every,
                     on_step=lambda s, m, i: print(step_line(s, m, i), flush=True))
  if jax.process_count() > 1:
    print(f"learner process {jax.process_index()} of {jax.process_count()}, mesh "
          f"{dict(mesh.shape)} over {jax.device_count()} devices "
          f"({jax.local_device_count()} here)", flush=True)
  if loop.restore():
    print(f"learner restored at step {learner.step}", flush=True)
  try:
    loop.run(steps)
  finally:
    ckpt.wait()
    ckpt.close()
    print(summary_line(loop.batcher.stats, learner.step, loop.publish_totals()), flush=True)
  return learner.step


def _weight_channel(url: str, model_cfg: ModelConfig):
  """(channel, hold) of this learner process: the sharded channel in a learner of several
  processes (every process publishes its blocks; no hold: no process has the whole weights to
  offer), else the plain one with its hold (pipeline.local.WeightChannel.hold)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from pipeline import sharded_weights  # pylint: disable=g-import-not-at-top
  from pipeline.local import WeightChannel  # pylint: disable=g-import-not-at-top
  if jax.process_count() > 1:
    channel = sharded_weights.ShardedWeightChannel(
        url, part=jax.process_index(), parts=jax.process_count(), model_cfg=model_cfg,
        barrier=lambda: multihost_utils.sync_global_devices("sharded weights published"))
    return channel, None
  channel = WeightChannel(url, model_cfg=model_cfg)
  sharded_weights.check_kind(channel.store, sharded=False)
  return channel, channel.hold


def wait_for_weights(source, timeout_s: float = 600.0, name: Optional[str] = None):
  """(source, subscriber) once the learner has published anything; the subscriber (named `name`)
  holds the newest version it could restore, in `.weights` and `.version`.

  `source`: the weight store's URL (`paths(workdir)["weights"]`, read directly), or anything with
  `.get(key)`, such as a sync.transport.HttpSource over relays (`weight_source`). A source that
  cannot be read yet (a relay not up) is retried like a store with nothing published.

  Restarted across a damaged delta, that is the newest version reachable around it (a newer
  snapshot, or the last version before the damage): sync.subscriber.Subscriber.restore says so
  (WARNING) and asks the learner for a snapshot, and the subscriber's polls then move on. A
  restore that fails (nothing reachable yet) is retried until `timeout_s`.

  The subscriber readies the delta kernels as it is made, before the wait (from the on-disk
  kernel cache, sync.delta.jit), so a sampler's first delta costs what later ones do.

  A sharded store (a learner of several processes publishes each version as blocks,
  pipeline.sharded_weights) gives a pipeline.sharded_weights.ShardedFollower instead, with the
  same `.weights`, `.version`, `.apply_fn`, `run` and `health_problem`: it moves every block to
  the newest version and assembles whole tensors.
  """
  from pipeline import sharded_weights  # pylint: disable=g-import-not-at-top
  from sync import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  from sync import store as store_lib  # pylint: disable=g-import-not-at-top
  from sync import subscriber as subscriber_lib  # pylint: disable=g-import-not-at-top
  from sync import transport  # pylint: disable=g-import-not-at-top
  store = store_lib.Store(source) if isinstance(source, str) else source
  sub = subscriber_lib.Subscriber(store, None, name=name)
  t0 = time.monotonic()
  failed = None
  while True:
    try:
      version, sharded = sharded_weights.published(store)
      if version is not None and sharded:
        follower = sharded_weights.ShardedFollower(store, name=name)
        follower.poll()
        return store, follower
      if version is not None:
        sub.restore()
        return store, sub
    except (subscriber_lib.SyncError, manifest_lib.ManifestError, transport.HttpError,
            OSError) as e:
      if str(e) != failed:
        log.warning("no published weights can be restored yet (%s); retrying", e)
        failed = str(e)
    if time.monotonic() - t0 > timeout_s:
      raise TimeoutError(f"no weights could be restored from {source} in {timeout_s}s"
                         + (f" (last: {failed})" if failed else ""))
    time.sleep(0.2)


def weight_source(workdir: str, weight_urls: Optional[Sequence[str]] = None,
                  resolve_weight_urls: Optional[Callable[[], Sequence[str]]] = None):
  """Where a sampler reads the published weights: the work directory's store, or with
  `weight_urls` the relays at those URLs (sync.transport.HttpSource: tried in order per
  request, a broken transfer resumed on the next), e.g. its cluster's relay, then the origin
  relay to fail over to.

  `resolve_weight_urls`: for relays named rather than addressed (`@relay_1,@relay_0` under a
  launcher, which may place a relay again elsewhere): their URLs now, asked again when none
  answers, so the sampler follows a relay that came back at another address."""
  if not weight_urls:
    return paths(workdir)["weights"]
  from sync import transport  # pylint: disable=g-import-not-at-top
  return transport.HttpSource(list(weight_urls), timeout_s=10.0, attempts=2,
                              resolve=resolve_weight_urls)


def run_relay(workdir: str, *, port: int, upstream: Optional[Sequence[str]] = None,
              cache_bytes: int = 8 << 30, stop: Optional[threading.Event] = None,
              host: str = "127.0.0.1",
              resolve_upstream: Optional[Callable[[], Sequence[str]]] = None) -> None:
  """Serves the published weights to samplers over HTTP (sync.relay; blocking until `stop`).

  Without `upstream` it reads the work directory's store itself (an origin relay, beside the
  learner, or a cluster relay on a shared filesystem); with `upstream` (URLs of a parent
  relay, tried in order) it is a cluster relay that moves each object over the link from its
  parent once and serves its cluster's samplers (`run_sampler(weight_urls=...)`). A relay holds
  no state a sampler needs to be correct: killed, its samplers keep serving the version they
  hold (their /health says weight sync is failing) and catch up when it is back, or read
  through the next URL they were given meanwhile. `resolve_upstream`: the parents' URLs now,
  for parents named rather than addressed (see `weight_source`).
  """
  from sync import relay as relay_lib  # pylint: disable=g-import-not-at-top
  from sync import store as store_lib  # pylint: disable=g-import-not-at-top
  up = list(upstream) if upstream else store_lib.Store(paths(workdir)["weights"])
  server = relay_lib.RelayServer(
      relay_lib.Relay(up, cache_bytes=cache_bytes,
                      resolve_upstream=resolve_upstream if upstream else None),
      host=host, port=port)
  url = server.start()
  print(f"relay serving {'relays ' + ', '.join(up) if upstream else 'the weight store'} on "
        f"{url}", flush=True)
  try:
    (stop or threading.Event()).wait()
  finally:
    server.stop()


def run_sampler(workdir: str, *, port: int, max_slots: int = 64, max_len: int = 256,
                sync_interval_s: float = 0.05, stale_versions: int = 2,
                stale_s: float = 60.0, tokenizer_dir: Optional[str] = None,
                weight_urls: Optional[Sequence[str]] = None, host: str = "127.0.0.1",
                replicas: int = 1, expert: int = 1, tensor: int = 1,
                resolve_weight_urls: Optional[Callable[[], Sequence[str]]] = None) -> None:
  """Serves the newest published weights over HTTP on `host`:`port` and follows new versions
  (blocking). `host`: the address to bind, the one peers reach it at (a cluster node's own
  address when the controller runs on another node).

  `replicas`, `expert`, `tensor`: the engine's layout over this process's devices, as the
  in-process samplers' (`pipeline.samplers.build_engines`: data-parallel replicas behind the
  one server, each sharded over expert x tensor devices); the weights it follows reach every
  replica at one version.

  It starts on the newest version it can restore (`wait_for_weights`: around a damaged delta,
  asking the learner for a snapshot) and follows from there, reading the weights from the work
  directory's store, or with `weight_urls` through the relays at those URLs (`weight_source`,
  `run_relay`; relays found by name are followed when they move: `resolve_weight_urls`).

  `tokenizer_dir`: the model's tokenizer (`load_tokenizer`; None: bytes), the engine's for stop
  strings and text prompts; the directory's EOS list (`eos_token_ids`; else the tokenizer's
  EOS) ends every completion. It is checked before serving against the model config and
  tokenizer the published manifest names (`check_tokenizer`): a mismatch raises TokenizerError
  naming both.

  `/health` answers 503 (naming the problem) when the weight-sync thread died or the served
  weights have been more than `stale_versions` behind the published ones for over `stale_s`
  seconds (sync.subscriber.Subscriber.health_problem).

  The weights of a learner of several processes come as a sharded store (each process
  publishes its blocks): the sampler then follows it block by block and serves whole tensors
  (`wait_for_weights`, pipeline.sharded_weights.ShardedFollower), with the same health checks.
  """
  from pipeline import sharded_weights  # pylint: disable=g-import-not-at-top
  from pipeline.local import swap_into  # pylint: disable=g-import-not-at-top
  from pipeline import samplers  # pylint: disable=g-import-not-at-top
  from rollout import server  # pylint: disable=g-import-not-at-top
  from rollout.engine import EngineConfig  # pylint: disable=g-import-not-at-top
  tok = load_tokenizer(tokenizer_dir)  # a missing file fails before the wait for weights
  store, sub = wait_for_weights(weight_source(workdir, weight_urls, resolve_weight_urls),
                                name=f"sampler-{port}")
  cfg, info = _model_config_of(store, sub.version,
                               sharded=isinstance(sub, sharded_weights.ShardedFollower))
  check_tokenizer(tok, cfg, info.get("tokenizer"), part="sampler", tokenizer_dir=tokenizer_dir)
  tok = load_tokenizer(tokenizer_dir, cfg.vocab_size)  # now with the model's ids
  ec = EngineConfig(max_slots=max_slots, max_len=max_len,
                    eos_token_ids=eos_token_ids(tokenizer_dir, tok))
  (engine,) = samplers.build_engines(sub.weights, cfg, replicas=replicas, expert=expert,
                                     tensor=tensor, config=ec, tokenizer=tok,
                                     version=sub.version)
  sub.apply_fn = swap_into(engine)
  stop = threading.Event()
  threading.Thread(target=sub.run, args=(stop, sync_interval_s), daemon=True,
                   name="weight-sync").start()

  def weight_sync():
    return sub.health_problem(max_behind_versions=stale_versions, max_stale_s=stale_s)
  try:
    server.serve(engine, host=host, port=port, health_checks=[weight_sync])
  finally:
    stop.set()
    engine.stop()


def _model_config_of(store, version: int, sharded: bool = False) -> tuple[ModelConfig, dict]:
  """(model config, manifest info) of a published version (of a sharded store: `sharded`)."""
  from moe import checkpoint as moe_checkpoint  # pylint: disable=g-import-not-at-top
  from pipeline import sharded_weights  # pylint: disable=g-import-not-at-top
  info = sharded_weights.manifest_info(store, version, sharded)
  if "model_config" not in info:
    raise ValueError("the published manifest carries no model_config")
  return moe_checkpoint.config_from_json(info["model_config"]), info


def run_controller(workdir: str, sampler_urls: Sequence[str], config: PipelineConfig, *,
                   steps: int, pool_size: int = 8, num_tasks: Optional[int] = None,
                   tasks: Optional[Sequence] = None, loop_config=None,
                   tokenizer_dir: Optional[str] = None,
                   resolve_url: Optional[Callable[[str], str]] = None) -> int:
  """Produces the groups of `steps` learner steps through the samplers; returns groups written.

  `tasks`: the train tasks (default: the single-turn suite's train split, its first `num_tasks`);
  multi-turn repository tasks run as agent episodes with `loop_config`
  (envs.harness.agent_loop.LoopConfig), exactly as in the in-process pipeline: unless it names
  its `chat`, in the turns of the tokenizer's chat template when it has one, rebuilt here from
  `tokenizer_dir` (envs.harness.agent_loop.chat_for, its turns ending at the directory's EOS
  list's end of turn: `eos_token_ids`).

  `tokenizer_dir`: the model's tokenizer (`load_tokenizer`; None: bytes), which encodes the
  prompts and observations sent to the samplers (their HTTP clients and the rollout
  controller). When the learner has published weights, it is checked against the model config
  and tokenizer their manifest names (`check_tokenizer`, TokenizerError) before any episode.

  Sandboxes (pipeline/grading.py): the agent's tools run in a local pool of `pool_size`; the
  attempts are graded there too, or, with `config.grader` "ray", in a Ray sandbox fleet
  (`config.ray_address`'s cluster), whose counts the summary line carries under "grading".

  A restarted controller resumes at the first group not on disk, with the task the seeded
  order gives that group (RolloutController.resume checks the written records against that
  order). It prints `controller summary {json}` (RolloutController.summary) when it ends, also
  when it fails; a write that keeps failing raises controller.WriteFailed (rl_part reports it
  and exits nonzero).

  `resolve_url`: for samplers named rather than addressed (`sampler_urls` of job names under a
  launcher, which may place a sampler again elsewhere): each name's current URL, asked again
  before a sampler that went down is probed, so a sampler that came back at another address
  rejoins (samplers.HttpSampler.refresh).
  """
  from envs.tasks import suite_pyfunc  # pylint: disable=g-import-not-at-top
  from pipeline import controller as controller_lib  # pylint: disable=g-import-not-at-top
  from pipeline import grading  # pylint: disable=g-import-not-at-top
  from pipeline import samplers as samplers_lib  # pylint: disable=g-import-not-at-top
  from pipeline.local import group_sink  # pylint: disable=g-import-not-at-top
  from rl import trajectory_io  # pylint: disable=g-import-not-at-top
  from envs.harness import agent_loop  # pylint: disable=g-import-not-at-top
  from pipeline import sharded_weights  # pylint: disable=g-import-not-at-top
  from sync import store as store_lib  # pylint: disable=g-import-not-at-top
  p = paths(workdir)
  tok = load_tokenizer(tokenizer_dir)
  store = store_lib.Store(p["weights"])
  latest, sharded = sharded_weights.published(store)
  if latest is not None:
    cfg, info = _model_config_of(store, latest, sharded)
    check_tokenizer(tok, cfg, info.get("tokenizer"), part="controller",
                    tokenizer_dir=tokenizer_dir)
    tok = load_tokenizer(tokenizer_dir, cfg.vocab_size)  # now with the model's ids
  if tasks is None:
    tasks = suite_pyfunc.split(suite_pyfunc.generate(), "train")
  tasks = list(tasks)[:num_tasks]
  loop = loop_config or agent_loop.LoopConfig()
  if loop.chat is None:
    loop = dataclasses.replace(loop, chat=agent_loop.chat_for(
        tasks, tok, eos_token_ids(tokenizer_dir, tok)))
  os.makedirs(p["trajectories"], exist_ok=True)
  written = []
  for name in trajectory_io.list_shards(p["trajectories"]):
    for rec in trajectory_io.read_shard(os.path.join(p["trajectories"], name)):
      if rec is None:
        raise ValueError(f"trajectory shard {name} has a corrupt record")
      written.append(rec["group_id"])
  def http_sampler(u):
    if resolve_url is None:
      return samplers_lib.HttpSampler(u, name=u, tokenizer=tok)
    return samplers_lib.HttpSampler(resolve_url(u), name=u, tokenizer=tok,
                                    resolve=lambda: resolve_url(u))
  sampler_set = samplers_lib.SamplerSet(
      [http_sampler(u) for u in sampler_urls],
      max_attempts=config.max_request_attempts, max_lag=config.max_staleness)
  writer = trajectory_io.TrajectoryWriter(p["trajectories"], f"controller-{int(time.time())}",
                                          records_per_shard=config.attempts)

  # The agent's tools run in a local pool; grading too, or in a Ray fleet (config.grader).
  sandboxes = grading.open_sandboxes(config, pool_size=pool_size)
  ctl = None
  try:
    if sandboxes.fleet is not None:  # where grades go: a fault test picks a node to remove
      print("controller grading fleet " + json.dumps(
          {"host_pids": sandboxes.fleet.host_pids(),
           "host_nodes": sandboxes.fleet.host_nodes()}), flush=True)
    ctl = controller_lib.RolloutController(
        tasks, sampler_set, sandboxes.pool, group_sink(writer), config=config,
        sink_path=p["trajectories"], loop_config=loop,
        tokenizer=tok, grade_fn=sandboxes.grade_fn,
        on_group=lambda g: print(f"group {g.index} {g.task_id} rewards {g.rewards} "
                                 f"retries {g.retries}", flush=True))
    start = ctl.resume(written)
    if start:
      print(f"controller resumed at group {start}", flush=True)
    return ctl.run(steps)
  finally:
    if ctl is not None:
      print("controller summary " + json.dumps(dict(ctl.summary(), grading=sandboxes.summary())),
            flush=True)
    try:
      writer.close()  # empty unless a write failed: then this is one more try at that group
    except OSError as e:  # the write error that stopped the run is already on its way out
      log.error("closing the trajectory writer in %s failed: %r", p["trajectories"], e)
    finally:
      sandboxes.close()
