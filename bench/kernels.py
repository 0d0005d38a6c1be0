"""Quantized-kernel benchmark: weight-byte GB/s of the Pallas kernels beside XLA and a measured copy bandwidth.

  python -m bench.kernels --out out/bench [--types IQ3_S,Q4_K] [--batches 1,4,16] [--parts a,b] [--check]

Cells (Qwen3-30B-A3B shapes: D = 2048, F = 768, 128 experts, top-8), each timed on random valid weights made on
the device (ops/repack.random_planes), random distinct routing per token and layer:
  copy   a device-to-device copy (x + 1 over 2 GiB, bytes read + written): the bandwidth ceiling;
  a/moe  one expert layer (gate/up 2048->768, SiLU, down 768->2048, router-weighted sum), timed over 8
         distinct layers in one jit so the weights come from HBM, not L2; per-layer numbers;
  a/proj a dense projection x[B, 2048] @ W[4096, 2048]^T over 16 distinct copies;
  b/step the routed-expert work of a decode step: 48 layers in one jitted call (layer l+1 takes layer l's output,
         RMS-normalised), so launch latency counts as in decoding; beside the Pallas step its floor, the same
         launches, grids and glue without weight bytes (`_floor_fn`), and both again with the calls queued back
         to back (`queued_seconds`: one wait at the end, no per-call host dispatch in the figure);
  launch_floor (--launch_floor 1,2,...) 48 x n chained trivial Pallas kernels, queued: the least any design
         with n kernels per layer costs, whatever its kernels do (`_chain_fn`); with it the read rate of XLA's
         sum over 2 GiB (`_read_bw`: below the copy figure on the H200, so not a ceiling).
Each layer's weights are their own arrays and jit arguments, as in the model (`--layer_weights separate`, the
default). `--layer_weights stacked` stacks them over layers ([L, E, F, D] planes) and each layer passes its index
to the kernels (`moe_pallas(..., layer=l)`: an operand sliced out of a stack would be copied whole by XLA first).
The routing comes in the weights' form: per-layer arrays for separate weights (slices of one [L, T, X] array would
cost two ~1 µs `memcpy32_post` per layer, which the model has not; scripts/gpu/memcpy_probe.py).
Waited calls of the separate form pass hundreds of weight buffers through each dispatch; compare forms queued. Layers
are unrolled as in the model (`--layer_loop scan`, stacked only, for a lax.scan). XLA reuses one compiled Triton kernel for
identical custom calls (`--compile_probe`: compile time of 1 and 8 identical calls; 2.7 s and 1.9 s on the H200).
Implementations: `pallas` (ops/moe_pallas, ops/qmatmul_pallas), `xla` (the jnp reference: gather the routed
slabs, dequantize, dot), `bf16` (dense bfloat16 weights, gather + dot; its own bytes).
GB/s counts the bytes of the distinct routed experts' packed weights (GGUF bytes: planes hold the same bytes);
`%copy` is that over the copy bandwidth. Median of --iters timed calls after warm-up. A progress bar runs over
the cells; every cell is a JSON line in --out/results.jsonl; a markdown table is printed last.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import NamedTuple

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "out/bench", "folder for results.jsonl")
flags.DEFINE_list("types", ["IQ3_S", "Q4_K", "Q8_0", "Q6_K", "IQ4_XS", "IQ4_NL", "Q5_K"], "quant types")
flags.DEFINE_list("batches", ["1", "4", "16"], "tokens per step")
flags.DEFINE_list("parts", ["a", "b"], "a: one layer + dense projection; b: 48-layer decode step")
flags.DEFINE_list("impls", ["pallas", "xla", "bf16"], "implementations")
flags.DEFINE_integer("layers", 48, "layers in part b")
flags.DEFINE_integer("iters", 10, "timed calls per cell (median)")
flags.DEFINE_boolean("check", False, "first compare the compiled kernels with the reference on small shapes")
flags.DEFINE_string("sweep", "", "JSON list of tunings {'gateup': {...}, 'down': {...}, 'proj': {...}}, each a dict "
                    "of ops.qmatmul_pallas.Tuning fields (BN, S, num_warps, num_stages, unroll, natural_b; gateup "
                    "also KS, the split of D over KS programs): part b/a at B=1 for each, before the main run")
flags.DEFINE_integer("sweep_layers", 16, "layers per sweep cell")
flags.DEFINE_list("shape", ["2048", "768", "128", "8", "4096"], "D, F, experts, top-k, projection rows (smoke tests)")
flags.DEFINE_boolean("interpret", False, "run the Pallas kernels in interpret mode (CPU smoke test only)")
flags.DEFINE_enum("layer_loop", "unroll", ["unroll", "scan"], "layers unrolled (as the model) or a lax.scan "
                  "(XLA's GPU while loop syncs with the host every iteration)")
flags.DEFINE_enum("layer_weights", "separate", ["separate", "stacked"], "each layer's weights as their own arrays "
                  "(as the model) or stacked over layers with a layer index into the kernels (forced by --layer_loop scan)")
flags.DEFINE_list("launch_floor", [], "kernels per layer, e.g. 1,2,6: first time --layers x n chained trivial "
                  "Pallas kernels (a 128-program grid each, no weight bytes), calls queued back to back: the least "
                  "any design with n launches per layer costs (_chain_fn)")
flags.register_validator("launch_floor", lambda v: all(s.isdigit() and int(s) > 0 for s in v),
                         "--launch_floor: expected positive integers (kernels per layer), e.g. 1,2,6")
flags.DEFINE_boolean("compile_probe", False, "time the compile of 1 and 8 identical Pallas MoE calls first")
flags.DEFINE_string("profile", None, "folder: after each type's cells, trace --iters calls of its part (b) Pallas step "
                    "at the first batch with jax.profiler (DIR/TYPE; summarise with scripts/gpu/trace_summary.py "
                    "--steps ITERS: per-kernel time per step and the device's idle gaps)")



class Shape(NamedTuple):
  """The cells' shapes: model width, expert FFN width, experts, experts per token, projection rows."""
  D: int = 2048
  F: int = 768
  E: int = 128
  TOPK: int = 8
  NPROJ: int = 4096


