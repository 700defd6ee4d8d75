"""Starts the sampling server: `bazel run //tools:serve -- --hf_checkpoint=DIR --port=PORT`.

Sources of weights (exactly one):
`--hf_checkpoint=DIR` (imported through `moe.hf`), `--checkpoint=DIR` (a project checkpoint,
`moe.checkpoint`), or `--gin_file` model presets (random init with `--seed`; e.g.
`--gin_file=moe/configs/tiny.gin`). Engine settings come from flags or gin bindings of
`rollout.EngineConfig` (`--gin.EngineConfig.max_slots=32`; tools/configs/runs/serve.gin lists
them). gin is used only here, at the edge; `rollout.loading.load_engine` takes plain arguments.

Layout: one engine on the default device, or `--replicas=R` data-parallel engines behind the one
server (a request goes to the least loaded; `rollout.replicas`), each sharded over `--expert=E`
x `--tensor=T` devices of its own (`rollout.placement`: a model too large for one device), so
R x E x T devices in all (on a CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=N`
simulates them). Weight swaps reach every replica at the same version; `/metrics` has each
replica's counters under a `replica` label.

Text prompts are encoded, and completions decoded, with the checkpoint's own tokenizer (its
`tokenizer.json`, e.g. one saved by transformers); bytes only for a model whose vocabulary is the
byte tokenizer's. A checkpoint with neither does not start (`moe.tokenizer.for_model`). Its chat
template (`chat_template.jinja`, or tokenizer_config.json's `chat_template`) renders the messages
of `/v1/chat/completions`; without one, chat requests are a 400. `/v1/models` names the model by
its checkpoint directory (`served_model_name`).

The admin app (weight swaps, `rollout.admin`) listens on `--admin_host` (loopback by default,
whatever `--host` is) at `--admin_port` and always requires a token: `--admin_token`,
`$ROLLOUT_ADMIN_TOKEN`, or one generated at start-up, written to `--admin_token_file` (mode 0600)
or else printed once. Swaps by path read only under `--checkpoint_root`.

Start-up: the server listens at once, then compiles every device program a request can reach
(`rollout.warmup`, `--warmup_threads` at a time), logging one line per program; `/health` answers
503 until that is done, and a second stdout line, "rollout server ready: ...", says so.
`--no_warmup` skips it (each new shape then compiles when a request first needs it). JAX's
persistent compilation cache is on (`--compilation_cache_dir`, default
`~/.cache/moe-rl/jax`; empty: off), so a restart loads those programs instead of compiling them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Optional, Sequence

from rollout import loading
from rollout import server as server_lib
from rollout.engine import Engine
from tools import compilation_cache
from tools import configs

log = logging.getLogger(__name__)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  """The flags; `gin_bindings` holds the `--gin.X=V` bindings."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--hf_checkpoint", help="Hugging Face checkpoint directory (moe.hf import)")
  p.add_argument("--checkpoint", help="project checkpoint directory (moe.checkpoint)")
  p.add_argument("--seed", type=int, default=0, help="init seed for --gin_file models")
  p.add_argument("--host", default="127.0.0.1", help="address of the public (completions) app")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--admin_port", type=int, default=None,
                 help="admin port (default: port + 1; -1 disables the admin endpoints)")
  p.add_argument("--admin_host", default="127.0.0.1",
                 help="address of the admin app (default loopback, whatever --host is)")
  p.add_argument("--admin_token", default=os.environ.get("ROLLOUT_ADMIN_TOKEN"),
                 help="the token admin requests send as 'Authorization: Bearer TOKEN' "
                      "(default: $ROLLOUT_ADMIN_TOKEN; neither: one is generated)")
  p.add_argument("--admin_token_file", default=None,
                 help="write the admin token to this file (mode 0600) instead of printing a "
                      "generated one")
  p.add_argument("--admin_allowed_hosts", default="",
                 help="comma-separated extra host names admin requests may use in Host/Origin "
                      "(e.g. this machine's DNS name with --admin_host=0.0.0.0)")
  p.add_argument("--checkpoint_root", default=None,
                 help="/admin/swap loads checkpoints only under this directory (default: "
                      "swaps by path are off; deltas still work)")
  p.add_argument("--max_delta_bytes", type=int, default=None,
                 help="body limit of /admin/swap_delta (default: twice the weights' bytes "
                      "plus 1 MiB)")
  p.add_argument("--model_name", default=None,
                 help="name reported by /v1/models (default: the checkpoint directory's name)")
  p.add_argument("--max_slots", type=int, default=None)
  p.add_argument("--max_len", type=int, default=None, help="context length (KV cache per slot)")
  p.add_argument("--decode_steps", type=int, default=None)
  p.add_argument("--max_queue", type=int, default=None)
  p.add_argument("--deterministic", action="store_true", default=None)
  p.add_argument("--replicas", type=int, default=1,
                 help="data-parallel engines behind the one server, each on its own devices")
  p.add_argument("--expert", type=int, default=1,
                 help="devices each engine shards the model's experts over (expert parallel)")
  p.add_argument("--tensor", type=int, default=1,
                 help="devices each engine shards its attention heads and expert hidden "
                      "units over (tensor parallel)")
  p.add_argument("--request_timeout", type=float, default=600.0)
  p.add_argument("--no_warmup", action="store_true",
                 help="do not compile the engine's programs at start-up (/health is ready at "
                      "once; a request of a new shape then waits for its compilation)")
  p.add_argument("--warmup_threads", type=int, default=default_warmup_threads(),
                 help="programs the warm-up compiles at once (default: the CPUs, at most 8)")
  p.add_argument("--compilation_cache_dir", default=compilation_cache.default_dir(),
                 help="JAX's persistent compilation cache (default: %(default)s; empty: off)")
  args, args.gin_file, args.gin_bindings = configs.parse_flags(p, sys.argv[1:] if argv is None
                                                               else argv)
  return args


