"""One part of the asynchronous RL pipeline as its own process (see pipeline/processes.py).

  bazel run //tools:rl_part -- learner --workdir=/tmp/rl --steps=60 [--init_checkpoint=DIR]
  bazel run //tools:rl_part -- sampler --workdir=/tmp/rl --port=8101 [--tokenizer=DIR]
  bazel run //tools:rl_part -- controller --workdir=/tmp/rl --steps=60 [--tokenizer=DIR] \
      --samplers=http://127.0.0.1:8101,http://127.0.0.1:8102

A sampler lays its engine over its process's devices as the experiment's samplers do
(RLConfig.sampler_replicas data-parallel replicas behind its one server, each sharded over
RLConfig.sampler_expert x sampler_tensor devices); on a CPU,
XLA_FLAGS=--xla_force_host_platform_device_count=N gives the process N devices.

The controller grades in a Ray sandbox fleet when its experiment says so (PipelineConfig.grader,
pipeline/grading.py), e.g. on an existing Ray cluster:
  bazel run //tools:rl_part -- controller --workdir=/tmp/rl --samplers=http://127.0.0.1:8101 \
      --gin_file=tools/configs/experiments/default.gin \
      --gin_file=tools/configs/runs/ray_grading.gin --gin.PipelineConfig.ray_address='"HEAD:6379"'

Weights through relays (pipeline/processes.py, run_relay): an origin relay beside the learner,
one relay per cluster pulling from it, and each sampler reading through its cluster's relay,
then the origin to fail over to:
  bazel run //tools:rl_part -- relay --workdir=/tmp/rl --port=8201              # origin
  bazel run //tools:rl_part -- relay --workdir=/tmp/rl --port=8202 --upstream=http://127.0.0.1:8201
  bazel run //tools:rl_part -- sampler --workdir=/tmp/rl --port=8101 \
      --weights_via=http://127.0.0.1:8202,http://127.0.0.1:8201

A model the agentic experiment pre-trained speaks a byte-level BPE saved beside it, so every
part names it (all three the same; rl_part refuses to start on a mismatch):
  bazel run //tools:rl_part -- learner --workdir=/tmp/rl \
      --gin_file=tools/configs/experiments/agent.gin --init_checkpoint=RUN/pretrained_model
  bazel run //tools:rl_part -- sampler --workdir=/tmp/rl --port=8101 \
      --gin_file=tools/configs/experiments/agent.gin --tokenizer=RUN/pretrained_model
  bazel run //tools:rl_part -- controller --workdir=/tmp/rl --samplers=http://127.0.0.1:8101 \
      --gin_file=tools/configs/experiments/agent.gin --tokenizer=RUN/pretrained_model

A learner of several processes (`jax.distributed`, one command per process, e.g. one per host;
on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives each process N devices)
trains on the experiment's mesh (ExperimentConfig.mesh_shape) over all their devices, and
each process publishes the weight blocks it holds; samplers follow that sharded store
(pipeline/processes.py):
  bazel run //tools:rl_part -- learner --workdir=/tmp/rl --num_processes=2 --process_id=0 \
      --coordinator=HOST0:8476 --gin_file=tools/configs/experiments/sharded.gin
  bazel run //tools:rl_part -- learner --workdir=/tmp/rl --num_processes=2 --process_id=1 \
      --coordinator=HOST0:8476 --gin_file=tools/configs/experiments/sharded.gin

JAX's persistent compilation cache is on for the learner, sampler and controller
(`--compilation_cache_dir`, tools/compilation_cache.py; empty: off): a part restarted after a
kill, or a learner process restarted with its gang, loads the programs it compiled before
instead of compiling them again. The default is the user's cache (`~/.cache/moe-rl/jax`), and
under a launcher the run's own, `<experiment dir>/jax_cache`, which a part placed again on
another node finds too (the nodes of one run are alike; see tools/compilation_cache.py for
machines of different CPUs). A relay compiles nothing. The part's last line,
`compilation cache {"dir", "requests", "hits"}`, says how many of its compilations the cache
answered (none of a part killed before its end).

`--tokenizer=DIR`: a directory holding tokenizer.json (a model directory); it must be there.
Without the flag the learner takes the one saved beside `--init_checkpoint` (bytes if there is
none) and the sampler and controller take bytes. A model a `--hf_checkpoint` run trained (its
RUN/pretrained_model, or the Hugging Face checkpoint itself) keeps its chat template and EOS
list there too: the sampler stops at every id of the list and the controller writes agent
episodes in the chat template, as the in-process run does (pipeline/processes.py).

Pipeline settings (shared by learner and controller) come from gin: `--gin_file` (default
tools/configs/experiments/default.gin, whose model and PipelineConfig are used) and `--gin.X=V`.

Under the launcher (//tools:launch with tools/configs/launch/rl.gin, locally or on Ray) parts
find each other by job name, never by port: `--samplers=@sampler_0,@sampler_1` (asked again
before a sampler that went down is probed, so one placed again on another node rejoins),
`--weights_via=@relay_1,@relay_0` and `--upstream=@relay_0` (asked again when none of them
answers, so a relay placed again elsewhere is followed too) and a learner's
`--coordinator=@learner_0`; a sampler or relay serves on the port and host the launcher
reserved for it, and `--workdir` defaults to the run's `<experiment dir>/work`.
A tokenizer that does not fit (pipeline.processes.TokenizerError) or a controller whose
trajectories cannot be written stops with `error: ...` on stderr and a nonzero exit status.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_EXPERIMENT = "tools/configs/experiments/default.gin"


def main(argv=None, *, cache_by_default: bool = False) -> int:
  """Runs the part argv names; its exit status.

  `cache_by_default`: without `--compilation_cache_dir`, turn JAX's persistent compilation cache
  on in its default directory (`_default_cache_dir`), as the binary does. Off for in-process
  callers (tests), whose JAX configuration stays theirs unless they pass the flag.
  """
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("part", choices=("learner", "sampler", "controller", "relay"))
  p.add_argument("--workdir", default=None,
                 help="the parts' shared work directory (default under a launcher: "
                      "<experiment dir>/work)")
  p.add_argument("--steps", type=int, default=None, help="learner steps (default: RLConfig)")
  p.add_argument("--init_checkpoint", default=None)
  p.add_argument("--port", type=int, default=0,
                 help="sampler, relay: the port (default under a launcher: the one it reserved)")
  p.add_argument("--host", default=None,
                 help="sampler, relay: the address to serve on (default: the launcher's for "
                      "this job, else 127.0.0.1)")
  p.add_argument("--samplers", default="", help="comma-separated sampler URLs or @job names")
  p.add_argument("--weights_via", default="",
                 help="sampler: read the weights through these relays (comma-separated URLs or "
                      "@job names, tried in order) instead of the work directory's store")
  p.add_argument("--upstream", default="",
                 help="relay: the parent relays' URLs (or @job names); none: read the store")
  p.add_argument("--tokenizer", default=None, metavar="DIR",
                 help="directory holding the model's tokenizer.json (default: the learner's "
                      "--init_checkpoint's if it has one, else bytes)")
  p.add_argument("--num_processes", type=int, default=1,
                 help="learner: the processes of one multi-process learner (jax.distributed)")
  p.add_argument("--process_id", type=int, default=0, help="learner: this process's index")
  p.add_argument("--coordinator", default="", metavar="HOST:PORT",
                 help="learner: process 0's address, the same in every process")
  from tools import compilation_cache  # pylint: disable=g-import-not-at-top
  p.add_argument("--compilation_cache_dir", default=None,
                 help="JAX's persistent compilation cache (default: under a launcher "
                      "<experiment dir>/jax_cache, else the user's, "
                      f"{compilation_cache.default_dir()}; empty: off)")
  from tools import configs  # pylint: disable=g-import-not-at-top
  args, files, bindings = configs.parse_flags(p, sys.argv[1:] if argv is None else argv)
  logging.basicConfig(level=logging.WARNING)
  if args.workdir is None:
    from launch import discovery  # pylint: disable=g-import-not-at-top
    if not discovery.under_launcher():
      p.error("--workdir is required (outside a launcher)")
    args.workdir = os.path.join(os.environ[discovery.EXPERIMENT_DIR], "work")
  if args.compilation_cache_dir is None:
    args.compilation_cache_dir = _default_cache_dir() if cache_by_default else ""
  # Before anything compiles: JAX decides at its first compilation whether the cache is used.
  cache = None
  if args.compilation_cache_dir and args.part != "relay":
    from rollout import warmup  # pylint: disable=g-import-not-at-top
    cache_dir = compilation_cache.enable(args.compilation_cache_dir)
    cache = warmup.CompileCounter().start()  # for the process's life: its last line
  if args.num_processes != 1 or args.process_id or args.coordinator:
    if args.part != "learner":
      p.error("--num_processes, --process_id and --coordinator are the learner's")
    from rl import distributed  # pylint: disable=g-import-not-at-top
    coordinator = args.coordinator
    if coordinator.startswith("@"):  # process 0's job name: its reserved address
      from launch import discovery  # pylint: disable=g-import-not-at-top
      coordinator = discovery.address_of(coordinator[1:])
    try:  # before anything starts a JAX backend (the config's device check does)
      distributed.initialize(coordinator, args.num_processes, args.process_id)
    except ValueError as e:
      p.error(str(e))
  from pipeline import processes  # pylint: disable=g-import-not-at-top
  files = files or [DEFAULT_EXPERIMENT]
  try:
    cfg = _load_experiment(configs, files, bindings, learner=args.part == "learner")
  except configs.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  steps = args.steps if args.steps is not None else cfg.rl.steps
  try:
    return _run_part(p, args, cfg, steps)
  except processes.TokenizerError as e:  # the operator's to fix: which tokenizer, which model
    print(f"error: {e}", file=sys.stderr)
    return 2
  finally:
    if cache is not None:
      print(_cache_line(cache_dir, cache), flush=True)


CACHE_LINE = "compilation cache "


def _cache_line(directory: str, counter) -> str:
  """The part's last line, `compilation cache {json}`: `requests` compilations that consulted
  JAX's persistent compilation cache, `hits` of them loaded from it (a
  `rollout.warmup.CompileCounter` open since the cache was turned on)."""
  import json  # pylint: disable=g-import-not-at-top
  return CACHE_LINE + json.dumps({"dir": directory, "requests": counter.cache_requests,
                                  "hits": counter.cache_hits})


def _default_cache_dir() -> str:
  """The run's cache under a launcher (`<experiment dir>/jax_cache`: every part of the run, and
  a part restarted on another node, shares it), else the user's."""
  from launch import discovery  # pylint: disable=g-import-not-at-top
  from tools import compilation_cache  # pylint: disable=g-import-not-at-top
  if discovery.under_launcher():
    return os.path.join(os.environ[discovery.EXPERIMENT_DIR], "jax_cache")
  return compilation_cache.default_dir()