SHAPE = Shape()                  # Qwen3-30B-A3B


def sweep_tunings(ov: dict):
  """One --sweep entry -> (ops.moe_pallas.Tuning of the expert kernels, ops.qmatmul_pallas.Tuning of the projection
  or None); ValueError on a key that is no tuning field.

  >>> moe_t, proj_t = sweep_tunings({"gateup": {"BN": 8, "KS": 2}, "proj": {"S": 64}})
  >>> moe_t.gateup.BN, moe_t.ks, moe_t.down, proj_t.S
  (8, 2, None, 64)
  """
  from ops import moe_pallas, qmatmul_pallas
  extra = set(ov) - {"gateup", "down", "proj"}
  if extra:
    raise ValueError(f"sweep keys {sorted(extra)}: expected gateup, down, proj")
  tile = lambda d: None if d is None else qmatmul_pallas.Tuning(**d)  # noqa: E731
  gateup = dict(ov.get("gateup") or {})
  ks = gateup.pop("KS", None)
  return (moe_pallas.Tuning(gateup=tile(gateup or None), down=tile(ov.get("down")), ks=ks), tile(ov.get("proj")))


def median_seconds(fn, *args, iters):
  """Median seconds of `iters` calls of fn(*args), each waited for, after two untimed (compiling) calls."""
  import jax
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t)
  return statistics.median(ts)


def _copy_bw(iters):
  import jax
  import jax.numpy as jnp
  a = jax.random.bits(jax.random.PRNGKey(0), (512 << 20,), jnp.uint32)          # 2 GiB
  nbytes = a.nbytes
  f = jax.jit(lambda v: v + 1, donate_argnums=0)
  for _ in range(3):
    a = f(a)
  jax.block_until_ready(a)
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    a = jax.block_until_ready(f(a))
    ts.append(time.perf_counter() - t)
  return 2 * nbytes / statistics.median(ts) / 1e9


def _read_bw(iters):
  """Read-only rate of XLA's sum over 2 GiB (bytes read / time). Not a ceiling: on the H200 it measured below the
  copy figure (2,955-3,049 against 3,267-3,373 GB/s, PERF); printed beside the launch floor for comparison."""
  import jax
  import jax.numpy as jnp
  a = jax.random.bits(jax.random.PRNGKey(0), (512 << 20,), jnp.uint32)
  f = jax.jit(lambda v: jnp.sum(v, dtype=jnp.uint32))
  return a.nbytes / median_seconds(f, a, iters=iters) / 1e9


def _shapes(sh: Shape):
  """gate, up, down of one layer."""
  return (sh.E, sh.F, sh.D), (sh.E, sh.F, sh.D), (sh.E, sh.D, sh.F)


