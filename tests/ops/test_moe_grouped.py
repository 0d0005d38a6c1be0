"""ops/moe `_moe_grouped` (the prefill MoE: only the T*k routed (token, expert) pairs, sorted by expert) against a
float64 numpy oracle and against the old every-expert-on-every-token path `_moe_dense`.

Oracle: the experts dequantized by gguf-py (`gguf.quants.dequantize`, independent of ops/quant) or taken as given
(plain float arrays), then sum_k w_k * down_e(silu(gate_e x) * up_e x) in float64, one (token, k) at a time.
Packed experts are random valid blocks (ops.quant.random_blocks) repacked into QTensors (QTensor.from_gguf), as in
tests/ops/test_dequant.py. A block format needs its row length to be a multiple of 256, so the odd F cases pack down
as F16 (block size 1) or use plain float arrays.
"""
from __future__ import annotations

import functools
import zlib

import gguf
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from ops import moe as moe_ops
from ops import quant
from ops.qtensor import QTensor

TOL = 1e-5            # relative L2, against the float64 oracle and against the dense path

# (T, E, K): one token, a few, many; E in 6..16, top-k 2..4
SIZES = [(1, 6, 2), (5, 8, 3), (40, 16, 4)]
# name -> (gate/up type, down type, D, F); "float": plain float32 arrays
WEIGHTS = {
    "Q4_K": ("Q4_K", "Q4_K", 256, 256),
    "IQ3_S": ("IQ3_S", "IQ3_S", 256, 256),
    "IQ3_S+F16_oddF": ("IQ3_S", "F16", 256, 37),
    "Q4_K+F16_oddF": ("Q4_K", "F16", 256, 19),
    "float_oddF": ("float", "float", 48, 17),
}
ROUTINGS = ("random", "unused_experts", "one_expert_all_tokens", "all_pairs_one_expert")


def _relerr(y, r) -> float:
  y, r = np.asarray(y, np.float64), np.asarray(r, np.float64)
  return float(np.linalg.norm(y - r) / np.linalg.norm(r))


def _weight(kind: str, shape, rng):
  """(the weight as ops/moe takes it, its float64 values from an independent dequantizer)."""
  if kind == "float":
    w = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return jnp.asarray(w), w.astype(np.float64)
  scale = 1e-3 if kind in ("Q4_K", "IQ3_S") else 2e-2
  blocks = quant.random_blocks(kind, shape, rng, scale=scale)
  ref = np.asarray(gguf.quants.dequantize(blocks, GGMLQuantizationType[kind]), np.float64).reshape(shape)
  return QTensor.from_gguf(blocks, kind, shape[-1]), ref


@functools.cache
def _experts(weights: str, E: int):
  rng = np.random.default_rng(1000 + 17 * E + sorted(WEIGHTS).index(weights))
  gq, dq, D, F = WEIGHTS[weights]
  (g, g64), (u, u64) = _weight(gq, (E, F, D), rng), _weight(gq, (E, F, D), rng)
  d, d64 = _weight(dq, (E, D, F), rng)
  return (g, u, d), (g64, u64, d64), D


def _routing(kind: str, T: int, E: int, K: int, rng) -> np.ndarray:
  """int32 [T, K] expert ids; distinct per token except `all_pairs_one_expert`."""
  if kind == "all_pairs_one_expert":                 # every (token, k) pair on one expert (repeated ids)
    return np.full((T, K), E // 2, np.int32)
  pool = np.arange(E)
  if kind == "unused_experts":                       # only K + 1 experts get tokens, the others none
    pool = rng.choice(E, K + 1, replace=False)
  ids = np.stack([rng.choice(pool, K, replace=False) for _ in range(T)])
  if kind == "one_expert_all_tokens":                # every token picks expert 1 (in a random slot)
    for t in range(T):
      if 1 not in ids[t]:
        ids[t, rng.integers(K)] = 1
  return ids.astype(np.int32)


def _oracle(x, ids, w, g64, u64, d64) -> np.ndarray:
  x = np.asarray(x, np.float64)
  out = np.zeros_like(x)
  for t in range(ids.shape[0]):
    for k in range(ids.shape[1]):
      e = ids[t, k]
      a, b = g64[e] @ x[t], u64[e] @ x[t]
      out[t] += float(w[t, k]) * (d64[e] @ (a / (1.0 + np.exp(-a)) * b))
  return out


def _inputs(T, E, K, D, routing, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((T, D)).astype(np.float32)
  ids = _routing(routing, T, E, K, rng)
  w = rng.random((T, K)).astype(np.float32)
  return x, ids, w


_grouped = jax.jit(moe_ops._moe_grouped, static_argnames=("n_experts", "rows_per_tile", "dequant_budget", "tiles_per_step"))
_dense = jax.jit(moe_ops._moe_dense, static_argnames=("n_experts",))


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("T,E,K", SIZES, ids=lambda v: str(v))
def test_grouped_matches_float64_oracle_and_dense(T, E, K, weights, routing, monkeypatch):
  (g, u, d), (g64, u64, d64), D = _experts(weights, E)
  x, ids, w = _inputs(T, E, K, D, routing, seed=zlib.crc32(repr((T, E, K, weights, routing)).encode()))
  counts = np.bincount(ids.reshape(-1), minlength=E)
  if routing in ("unused_experts", "all_pairs_one_expert"):
    assert (counts == 0).any()                                         # some experts receive no token
  if routing == "one_expert_all_tokens":
    assert counts[1] == T
  if routing == "all_pairs_one_expert":
    assert counts.max() == T * K

  want = _oracle(x, ids, w, g64, u64, d64)
  y = _grouped(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), g, u, d, n_experts=E)
  assert y.shape == (T, D) and y.dtype == jnp.float32
  assert np.isfinite(np.asarray(y)).all()
  assert _relerr(y, want) < TOL
  dense = _dense(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), g, u, d, n_experts=E)
  assert _relerr(y, dense) < TOL
  if T == 40 and isinstance(g, QTensor):            # one expert dequantized per tile, not all up front
    y0 = _grouped(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), g, u, d, n_experts=E, dequant_budget=0)
    assert _relerr(y0, want) < TOL
  # moe_ref dispatch: the grouped path exactly when T*k > E, the gather path otherwise; both match the oracle
  calls = []
  for name in ("_moe_grouped", "_moe_gather"):
    fn = getattr(moe_ops, name)
    monkeypatch.setattr(moe_ops, name, lambda *a, _fn=fn, _name=name, **kw: calls.append(_name) or _fn(*a, **kw))
  r = moe_ops.moe_ref(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), g, u, d)
  assert calls == ["_moe_grouped" if T * K > E else "_moe_gather"]
  assert _relerr(r, want) < TOL


