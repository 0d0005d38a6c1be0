"""Fused q/k/v projections (model.api.fuse_qkv, applied by load_model): the same bytes, stacked along the rows.

The Pallas kernel computes each output row on its own, so the fused matmul's rows are bitwise the separate
matmuls' rows (interpret mode); the model with fused params gives the unfused model's logits (float tolerance:
the XLA reference dot may sum in another order for another N) and the same greedy tokens."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from decode.engine import generate
from model import api
from model.gguf_io import load_gguf
from model.loader import LoadedModel, load_model
from ops import qmatmul_pallas
from ops.qtensor import QTensor, concat_rows
from tools import llama_ref
from tests.models import model_path


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "IQ3_S", "Q6_K"])
def test_fused_rows_are_the_separate_rows_bitwise(qtype):
  from ops import quant
  rng = np.random.default_rng(0)
  K = 512
  ws = [QTensor.from_gguf(quant.random_blocks(qtype, (n, K), rng, scale=1e-2), qtype, K) for n in (64, 16, 16)]
  fused = concat_rows(ws)
  assert fused.shape == (96, K)
  x = jnp.asarray(rng.standard_normal((3, K)), jnp.float32)
  got = np.asarray(qmatmul_pallas.qmatmul_pallas(x, fused, interpret=True))
  want = np.concatenate([np.asarray(qmatmul_pallas.qmatmul_pallas(x, w, interpret=True)) for w in ws], axis=-1)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(fused.dense()), np.concatenate([np.asarray(w.dense()) for w in ws]))


def test_concat_rows_refuses_mixed_types():
  from ops import quant
  rng = np.random.default_rng(1)
  q8, q4 = (QTensor.from_gguf(quant.random_blocks(t, (16, 256), rng, scale=1e-2), t, 256) for t in ("Q8_0", "Q4_K"))
  assert concat_rows([q8, q4]) is None
  assert concat_rows([q8, jnp.zeros(q8.shape, jnp.float32)]) is None


def _type(w):
  return getattr(w, "qtype", str(getattr(w, "dtype", "")))


def _check_swiglu_fused(unfused: dict, fused: dict) -> int:
  """Every SwiGLU gate and up (shared expert, dense block) of one type is one `gateup*` [2F, D] in the fused
  params; of mixed types both stay. Returns how many pairs were fused."""
  n = 0
  for blk, node in unfused.items():
    ffn = node.get("ffn", {}) if isinstance(node, dict) else {}
    for g, u, name in (("gate_shexp", "up_shexp", "gateup_shexp"), ("gate", "up", "gateup")):
      if g in ffn and u in ffn:
        same = _type(ffn[g]) == _type(ffn[u])
        f = fused[blk]["ffn"]
        assert (name in f) == same and (g in f) != same, (blk, name)
        if same:
          assert f[name].shape == (2 * ffn[g].shape[0], ffn[g].shape[1])
          n += 1
  return n


@pytest.mark.parametrize("arch,kind", [("qwen3moe", "Q8_0"), ("qwen2moe", "F16"), ("glm4moe", "Q4_K_M")])
def test_fused_model_equals_unfused(arch, kind):
  """qwen2moe F16: dense weights and q/k/v biases fused; glm4moe Q4_K_M: q/k/v of mixed types stay apart."""
  path = model_path(arch, kind)
  fused = load_model(path)
  cfg, params, tok, _ = load_gguf(path)
  unfused = LoadedModel(cfg, params, tok, path)
  ua = unfused.params["blk_0"]["attn"]
  same = len({_type(ua[n]) for n in ("wq", "wk", "wv")}) == 1
  att = fused.params["blk_0"]["attn"]
  assert ("wqkv" in att) == same and ("wq" in att) != same
  assert ("bqkv" in att) == (same and cfg.qkv_bias)
  print(f"\n{arch} {kind}: q/k/v {'fused' if same else 'kept apart (mixed types)'}")
  n = _check_swiglu_fused(unfused.params, fused.params)
  print(f"{arch} {kind}: {n} SwiGLU gate/up pairs fused")
  assert n >= (0 if arch == "qwen3moe" else 1)        # qwen2moe: shared experts; glm4moe: + its dense block
  toks = jnp.asarray(np.random.default_rng(1).integers(0, 1000, 40), jnp.int32)
  lf, _, _ = api.prefill(fused.params, toks, api.init_state(cfg, 256, "bf16"), cfg=cfg)
  lu, _, _ = api.prefill(unfused.params, toks, api.init_state(cfg, 256, "bf16"), cfg=cfg)
  err = llama_ref.rel_l2(np.asarray(lf), np.asarray(lu))
  print(f"\n{arch} {kind}: fused vs unfused q/k/v logits rel L2 {err:.1e}")
  assert err < 1e-5
  prompt = [int(t) for t in np.asarray(toks)]
  assert generate(fused, prompt, max_new_tokens=12, stop_at_eos=False).ids == \
      generate(unfused, prompt, max_new_tokens=12, stop_at_eos=False).ids


@pytest.mark.parametrize("arch,kind", [("qwen35moe", "F16"), ("qwen3next", "Q8_0"), ("qwen3next", "IQ3_S")])
def test_fused_deltanet_inputs_equal_unfused(arch, kind):
  """A Gated DeltaNet layer's wqkv, wz, wbeta and walpha stack into one `win` where they share a type (F16: dense;
  llama.cpp's Q8_0 and IQ3_S mixes: whatever types its quantizer chose, fused only where they agree); prefill
  logits equal the unfused model's within float tolerance and greedy tokens are the same."""
  path = model_path(arch, kind)
  fused = load_model(path)
  cfg, params, tok, _ = load_gguf(path)
  unfused = LoadedModel(cfg, params, tok, path)
  names = ("wqkv", "wz", "wbeta", "walpha")
  ug = unfused.params["blk_0"]["gdn"]
  same = len({_type(ug[n]) for n in names}) == 1
  g = fused.params["blk_0"]["gdn"]
  assert ("win" in g) == same and all((n in g) != same for n in names)
  if same:
    assert g["win"].shape == (cfg.Cc + cfg.Hv * cfg.Dv + 2 * cfg.Hv, cfg.d_model)
  assert _check_swiglu_fused(unfused.params, fused.params) >= (1 if kind != "IQ3_S" else 0)    # shared experts
  print(f"\n{arch} {kind}: DeltaNet inputs {'fused' if same else 'kept apart (mixed types)'}: "
        f"{[_type(ug[n]) for n in names]}")
  toks = jnp.asarray(np.random.default_rng(1).integers(0, 1000, 40), jnp.int32)
  lf, _, _ = api.prefill(fused.params, toks, api.init_state(cfg, 256, "bf16"), cfg=cfg)
  lu, _, _ = api.prefill(unfused.params, toks, api.init_state(cfg, 256, "bf16"), cfg=cfg)
  err = llama_ref.rel_l2(np.asarray(lf), np.asarray(lu))
  print(f"fused vs unfused logits rel L2 {err:.1e}")
  # run eagerly (op by op) every layer's output is bitwise the unfused one's (qwen3next Q8_0, interpret kernels);
  # under jit XLA fuses the ops after the split differently and a last bit may round otherwise, which the
  # recurrent state carries along: measured 2.2e-5 .. 2.3e-5
  assert err < 1e-4
  prompt = [int(t) for t in np.asarray(toks)]
  assert generate(fused, prompt, max_new_tokens=12, stop_at_eos=False).ids == \
      generate(unfused, prompt, max_new_tokens=12, stop_at_eos=False).ids