def _load_experiment(configs, files, bindings, *, learner: bool):
  """The experiment, its mesh checked against the devices only for the learner: a part runs on
  its own process's devices (all of them the learner's, none shared with samplers as in the
  in-process run), and the mesh is the learner's alone."""
  plans = [f for f in files if configs.is_plan_experiment(f)]
  if plans:
    raise configs.ConfigError(f"{plans[0]} is a plan-only experiment (a real-size run): plan "
                              f"it with `bazel run //tools:plan -- --gin_file={plans[0]}`")
  cfg = configs.load_experiment(files, bindings, check_devices=False)
  if learner:
    import jax  # pylint: disable=g-import-not-at-top
    configs.validate_mesh(cfg.model, cfg.mesh_shape, jax.device_count())
  return cfg


def _run_part(parser: argparse.ArgumentParser, args, cfg, steps: int) -> int:
  """Runs the part `args.part` names with the experiment `cfg`; its exit status."""
  from pipeline import processes  # pylint: disable=g-import-not-at-top
  if args.part == "learner":
    processes.run_learner(args.workdir, cfg.model, cfg.rl.pipeline, cfg.rl.learner, steps=steps,
                          init_checkpoint=args.init_checkpoint, seed=cfg.seed,
                          tokenizer_dir=args.tokenizer, mesh_shape=cfg.mesh_shape)
  elif args.part in ("sampler", "relay"):
    from launch import discovery  # pylint: disable=g-import-not-at-top
    port = args.port or discovery.my_port()
    host = args.host or (discovery.my_host() if discovery.under_launcher() else "127.0.0.1")
    if args.part == "relay":
      processes.run_relay(args.workdir, port=port, upstream=_urls(args.upstream) or None,
                          host=host, resolve_upstream=_resolver(args.upstream))
    else:
      processes.run_sampler(args.workdir, port=port, max_slots=cfg.rl.sampler_slots,
                            max_len=cfg.model.max_seq_len, tokenizer_dir=args.tokenizer,
                            weight_urls=_urls(args.weights_via) or None, host=host,
                            replicas=cfg.rl.sampler_replicas, expert=cfg.rl.sampler_expert,
                            tensor=cfg.rl.sampler_tensor,
                            resolve_weight_urls=_resolver(args.weights_via))
  else:
    urls = [s for s in args.samplers.split(",") if s]  # @names resolved as they are used
    if not urls:
      parser.error("the controller needs --samplers")
    from experiment import run as run_lib  # pylint: disable=g-import-not-at-top
    from pipeline import controller  # pylint: disable=g-import-not-at-top
    # The experiment's RL tasks (its suite: single-turn functions, or repository tasks run
    # as multi-turn agent episodes with its agent loop settings; ExperimentConfig.rl_tasks
    # picks which), the same ones the in-process run trains on.
    _, train, _, _ = run_lib.eval_split(cfg)
    try:
      processes.run_controller(args.workdir, urls, cfg.rl.pipeline, steps=steps,
                               pool_size=cfg.sandbox_pool, tasks=train,
                               loop_config=cfg.agent.loop_config(cfg.rl.pipeline.max_new_tokens),
                               tokenizer_dir=args.tokenizer, resolve_url=_url)
    except controller.WriteFailed as e:  # a clear stop, not a traceback: the operator's to fix
      print(f"error: {e}", file=sys.stderr)
      return 1
  return 0


def _urls(flag: str) -> list:
  """The comma-separated URLs of a flag, `@job` names resolved through the launcher."""
  return [_url(s) for s in flag.split(",") if s]


def _resolver(flag: str):
  """For a flag naming `@job`s: a function giving their URLs now (a relay placed again on
  another node is followed); None when it names none (fixed URLs)."""
  if not any(s.startswith("@") for s in flag.split(",")):
    return None
  return lambda: _urls(flag)


def _url(s: str) -> str:
  """A URL as is; `@job`: that job's address now (launch.discovery), as http://host:port."""
  if not s.startswith("@"):
    return s
  from launch import discovery  # pylint: disable=g-import-not-at-top
  return "http://" + discovery.address_of(s[1:])


if __name__ == "__main__":
  sys.exit(main(cache_by_default=True))