def _experts(key, qtype, layers, separate=False, sh: Shape = SHAPE):
  """Random valid experts: (gate, up, down) QTensors stacked over layers (planes [L, E, rows, nb, ...]), or with
  `separate` a list of L such triples, one layer's arrays each (the same blocks either way)."""
  import jax
  import jax.numpy as jnp
  from ops import repack
  from ops.qtensor import QTensor
  gen = jax.jit(lambda k, shape: repack.random_planes(k, qtype, shape), static_argnums=1)
  per = [[gen(jax.random.fold_in(key, 1000 * i + l), shape) for l in range(layers)] for i, shape in enumerate(_shapes(sh))]
  if separate:
    return [tuple(QTensor(per[i][l], qtype, shape[-1], "pallas") for i, shape in enumerate(_shapes(sh)))
            for l in range(layers)]
  return tuple(QTensor(tuple(jnp.stack([p[j] for p in per[i]]) for j in range(len(per[i][0]))), qtype, shape[-1],
                       "pallas") for i, shape in enumerate(_shapes(sh)))


def _bf16_experts(key, layers, separate=False, sh: Shape = SHAPE):
  import jax
  import jax.numpy as jnp
  per = [[jax.random.normal(jax.random.fold_in(key, 1000 * i + l), s, jnp.bfloat16) * 0.02 for l in range(layers)]
         for i, s in enumerate(_shapes(sh))]
  return [tuple(p[l] for p in per) for l in range(layers)] if separate else tuple(jnp.stack(p) for p in per)


def _layer(layers, l):
  """Layer l's (gate, up, down) and the index the kernels take: (triple, None) for separate weights, (the stacks,
  l) for stacked ones."""
  import jax.numpy as jnp
  return (layers[l], None) if isinstance(layers, list) else (layers, jnp.int32(l))


def _routing(key, layers, T, separate=False, sh: Shape = SHAPE):
  """Expert ids [L, T, X] int32 and router weights [L, T, X]; with `separate` two lists of L per-layer arrays,
  each its own buffer, as the model's router hands each layer its own (slicing layer l out of a [L, ...] jit
  argument costs two device copies per layer, `memcpy32_post`)."""
  import jax
  import jax.numpy as jnp
  r = jax.random.uniform(key, (layers, T, sh.E))
  w, ids = jax.lax.top_k(r, sh.TOPK)
  ids, w = ids.astype(jnp.int32), (w / jnp.sum(w, -1, keepdims=True)).astype(jnp.float32)
  return (list(ids), list(w)) if separate else (ids, w)


def _routed_bytes(ids, per_expert_bytes):
  import numpy as np
  ids = np.asarray(ids)
  return int(sum(len(np.unique(ids[l])) for l in range(len(ids))) * per_expert_bytes)


def _next_x(y):
  """The step's glue between layers: layer l's output, RMS-normalised, is layer l+1's input."""
  import jax
  import jax.numpy as jnp
  return y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)


def _step_fn(impl, tuning=None, layer_loop="unroll", interpret=False):
  """(x, ids [n, T, X], w [n, T, X], layers) -> x after layers 0 .. n-1: `layers` a list of per-layer (gate, up,
  down) or the stacked triple read in place; unrolled (as the model) or a lax.scan (--layer_loop). tuning: the
  Pallas MoE kernels' (ops.moe_pallas.Tuning); interpret: the kernels in interpret mode (CPU)."""
  import jax
  import jax.numpy as jnp
  from ops import moe_pallas
  from ops.qtensor import QTensor, as_dense

  def sel(w, l, ids):            # layer l's routed experts, one gather (no copy of the layer's slab)
    idx = (ids,) if l is None else (l, ids)
    if isinstance(w, QTensor):
      return w.replace(planes=tuple(p[idx] for p in w.planes))
    return w[idx]

  def layer(x, l, ids, w, g, u, d):            # l: the index into stacked weights, None for a layer's own arrays
    if impl == "pallas":
      y = moe_pallas.moe_pallas(x, ids, w, g, u, d, layer=l, tuning=tuning, interpret=interpret)
    elif impl == "xla":                       # the reference's math (ops/moe._moe_gather) on layer l's slabs
      gg, uu, dd = (as_dense(sel(t, l, ids)) for t in (g, u, d))
      h = jax.nn.silu(jnp.einsum("td,tkfd->tkf", x, gg)) * jnp.einsum("td,tkfd->tkf", x, uu)
      y = jnp.einsum("tkd,tk->td", jnp.einsum("tkf,tkdf->tkd", h, dd), w)
    else:
      y = _bf16_moe(x, ids, w, *((g, u, d) if l is None else (g[l], u[l], d[l])))
    return _next_x(y)

  def step(x, ids, w, layers):
    if layer_loop == "scan":
      if isinstance(layers, list):
        raise ValueError("bench.kernels --layer_loop scan: needs --layer_weights stacked")
      def body(x, xs):
        l, i, ww = xs
        return layer(x, l, i, ww, *layers), None
      return jax.lax.scan(body, x, (jnp.arange(ids.shape[0], dtype=jnp.int32), ids, w))[0]
    for l in range(len(ids)):                # unrolled as the model's layers; one kernel instance (same config)
      (g, u, d), li = _layer(layers, l)
      x = layer(x, li, ids[l], w[l], g, u, d)
    return x

  return jax.jit(step)