def default_warmup_threads() -> int:
  """One compilation per CPU this process may use, at most 8 (each holds its own memory)."""
  return max(1, min(8, len(os.sched_getaffinity(0))))


def build_engine(args: argparse.Namespace) -> Engine:
  """The engine the flags describe (weights loaded, loop started)."""
  configs.parse(args.gin_file, args.gin_bindings)
  cfg = None
  if args.hf_checkpoint is None and args.checkpoint is None:
    if not args.gin_file:
      raise SystemExit("give --hf_checkpoint, --checkpoint or --gin_file (a model preset)")
    cfg = configs.model_config()
  over = {k: getattr(args, k) for k in ("max_slots", "max_len", "decode_steps", "max_queue",
                                          "deterministic") if getattr(args, k) is not None}
  ec = dataclasses.replace(configs.GinEngineConfig(), **over)
  for flag in ("replicas", "expert", "tensor"):
    if getattr(args, flag) < 1:
      raise SystemExit(f"error: --{flag} must be >= 1, got {getattr(args, flag)}")
  try:
    return loading.load_engine(ec, hf_checkpoint=args.hf_checkpoint, checkpoint=args.checkpoint,
                               config=cfg, seed=args.seed, max_seq_len=args.max_len,
                               replicas=args.replicas, expert=args.expert, tensor=args.tensor)
  except ValueError as e:  # a bad source, or a checkpoint without a usable tokenizer: no traceback
    raise SystemExit(f"error: {e}") from e


RANDOM_INIT_NAME = "random-init"


def served_model_name(args: argparse.Namespace) -> str:
  """What /v1/models calls the served model: `--model_name`, else the checkpoint directory's
  name (what clients know a checkpoint by, e.g. "Qwen3-30B-A3B"), else, for a random-init
  preset, `RANDOM_INIT_NAME` -- never a gin file's name, which says nothing of the weights
  (`--gin_file=tools/configs/runs/serve.gin` would name every model "serve.gin")."""
  if args.model_name:
    return args.model_name
  directory = args.hf_checkpoint or args.checkpoint
  if directory:
    return os.path.basename(os.path.normpath(os.path.abspath(directory)))
  return RANDOM_INIT_NAME


def main(argv: Optional[Sequence[str]] = None) -> None:
  logging.basicConfig(level=logging.INFO)
  args = parse_args(argv)
  if args.warmup_threads < 1:
    raise SystemExit(f"error: --warmup_threads must be >= 1, got {args.warmup_threads}")
  # Before the engine is built: JAX decides at its first compilation whether the cache is used.
  if args.compilation_cache_dir:
    log.info("persistent compilation cache: %s",
             compilation_cache.enable(args.compilation_cache_dir))
  else:
    log.info("persistent compilation cache: off")
  engine = build_engine(args)
  admin_port = args.port + 1 if args.admin_port is None else args.admin_port
  cfg = engine.model_config
  name = served_model_name(args)
  server_lib.serve(engine, host=args.host, port=args.port,
                   admin_port=None if admin_port < 0 else admin_port, admin_host=args.admin_host,
                   model_name=name, admin_token=args.admin_token,
                   admin_token_file=args.admin_token_file,
                   admin_allowed_hosts=[h for h in args.admin_allowed_hosts.split(",") if h],
                   checkpoint_root=args.checkpoint_root, max_delta_bytes=args.max_delta_bytes,
                   request_timeout=args.request_timeout,
                   load_flat=lambda path: loading.load_flat(path, cfg),
                   warmup=not args.no_warmup, warmup_threads=args.warmup_threads)


if __name__ == "__main__":
  sys.exit(main())
