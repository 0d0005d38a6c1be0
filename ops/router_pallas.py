"""MoE routing (router logits, softmax or sigmoid scores, top-k, weights) as two Pallas kernels (Triton lowering),
beside the reference `route_ref` (the model's jnp ops: a float32 dot, jax.nn.softmax / sigmoid, lax.top_k).

Why: batch invariance, as ops/rmsnorm_pallas. XLA computes the router dot of a 4-token verify pass in another order
than a 1-token step (9.5e-7 apart on the H200 for 512 experts; `scripts/gpu/batch_invariance.py`), and a router
that sorts 512 close sigmoid scores turns last-bit differences into a different expert, then a different token. The
kernels compute every token's row with the same code whatever T is. They also replace ~6 small XLA kernels per
layer (dot, softmax, sort, gather, normalisation) with two.

  logits  grid (E / BE,): a program holds BE router rows and walks D in DC-wide chunks, one sequential float32
          accumulation per token (a static loop over the T tokens: each token's arithmetic is the same for any T).
          BE, DC and the warps come from `Tuning` (its table `TUNING`: measured on the H200, docs/PERF.md).
  route   grid (T,): scores (softmax over E, or sigmoid), selection = scores (+ the selection bias), then K rounds
          of argmax (ties to the lower index, as lax.top_k) that pick an expert and mask it; the weights are the
          picked scores, normalised over the K picks (norm_topk) and scaled. Outputs are padded to KP = next power
          of two >= K and sliced.

Takes E and D powers of two and T <= MAX_T (decode, verify); anything else runs the reference.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops.qtensor import QTensor
from ops.tuning import fill

IMPLS = ("ref", "pallas", "interpret")
MAX_T = 16
NORM_EPS = 6.103515625e-5          # the floor of the weights' sum under norm_topk (llama.cpp's)


class Tuning(NamedTuple):
  """The kernels' tuning; a field left None takes `TUNING`'s. programs: logits programs per call (a program holds
  BE = E / programs router rows, 1 .. 16), dc: the D chunk, warps: the logits kernel's, route_warps: the top-k
  kernel's (one warp reduces E <= 512 scores with shuffles alone)."""
  programs: int | None = None
  dc: int | None = None
  warps: int | None = None
  route_warps: int | None = None


# 32 programs, chunk 256 and 4 warps took 6.3 us a call on the 30B shape (E 128 x D 2048, 1 MB of float32: the
# latency of 8 dependent chunk loads, not bandwidth); `scripts/gpu/glue_bench.py` compares.
TUNING = Tuning(programs=64, dc=2048, warps=8, route_warps=1)


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def supported(T: int, E: int, D: int, K: int) -> bool:
  return 1 <= T <= MAX_T and _pow2(E) and _pow2(D) and 1 <= K <= E


def route_ref(logits_TE, bias_E, *, routing: str, top_k: int, norm_topk: bool, routed_scale: float):
  """(ids [T, X] int32, weights [T, X] float32) from router logits: the model's routing."""
  if routing == "softmax":
    probs = jax.nn.softmax(logits_TE, axis=-1)
    select = probs
  else:
    probs = jax.nn.sigmoid(logits_TE)
    select = probs + (0.0 if bias_E is None else bias_E.astype(jnp.float32))
  _, ids = jax.lax.top_k(select, top_k)
  ids = ids.astype(jnp.int32)
  w = jnp.take_along_axis(probs, ids, axis=-1)
  if norm_topk:
    w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), NORM_EPS)
  if routed_scale not in (0.0, 1.0):
    w = w * routed_scale
  return ids, w