def _floor_fn(qtype, interpret=False, sh: Shape = SHAPE):
  """(x, ids [n, T, X], w [n, T, X]) -> x: part (b)'s step with its launches and glue but no weight bytes. Per layer
  two Pallas calls with the grid, warps and stages of the type's gate/up (F/BN x P programs) and down (D/BN x P)
  kernels, in which program (i, p) only copies a BN-wide slice of its input row (h[p] from x[t], then y[p] =
  w[p] h[p] from h), then the step's top-k sum and norm. The real step's time over this one says how much of it
  any dequantization or tiling inside the kernels could still win back."""
  import functools
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from ops import moe_pallas, quant
  from ops import qmatmul_pallas as qp
  D, F = sh.D, sh.F
  blk = quant.GGML_TYPES[qtype][0]
  cg = moe_pallas._cfg("gateup", qtype, F, D // blk, None)
  cd = moe_pallas._cfg("down", qtype, D, F // blk, None)

  def gateup_like(x_ref, o_ref, *, X, BN):
    p = pl.program_id(1)
    rows = jnp.minimum(pl.program_id(0) * BN + jax.lax.iota(jnp.int32, BN), F - 1)
    o_ref[p, rows] = x_ref[p // X, rows]                                  # F <= D

  def down_like(w_ref, h_ref, o_ref, *, BN):
    p = pl.program_id(1)
    rows = jnp.minimum(pl.program_id(0) * BN + jax.lax.iota(jnp.int32, BN), D - 1)
    o_ref[p, rows] = w_ref[p] * h_ref[p, rows % F]

  def run(x, ids, w):
    T, X = ids[0].shape
    P = T * X
    for l in range(len(ids)):
      h = pl.pallas_call(functools.partial(gateup_like, X=X, BN=cg.BN), grid=(pl.cdiv(F, cg.BN), P),
                         out_shape=jax.ShapeDtypeStruct((P, F), jnp.float32), compiler_params=qp.compiler_params(cg),
                         interpret=interpret, name="floor_gateup")(x)
      y = pl.pallas_call(functools.partial(down_like, BN=cd.BN), grid=(pl.cdiv(D, cd.BN), P),
                         out_shape=jax.ShapeDtypeStruct((P, D), jnp.float32), compiler_params=qp.compiler_params(cd),
                         interpret=interpret, name="floor_down")(w[l].reshape(P), h).reshape(T, X, D)
      out = y[:, 0]
      for k in range(1, X):                  # the top-k sum in moe_pallas's order
        out = out + y[:, k]
      x = _next_x(out)
    return x

  return jax.jit(run)


def _chain_fn(n, layers, interpret=False):
  """x [B, D] -> x + layers * n: `layers` x n chained Pallas kernels, each a grid of 128 programs in which program
  i adds 1 to columns [i*D/128, (i+1)*D/128) of its input. Every kernel waits for the one before (its input is
  the previous output), as a decode step's kernels do, and reads no weights: the time is launch latency and
  dependency only, the floor under any design that runs n kernels per layer."""
  import functools
  import jax
  from jax.experimental import pallas as pl
  progs = 128

  def kern(x_ref, o_ref, *, bw):
    cols = pl.ds(pl.program_id(0) * bw, bw)
    o_ref[:, cols] = x_ref[:, cols] + 1.0

  def run(x):
    bw = x.shape[1] // progs
    call = pl.pallas_call(functools.partial(kern, bw=bw), grid=(progs,),
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret, name="floor_chain")
    for _ in range(layers * n):
      x = call(x)
    return x

  return jax.jit(run)


def queued_seconds(fn, x, *rest, iters):
  """Seconds per call of x = fn(x, *rest) run `iters` times back to back with one wait at the end (after two
  untimed calls): the device's time per call once the host runs ahead, without a per-call dispatch in it."""
  import jax
  x = jax.block_until_ready(fn(jax.block_until_ready(fn(x, *rest)), *rest))
  t = time.perf_counter()
  for _ in range(iters):
    x = fn(x, *rest)
  jax.block_until_ready(x)
  return (time.perf_counter() - t) / iters


def _bf16_moe(x, ids, w, g, u, d):
  import jax
  import jax.numpy as jnp
  xb = x.astype(jnp.bfloat16)
  gg, uu, dd = g[ids], u[ids], d[ids]                   # [T, X, F, D] routed slabs
  h = jax.nn.silu(jnp.einsum("td,tkfd->tkf", xb, gg, preferred_element_type=jnp.float32)) * \
      jnp.einsum("td,tkfd->tkf", xb, uu, preferred_element_type=jnp.float32)
  y = jnp.einsum("tkf,tkdf->tkd", h.astype(jnp.bfloat16), dd, preferred_element_type=jnp.float32)
  return jnp.einsum("tkd,tk->td", y, w)


def _proj_fn(impl, tuning=None, interpret=False, sh: Shape = SHAPE):
  """(x, W: 16 copies [N, K] in a list, or stacked [16, N, K]) -> sum of the 16 projections, unrolled (as the
  model's layers): each call reads copy l in place. A lax.scan here would add a device wait per iteration (XLA's
  GPU while loop), comparable to a projection's own 5-20 µs. tuning: the Pallas kernel's (ops.qmatmul_pallas.Tuning)."""
  import jax
  import jax.numpy as jnp
  from ops import qmatmul, qmatmul_pallas

  def one(x, l, w):                          # l: the index into a stack, None for a copy's own arrays
    if impl == "pallas":
      return qmatmul_pallas.qmatmul_pallas(x, w, layer=l, tuning=tuning, interpret=interpret)
    if impl == "xla":
      return qmatmul.qmatmul_ref(x, w if l is None else w.replace(planes=tuple(p[l] for p in w.planes)))
    return jnp.einsum("bk,nk->bn", x.astype(jnp.bfloat16), w if l is None else w[l], preferred_element_type=jnp.float32)

  def run(x, ws):
    n = len(ws) if isinstance(ws, list) else (ws.planes[0] if hasattr(ws, "planes") else ws).shape[0]
    acc = jnp.zeros((x.shape[0], sh.NPROJ), jnp.float32)
    for l in range(n):
      w, li = _layer(ws, l)
      acc = acc + one(x, li, w)
    return acc

  return jax.jit(run)


def _compile_probe(q, sh: Shape = SHAPE):
  """Compile time of n identical Pallas MoE calls on n separate per-layer weights (unrolled), n = 1 and 8: does
  XLA reuse one compiled Triton kernel for identical custom calls?"""
  import jax
  import jax.numpy as jnp
  from ops import moe_pallas, repack
  from ops.qtensor import QTensor
  rows = []
  for n in (1, 8):
    ws = [tuple(QTensor(repack.random_planes(jax.random.PRNGKey(100 * l + i), q, s), q, s[-1], "pallas")
                for i, s in enumerate(_shapes(sh))) for l in range(n)]
    x = jnp.ones((1, sh.D), jnp.float32)
    ids = jnp.arange(sh.TOPK, dtype=jnp.int32)[None]
    w = jnp.full((1, sh.TOPK), 1.0 / sh.TOPK, jnp.float32)

    def f(x, ws):
      for g, u, d in ws:
        x = moe_pallas.moe_pallas(x, ids, w, g, u, d)
      return x

    t = time.perf_counter()
    jax.jit(f).lower(x, ws).compile()
    rows.append({"cell": "compile_probe", "type": q, "calls": n, "compile_s": time.perf_counter() - t})
    print(f"compile probe {q}: {n} identical MoE calls compile in {rows[-1]['compile_s']:.1f} s", flush=True)
    del ws
  return rows


def _check(types, interpret=False):
  """Compiled kernels vs the reference on small random shapes (odd N, several experts, B in 1, 3, 8)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from ops import moe as moe_ops
  from ops import moe_pallas, qmatmul, qmatmul_pallas, quant
  from ops.qtensor import QTensor
  rng = np.random.default_rng(0)
  rows = []
  for q in types:
    K = 1024
    w = QTensor.from_gguf(quant.random_blocks(q, (333, K), rng), q, K)
    g, u = (QTensor.from_gguf(quant.random_blocks(q, (6, 256, 512), rng), q, 512) for _ in range(2))
    d = QTensor.from_gguf(quant.random_blocks(q, (6, 512, 256), rng), q, 256)
    for B in (1, 3, 8, 16):
      x = jnp.asarray(rng.standard_normal((B, K)).astype(np.float32))
      y = qmatmul_pallas.qmatmul_pallas(x, w, interpret=interpret)
      with jax.default_matmul_precision("highest"):      # XLA's f32 dot is TF32 by default on GPU
        r = qmatmul.qmatmul_ref(x, w)
      e1 = float(jnp.linalg.norm(y - r) / jnp.linalg.norm(r))
      xm = jnp.asarray(rng.standard_normal((B, 512)).astype(np.float32))
      ids = jnp.asarray(np.stack([rng.choice(6, 2, replace=False) for _ in range(B)]).astype(np.int32))
      wt = jnp.asarray(rng.random((B, 2)).astype(np.float32))
      ym = moe_pallas.moe_pallas(xm, ids, wt, g, u, d, interpret=interpret)
      with jax.default_matmul_precision("highest"):
        rm = moe_ops.moe_ref(xm, ids, wt, g, u, d)
      e2 = float(jnp.linalg.norm(ym - rm) / jnp.linalg.norm(rm))
      rows.append({"cell": "check", "type": q, "B": B, "qmatmul_relerr": e1, "moe_relerr": e2,
                   "ok": bool(e1 < 1e-4 and e2 < 1e-4)})
      print(f"check {q} B={B}: qmatmul {e1:.2e} moe {e2:.2e} {'ok' if rows[-1]['ok'] else 'FAIL'}", flush=True)
  return rows


class _Progress:
  def __init__(self, total):
    self.total, self.done, self.t0 = total, 0, time.time()

  def step(self, label):
    self.done += 1
    n = 30 * self.done // max(self.total, 1)
    print(f"[{'#' * n}{'.' * (30 - n)}] {self.done}/{self.total} {time.time() - self.t0:6.0f}s {label}",
          file=sys.stderr, flush=True)


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  from ops import quant, repack
  from ops.qtensor import QTensor

  sh = Shape(*(int(v) for v in FLAGS.shape))
  D, F, E, TOPK, NPROJ = sh
  SWEEP_LAYERS = FLAGS.sweep_layers
  interp = FLAGS.interpret
  os.makedirs(FLAGS.out, exist_ok=True)
  out_path = os.path.join(FLAGS.out, "results.jsonl")
  dev = jax.devices()[0]
  meta = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
          "date": time.strftime("%Y-%m-%d %H:%M:%S")}
  results = []

  def emit(rec):
    rec = dict(meta, **rec)
    results.append(rec)
    with open(out_path, "a") as f:
      f.write(json.dumps(rec) + "\n")

  if FLAGS.check:
    for r in _check(FLAGS.types, interp):
      emit(r)
  if FLAGS.compile_probe:
    for r in _compile_probe(FLAGS.types[0], sh):
      emit(r)

  copy = _copy_bw(FLAGS.iters)
  emit({"cell": "copy", "GBps": copy, "argv": sys.argv[1:]})
  print(f"copy bandwidth {copy:.0f} GB/s (read + write)", flush=True)
  if FLAGS.launch_floor:                     # beside the floor: XLA's read rate (not a ceiling, see _read_bw)
    rd = _read_bw(FLAGS.iters)
    emit({"cell": "read", "GBps": rd})
    print(f"XLA sum read rate {rd:.0f} GB/s (over 2 GiB)", flush=True)

  for n in (int(v) for v in FLAGS.launch_floor):
    x = jax.random.normal(jax.random.PRNGKey(3), (1, D), jnp.float32)
    t = queued_seconds(_chain_fn(n, FLAGS.layers, FLAGS.interpret), x, iters=FLAGS.iters)
    emit({"cell": "launch_floor", "per_layer": n, "layers": FLAGS.layers, "ms": t * 1e3,
          "us_per_launch": t * 1e6 / (n * FLAGS.layers)})
    print(f"launch floor: {n} kernel(s) per layer x {FLAGS.layers} layers: {t * 1e3:.3f} ms per step "
          f"({t * 1e6 / (n * FLAGS.layers):.2f} us per launch)", flush=True)

  batches = [int(b) for b in FLAGS.batches]
  try:
    sweeps = json.loads(FLAGS.sweep) if FLAGS.sweep else []
    sweep_tuned = [sweep_tunings(ov) for ov in sweeps]
  except (TypeError, ValueError) as e:
    raise app.UsageError(f"--sweep: {e}") from None
  n_cells = len(FLAGS.types) * (len(sweeps) + len(batches) * len(FLAGS.impls) * len(FLAGS.parts))
  prog = _Progress(n_cells)
  key = jax.random.PRNGKey(1)
  L = FLAGS.layers
  sep = FLAGS.layer_weights == "separate" and FLAGS.layer_loop == "unroll"

  def proj_copies(stack):                    # the projection's 16 copies, as --layer_weights says
    if not sep:
      return stack
    if isinstance(stack, QTensor):
      return [stack.replace(planes=tuple(p[i] for p in stack.planes)) for i in range(stack.planes[0].shape[0])]
    return [stack[i] for i in range(stack.shape[0])]
  for q in FLAGS.types:
    per_expert = 3 * quant.row_bytes(q, D) * F            # gate + up (F rows of D) + down (D rows of F): equal
    layers = _experts(jax.random.fold_in(key, sum(map(ord, q))), q, L, separate=sep, sh=sh)
    wproj = proj_copies(QTensor(repack.random_planes(jax.random.PRNGKey(7), q, (16, NPROJ, D)), q, D, "pallas"))
    proj_bytes = quant.row_bytes(q, D) * NPROJ
    for si, (ov, (moe_t, proj_t)) in enumerate(zip(sweeps, sweep_tuned)):
      ids, w = _routing(jax.random.PRNGKey(11), L, 1, separate=sep, sh=sh)
      x = jax.random.normal(jax.random.PRNGKey(3), (1, D), jnp.float32)
      rec = {"cell": "sweep", "type": q, "B": 1, "overrides": ov}
      try:
        t = median_seconds(_step_fn("pallas", moe_t, FLAGS.layer_loop, interp), x, ids[:SWEEP_LAYERS],
                           w[:SWEEP_LAYERS], layers, iters=FLAGS.iters)
        rec.update(ms=t * 1e3, layers=SWEEP_LAYERS, GBps=_routed_bytes(ids[:SWEEP_LAYERS], per_expert) / t / 1e9)
        rec["pct_copy"] = 100 * rec["GBps"] / copy
        if proj_t is not None:
          tp = median_seconds(_proj_fn("pallas", proj_t, interp, sh), x, wproj, iters=FLAGS.iters) / 16
          rec.update(proj_us=tp * 1e6, proj_GBps=proj_bytes / tp / 1e9)
      except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a result too
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      emit(rec)
      prog.step(f"sweep {q} {si}: {rec.get('GBps', 0):.0f} GB/s {rec.get('error', '')[:80]}")
    for impl in sorted(FLAGS.impls, key=lambda i: i == "bf16"):   # bf16 last: it replaces the weights
      if impl == "bf16":
        if q != FLAGS.types[0]:
          continue
        del layers
        layers = _bf16_experts(key, L, separate=sep, sh=sh)
        wp = proj_copies(jax.random.normal(key, (16, NPROJ, D), jnp.bfloat16))
      else:
        wp = wproj
      for B in batches:
        ids, w = _routing(jax.random.fold_in(jax.random.PRNGKey(5), B), L, B, separate=sep, sh=sh)
        x = jax.random.normal(jax.random.PRNGKey(3), (B, D), jnp.float32)
        pe = 3 * 2 * D * F if impl == "bf16" else per_expert
        qn = "BF16" if impl == "bf16" else q
        for part in FLAGS.parts:
          rec = {"type": qn, "impl": impl, "B": B, "cell": part}
          try:
            if part == "b":
              t = median_seconds(_step_fn(impl, None, FLAGS.layer_loop, interp), x, ids, w, layers, iters=FLAGS.iters)
              nbytes = _routed_bytes(ids, pe)
              rec.update(layers=L, ms=t * 1e3, GBps=nbytes / t / 1e9)
              rec["queued_ms"] = 1e3 * queued_seconds(_step_fn(impl, None, FLAGS.layer_loop, interp), x, ids, w, layers,
                                                      iters=FLAGS.iters)
              if impl == "pallas":     # the same step without weight bytes: launches, grids and glue only
                floor = _floor_fn(q, interp, sh)
                rec["floor_ms"] = 1e3 * median_seconds(floor, x, ids, w, iters=FLAGS.iters)
                rec["floor_queued_ms"] = 1e3 * queued_seconds(floor, x, ids, w, iters=FLAGS.iters)
            else:
              n1 = min(8, L)
              t = median_seconds(_step_fn(impl, None, FLAGS.layer_loop, interp), x, ids[:n1], w[:n1], layers, iters=FLAGS.iters) / n1
              nbytes = _routed_bytes(ids[:1], pe)
              tp = median_seconds(_proj_fn(impl, None, interp, sh), x, wp, iters=FLAGS.iters) / 16
              pb = 2 * NPROJ * D if impl == "bf16" else proj_bytes
              rec.update(layer_us=t * 1e6, GBps=_routed_bytes(ids[:n1], pe) / n1 / t / 1e9,
                         proj_us=tp * 1e6, proj_GBps=pb / tp / 1e9)
            rec["pct_copy"] = 100 * rec["GBps"] / copy
          except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
          emit(rec)
          prog.step(f"{qn} {impl} B={B} {part}: {rec.get('GBps', 0):.0f} GB/s {rec.get('error', '')[:80]}")
    if FLAGS.profile:      # where a part (b) step's time goes: kernels, the fusions between them, idle gaps
      if "bf16" in FLAGS.impls and q == FLAGS.types[0]:       # the bf16 cells replaced the quantized experts
        layers = _experts(jax.random.fold_in(key, sum(map(ord, q))), q, L, separate=sep, sh=sh)
      B = batches[0]
      ids, w = _routing(jax.random.fold_in(jax.random.PRNGKey(5), B), L, B, separate=sep, sh=sh)
      x = jax.random.normal(jax.random.PRNGKey(3), (B, D), jnp.float32)
      fn = _step_fn("pallas", None, FLAGS.layer_loop, interp)
      jax.block_until_ready(fn(x, ids, w, layers))
      with jax.profiler.trace(os.path.join(FLAGS.profile, q), create_perfetto_trace=True):
        for _ in range(FLAGS.iters):
          y = fn(x, ids, w, layers)
        jax.block_until_ready(y)
      print(f"profile {q}: {FLAGS.iters} part (b) steps at B = {B} traced into {FLAGS.profile}/{q}", flush=True)
    del layers

  # markdown table, last
  print(f"\n{meta['device']}, jax {meta['jax']}, {meta['date']}; copy {copy:.0f} GB/s\n")
  print("| type | impl | B | b: 48-layer step ms | b: floor ms | b: queued step / floor ms | b: GB/s | b: % copy "
        "| a: layer µs | a: GB/s | a: proj µs | a: proj GB/s |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  rows = {}
  for r in results:
    if r.get("cell") in ("a", "b"):
      rows.setdefault((r["type"], r["impl"], r["B"]), {})[r["cell"]] = r
  f = lambda r, k, fmt: (fmt % r[k]) if r and k in r else ("err" if r and "error" in r else "")
  for (q, impl, B), c in rows.items():
    a, b = c.get("a"), c.get("b")
    print(f"| {q} | {impl} | {B} | {f(b, 'ms', '%.3f')} | {f(b, 'floor_ms', '%.3f')} | {f(b, 'queued_ms', '%.3f')} / {f(b, 'floor_queued_ms', '%.3f')} | {f(b, 'GBps', '%.0f')} | {f(b, 'pct_copy', '%.0f')} | "
          f"{f(a, 'layer_us', '%.1f')} | {f(a, 'GBps', '%.0f')} | {f(a, 'proj_us', '%.1f')} | {f(a, 'proj_GBps', '%.0f')} |")
  for r in results:
    if r.get("cell") == "sweep":
      print(f"sweep {r['type']} {json.dumps(r['overrides'])}: "
            + (f"{r['ms']:.3f} ms {r['GBps']:.0f} GB/s {r['pct_copy']:.0f}%" if "ms" in r else "")
            + (f" proj {r['proj_GBps']:.0f} GB/s" if "proj_GBps" in r else "") + r.get("error", ""))


if __name__ == "__main__":
  from decode import cli
  cli.run(main)                    # expected failures: one line, exit 1 (decode.cli)