@pytest.mark.parametrize("weights", ["Q4_K", "float_oddF"])
@pytest.mark.parametrize("variant", [dict(rows_per_tile=1), dict(rows_per_tile=3, dequant_budget=0),
                                     dict(rows_per_tile=64), dict(dequant_budget=0),
                                     dict(tiles_per_step=4), dict(rows_per_tile=3, tiles_per_step=3, dequant_budget=0),
                                     dict(rows_per_tile=1, tiles_per_step=16)],
                         ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_tile_sizes(weights, variant):
  """Tile boundaries (1 row per tile, odd tiles that split experts, one tile larger than any expert), several tiles
  per scan step, experts dequantized per tile instead of up front: all match the oracle."""
  T, E, K = 23, 10, 3
  (g, u, d), (g64, u64, d64), D = _experts(weights, E)
  for routing in ("random", "one_expert_all_tokens", "all_pairs_one_expert"):
    x, ids, w = _inputs(T, E, K, D, routing, seed=7)
    want = _oracle(x, ids, w, g64, u64, d64)
    y = _grouped(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), g, u, d, n_experts=E, **variant)
    assert _relerr(y, want) < TOL, routing


def test_static_shapes_deterministic_and_one_compile():
  """One trace per shape whatever the routing (all shapes static), and bitwise repeatable results."""
  T, E, K = 40, 16, 4
  (g, u, d), _, D = _experts("Q4_K", E)
  traces = []

  @jax.jit
  def f(x, ids, w):
    traces.append(1)
    return moe_ops._moe_grouped(x, ids, w, g, u, d, E)

  outs = {}
  for routing in ROUTINGS:
    x, ids, w = _inputs(T, E, K, D, routing, seed=3)
    outs[routing] = np.asarray(f(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w)))
    again = np.asarray(f(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w)))
    np.testing.assert_array_equal(again.view(np.uint32), outs[routing].view(np.uint32))
  assert len(traces) == 1


def _dot_precisions(jaxpr) -> list:
  """Precision of every dot_general in a jaxpr, sub-jaxprs (scan bodies) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(eqn.params["precision"])
    for sub in jax_core.jaxprs_in_params(eqn.params):
      found += _dot_precisions(sub)
  return found


def test_dots_ask_for_highest_precision():
  """Every dot of the grouped path asks for HIGHEST itself, whatever jax.default_matmul_precision says."""
  T, E, K = 5, 6, 2
  (g, u, d), _, D = _experts("float_oddF", E)
  x, ids, w = _inputs(T, E, K, D, "random", seed=0)
  with jax.default_matmul_precision("bfloat16"):
    jaxpr = jax.make_jaxpr(lambda *a: moe_ops._moe_grouped(*a, E))(x, ids, w, g, u, d)
  precs = _dot_precisions(jaxpr.jaxpr)
  assert len(precs) >= 3
  hi = jax.lax.Precision.HIGHEST
  assert all(p == (hi, hi) for p in precs), precs


def test_tile_rows():
  assert moe_ops.grouped_tile_rows(8 * 2048, 128) == 128        # Qwen3-30B-A3B prefill, 2048 tokens
  assert moe_ops.grouped_tile_rows(10, 6) == 8
  assert moe_ops.grouped_tile_rows(8 * 65536, 128) == 256