def logits_tiling(E: int, D: int, tuning: Tuning | None = None) -> tuple[int, int]:
  """(BE router rows per program, D chunk) for E experts and width D under `tuning` (over TUNING)."""
  t = fill(tuning, TUNING)
  return max(1, min(16, E // t.programs)), min(t.dc, D)


def _logits_kernel(x_ref, w_ref, o_ref, *, T: int, BE: int, D: int, dc: int):
  e0 = pl.program_id(0) * BE

  def body(c, accs):
    w = w_ref[pl.ds(e0, BE), pl.ds(c * dc, dc)]                              # [BE, dc]
    return tuple(a + jnp.sum(w * x_ref[t, pl.ds(c * dc, dc)][None, :], axis=1) for t, a in enumerate(accs))

  accs = jax.lax.fori_loop(0, D // dc, body, tuple(jnp.zeros((BE,), jnp.float32) for _ in range(T)))
  for t, a in enumerate(accs):
    o_ref[t, pl.ds(e0, BE)] = a


def _route_kernel(l_ref, *refs, E: int, K: int, KP: int, softmax: bool, has_bias: bool, norm_topk: bool,
                  scale: float):
  b_ref, ids_ref, w_ref = refs if has_bias else (None, *refs)
  t = pl.program_id(0)
  ids, w = route_row(l_ref[t, :], b_ref[...] if has_bias else None, E=E, K=K, KP=KP, softmax=softmax,
                     norm_topk=norm_topk, scale=scale)
  ids_ref[t, :] = ids
  w_ref[t, :] = w


def route_row(lg, bias, *, E: int, K: int, KP: int, softmax: bool, norm_topk: bool, scale: float):
  """One token's routing inside a kernel: (ids [KP] int32, weights [KP] float32; entries from K on are 0) from its
  logits [E] and the selection bias (or None): the route kernel's ops, also run by a MoE kernel that routes for
  itself (ops.moe_pallas, Tunings.fuse "topk")."""
  if softmax:
    ex = jnp.exp(lg - jnp.max(lg))
    probs = ex / jnp.sum(ex)
    select = probs
  else:
    probs = 1.0 / (1.0 + jnp.exp(-lg))
    select = probs + bias if bias is not None else probs
  e_iota = jax.lax.broadcasted_iota(jnp.int32, (E,), 0)
  k_iota = jax.lax.broadcasted_iota(jnp.int32, (KP,), 0)
  ids = jnp.zeros((KP,), jnp.int32)
  w = jnp.zeros((KP,), jnp.float32)
  for j in range(K):
    i = jnp.argmax(select).astype(jnp.int32)
    hit = e_iota == i
    ids = jnp.where(k_iota == j, i, ids)
    w = jnp.where(k_iota == j, jnp.sum(jnp.where(hit, probs, 0.0)), w)         # probs[i], exactly
    select = jnp.where(hit, -jnp.inf, select)
  if norm_topk:
    w = w / jnp.maximum(jnp.sum(w), NORM_EPS)
  if scale not in (0.0, 1.0):
    w = w * scale
  return ids, w


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def logits_pallas(x_TD, w_ND, *, interpret: bool = False, tuning: Tuning | None = None):
  """x @ w.T [T, N] for a float matrix w [N, D] (N and D powers of two, T <= MAX_T) on the logits kernel: every
  token's row summed in the same order whatever T is (the router's logits; also a hybrid model's shared-expert
  gate, N = 1)."""
  T, D = x_TD.shape
  N = w_ND.shape[0]
  t = fill(tuning, TUNING)
  BE, dc = logits_tiling(N, D, t)
  cp = plgpu.CompilerParams(num_warps=t.warps, num_stages=2)
  return pl.pallas_call(functools.partial(_logits_kernel, T=T, BE=BE, D=D, dc=dc),
                        out_shape=jax.ShapeDtypeStruct((T, N), jnp.float32), grid=(N // BE,), compiler_params=cp,
                        interpret=interpret, name="router_logits")(x_TD.astype(jnp.float32), w_ND.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("routing", "top_k", "norm_topk", "routed_scale", "interpret", "tuning"))
def route_pallas(x_TD, router_ED, bias_E, *, routing: str, top_k: int, norm_topk: bool, routed_scale: float,
                 interpret: bool = False, tuning: Tuning | None = None):
  """(ids [T, X] int32, weights [T, X] float32) for tokens x (the normed hidden states) and a float router.
  tuning (static): the fields to set over TUNING."""
  logits = logits_pallas(x_TD, router_ED, interpret=interpret, tuning=tuning)
  return topk_pallas(logits, bias_E, routing=routing, top_k=top_k, norm_topk=norm_topk, routed_scale=routed_scale,
                     interpret=interpret, tuning=tuning)


@functools.partial(jax.jit, static_argnames=("routing", "top_k", "norm_topk", "routed_scale", "interpret", "tuning"))
def topk_pallas(logits_TE, bias_E, *, routing: str, top_k: int, norm_topk: bool, routed_scale: float,
                interpret: bool = False, tuning: Tuning | None = None):
  """(ids [T, X] int32, weights [T, X] float32) from router logits [T, E] (the route kernel alone: the logits came
  from another kernel, e.g. ops.norm_router_pallas)."""
  T, E = logits_TE.shape
  t = fill(tuning, TUNING)
  KP = 1 << (top_k - 1).bit_length()
  has_bias = routing != "softmax" and bias_E is not None
  args = [logits_TE] + ([bias_E.astype(jnp.float32)] if has_bias else [])
  ids, w = pl.pallas_call(
      functools.partial(_route_kernel, E=E, K=top_k, KP=KP, softmax=routing == "softmax", has_bias=has_bias,
                        norm_topk=norm_topk, scale=routed_scale),
      out_shape=[jax.ShapeDtypeStruct((T, KP), jnp.int32), jax.ShapeDtypeStruct((T, KP), jnp.float32)],
      grid=(T,), compiler_params=plgpu.CompilerParams(num_warps=t.route_warps, num_stages=1),
      interpret=interpret,
      name="router_topk")(*args)
  return ids[:, :top_k], w[:, :top_k]


def route(x_TD, router_ED, bias_E, *, routing: str, top_k: int, norm_topk: bool, routed_scale: float,
          impl: str = "ref", logits_fn=None, tuning: Tuning | None = None, logits=None):
  """Dispatcher. impl "pallas" | "interpret": the kernels where `supported` and the router is a float array, with
  `tuning` (static); otherwise (or "ref") logits_fn(x) (the model's linear; default a float32 dot) and route_ref.
  logits: x's router logits [T, E] made already (by ops.norm_router_pallas, where the kernels apply): only the
  top-k kernel runs."""
  if impl not in IMPLS:
    raise ValueError(f"route: impl {impl!r}, expected one of {IMPLS}")
  T, D = x_TD.shape
  kw = dict(routing=routing, top_k=top_k, norm_topk=norm_topk, routed_scale=routed_scale)
  if impl != "ref" and not isinstance(router_ED, QTensor) and supported(T, router_ED.shape[0], D, top_k):
    if logits is not None:
      return topk_pallas(logits, bias_E, interpret=impl == "interpret", tuning=tuning, **kw)
    return route_pallas(x_TD, router_ED, bias_E, interpret=impl == "interpret", tuning=tuning, **kw)
  if logits is not None:
    raise ValueError(f"route: logits given for {impl!r} routing of {T} tokens by a {type(router_ED).__name__} "
                     f"router, expected them only where the route kernels apply")
  logits = logits_fn(x_TD) if logits_fn else jnp.einsum("td,ed->te", x_TD.astype(jnp.float32),
                                                        router_ED.astype(jnp.float32))
  return route_ref(logits, bias_E, **kw)
