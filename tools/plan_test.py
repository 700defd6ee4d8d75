"""tools/plan's activation memory: the formula against what JAX saves and what XLA allocates.

Tolerance policy. The formula counts the residuals JAX's autodiff saves for this model's code, so
against JAX's own residuals (the leaves of a `jax.vjp` closure, per added row, which cancels the
weight-shaped residuals) it must agree within 15% (measured 0.92 to 0.97 without remat, 0.99
with, when this was written); the rest is small bookkeeping (rsqrt scalars, index arrays).
Against the compiled step's temp memory (XLA:CPU's `memory_analysis()`, which also holds backward
temporaries and fuses or copies some residuals) it must agree within a factor of 1.5 either way
(measured 0.75 to 1.04 over fp32 / bf16 and T = 32 ... 1024). Dropping the T x T attention term
fails every residual case (0.44 to 0.69), dropping the head fails the bf16 and remat cases.
XLA:CPU's temp memory does not shrink under jax.checkpoint (measured: the same bytes with and
without it), so the remat figures are checked against JAX's residuals only.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import build
from moe import model as model_lib
from moe.config import ModelConfig
from tools import configs
from tools import plan as plan_lib

GIB = 1024 ** 3
ONE = (1, 1, 1, 1)
TINY = ModelConfig(vocab_size=259, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                   num_experts_per_tok=2, max_seq_len=512, expert_impl="dispatch",
                   capacity_factor=1.0)


def _loss_fn(graphdef, rest):
  def loss(params, tokens):
    out = nnx.merge(graphdef, params, rest)(tokens)
    logp = jax.nn.log_softmax(out.logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))
  return loss


def _split(cfg):
  graphdef, params, rest = nnx.split(build.abstract(cfg), nnx.Param, ...)
  return graphdef, params, rest


def residual_bytes(cfg: ModelConfig, rows: int, seq_len: int) -> int:
  """Bytes of everything `jax.vjp` keeps for the backward of the model's loss (abstractly)."""
  graphdef, params, rest = _split(cfg)
  loss = _loss_fn(graphdef, rest)
  tokens = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32)
  leaves = jax.eval_shape(
      lambda p, t: jax.tree.leaves(jax.vjp(lambda q: loss(q, t), p)[1]), params, tokens)
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)


@pytest.fixture
def layer_remat(monkeypatch):
  """Every decoder layer under jax.checkpoint (nnx.remat), as the plan's remat figures assume."""
  monkeypatch.setattr(model_lib.DecoderLayer, "__call__",
                      nnx.remat(model_lib.DecoderLayer.__call__))


CASES = [
    pytest.param(TINY, 64, id="fp32"),
    pytest.param(TINY.replace(dtype="bfloat16"), 64, id="bf16"),
    # A dense first layer and a shared expert: every term of the formula.
    pytest.param(TINY.replace(first_k_dense=1, num_shared_experts=1, num_layers=3,
                              dtype="bfloat16"), 128, id="bf16-dense-shared"),
]


@pytest.mark.parametrize("cfg,seq_len", CASES)
def test_saved_activations_match_jax_residuals(cfg, seq_len):
  per_row = residual_bytes(cfg, 2, seq_len) - residual_bytes(cfg, 1, seq_len)
  est = plan_lib.activation_plan(cfg, batch_rows=1, seq_len=seq_len, mesh_shape=ONE)["saved"]
  assert est == pytest.approx(per_row, rel=0.15)


@pytest.mark.parametrize("cfg,seq_len", CASES)
def test_remat_saves_only_layer_inputs_and_head(cfg, seq_len, layer_remat):
  per_row = residual_bytes(cfg, 2, seq_len) - residual_bytes(cfg, 1, seq_len)
  a = plan_lib.activation_plan(cfg, batch_rows=1, seq_len=seq_len, mesh_shape=ONE)
  assert a["saved_remat"] == pytest.approx(per_row, rel=0.15)
  # While a layer is recomputed its own activations come back: remat adds the largest layer.
  layers = plan_lib.activation_bytes_per_token(cfg, seq_len, ONE)["layers"]
  assert a["remat"] == pytest.approx(a["saved_remat"] + seq_len * max(layers), abs=1)
  assert a["saved_remat"] < a["remat"] < a["saved"]


@pytest.mark.parametrize("cfg,rows,seq_len", [(TINY, 2, 512),
                                              (TINY.replace(dtype="bfloat16"), 8, 64)],
                         ids=["fp32-long", "bf16-short"])
def test_estimate_within_a_factor_of_compiled_temp_memory(cfg, rows, seq_len):
  graphdef, _, _ = _split(cfg)
  _, params, rest = nnx.split(build.create(cfg, seed=0), nnx.Param, ...)
  step = jax.jit(jax.value_and_grad(_loss_fn(graphdef, rest)))
  tokens = jnp.zeros((rows, seq_len), jnp.int32)
  temp = step.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
  est = plan_lib.activation_plan(cfg, batch_rows=rows, seq_len=seq_len,
                                 mesh_shape=ONE)["activation_bytes"]
  assert 1 / 1.5 <= est / temp <= 1.5, (est, temp)


def test_mesh_splits_rows_and_heads():
  """data x fsdp split the rows; micro-batches and minibatches split them further; the tensor
  axis splits heads, so at a long context (attention-dominated) it nearly halves the bytes."""
  cfg = TINY.replace(dtype="bfloat16")
  base = plan_lib.activation_plan(cfg, batch_rows=16, seq_len=256, mesh_shape=ONE)
  assert base["rows_per_micro_batch"] == 16
  for mesh, micro, mini in (((2, 1, 1, 1), 1, 1), ((1, 2, 1, 1), 1, 1), (ONE, 2, 1),
                            (ONE, 1, 2)):
    a = plan_lib.activation_plan(cfg, batch_rows=16, seq_len=256, mesh_shape=mesh,
                                 micro_batches=micro, minibatches=mini)
    assert a["rows_per_micro_batch"] == 8 and a["saved"] == base["saved"] // 2
  long = dict(batch_rows=1, seq_len=8192)
  ratio = (plan_lib.activation_plan(cfg, mesh_shape=ONE, **long)["saved"]
           / plan_lib.activation_plan(cfg, mesh_shape=(1, 1, 1, 2), **long)["saved"])
  assert 1.9 < ratio < 2.0
  # The expert axis splits the routed rows only: less memory, but far from half.
  e4 = plan_lib.activation_plan(cfg, mesh_shape=(1, 1, 4, 1), batch_rows=16, seq_len=32)
  e1 = plan_lib.activation_plan(cfg, mesh_shape=ONE, batch_rows=16, seq_len=32)
  assert 0.5 < e4["saved"] / e1["saved"] < 1


def test_preparation_pass_covers_the_whole_batch():
  """The RL objective's no-grad pass runs over all the device's rows at once, so micro-batches
  shrink the backward pass but not it."""
  kw = dict(batch_rows=32, seq_len=256, mesh_shape=(1, 2, 1, 1), preparation_pass=True)
  one = plan_lib.activation_plan(TINY, **kw)
  eight = plan_lib.activation_plan(TINY, micro_batches=8, **kw)
  assert one["preparation_rows"] == eight["preparation_rows"] == 16
  assert one["preparation"] == eight["preparation"] > 0
  assert eight["saved"] == one["saved"] // 8
  assert eight["activation_bytes"] == max(eight["saved"], eight["preparation"])
  assert plan_lib.activation_plan(TINY, batch_rows=32, seq_len=256,
                                  mesh_shape=ONE)["preparation"] == 0
  with pytest.raises(ValueError, match="must be >= 1"):
    plan_lib.activation_plan(TINY, batch_rows=0, seq_len=8, mesh_shape=ONE)


def test_one_billion_plan_says_which_steps_fit(capsys):
  """The 1B plan on 80 GiB devices: the training state fits; a step without remat does not,
  with per-layer remat it does (the preparation pass then dominates)."""
  path = os.path.join(configs.EXPERIMENTS_DIR, "moe_1b_plan.gin")
  cfg = configs.load_experiment([path], check_devices=False)
  p = plan_lib.plan(cfg)
  a = p["activations"]
  assert (a["rows_per_micro_batch"], a["seq_len"]) == (4, 4096)  # 64 rows / fsdp 2 / 8 micro
  assert a["preparation_rows"] == 32
  assert p["grad_bytes_per_device"] == 2 * 4 * p["params_per_device"]
  assert p["step_bytes_per_device"] == (p["train_bytes_per_device"] + p["grad_bytes_per_device"]
                                        + max(a["saved"], a["preparation"]))
  assert p["step_bytes_per_device_remat"] < 80 * GIB < p["step_bytes_per_device"]
  assert plan_lib.main([f"--gin_file={path}", "--device_memory_gib=80"]) == 0
  out = capsys.readouterr().out
  assert "on 80 GiB devices: training state" in out
  lines = {line.split("  ")[1].strip(): line for line in out.splitlines() if "GiB devices" in line}
  assert "does not fit" in lines["on 80 GiB devices: a step, no remat"]
  assert "fits," in lines["on 80 GiB devices: a step, per-layer remat"]


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
