"""Gated DeltaNet (the gated delta rule) of the hybrid family (`qwen3next`, `qwen35moe`): the jnp references and
the dispatchers to the Pallas kernels (`ops/gated_delta_chunk_pallas.py` for prefill chunks,
`ops/gated_delta_step_pallas.py` for decode and verify passes).

Semantics: llama.cpp 0.3.36 (llama-cpp-python 0.3.36's vendor/llama.cpp; paths below are relative to it).

- Projections. `attn_qkv` gives the conv input x [T, Cc], channels in the order q (Hk Dk) | k (Hk Dk) | v (Hv Dv),
  head-major inside each part (src/models/qwen3next.cpp:484-500, qwen35moe.cpp:428-444; legacy qwen3next files with
  one `ssm_in` hold per key head q | k | v | z, regrouped into that order by build_qkvz, qwen3next.cpp:340-389).
- Conv: causal and depthwise, width Kc (4), no bias. The window state [Cc, Kw] (Kw = Kc - 1, oldest input first)
  is prepended to x, out[t, c] = sum_i ext[t + i, c] * w[c, i] for i = 0 .. Kc - 1 (w[c, Kc - 1] weighs the current
  input), summed in that order; the new window is the last Kw inputs of ext (delta-net-base.cpp:449-525
  build_conv_state, ggml/src/ggml-cpu/ops.cpp:9932-9983 ssm_conv). `ssm_conv1d` [Cc, Kc] in numpy order. Then SiLU,
  x / (1 + exp(-x)) (qwen3next.cpp:471-474).
- q and k are L2-normalised per head: x / sqrt(sum x^2 + eps) with eps the RMS-norm eps
  (`attention.layer_norm_rms_epsilon`): build_gdn_l2_norm is rms_norm(x, eps / n) / sqrt(n) (src/models/models.h:14-18,
  qwen3next.cpp:507-510). v is not normalised.
- Head map (`key_head_index`). qwen3next repeats q and k with an interleave
  (reshape to [Dk, 1, Hk, T], ggml_repeat_4d to [Dk, Hv / Hk, Hk, T], reshape: qwen3next.cpp:518-537), so value head
  h reads key head h // (Hv / Hk): `head_map="interleave"`. qwen35moe tiles (ggml_repeat_4d [Dk, Hk] -> [Dk, Hv],
  qwen35moe.cpp:460-466, or the fused op's own broadcast iq1 = iv1 % neq1, ggml/src/ggml-cpu/ops.cpp:11200), so
  value head h reads key head h % Hk: `head_map="tile"`; its converter reorders the value heads (and a, b, A, dt,
  z, the conv's v rows and ssm_out's columns) from grouped to tiled order for this (conversion/qwen.py:454-465,
  586-631). The two agree when Hk == Hv.
- Decay and beta. g = softplus(a + ssm_dt.bias) * ssm_a, the log-decay (g <= 0); the GGUF tensor `ssm_a` [Hv] holds
  -exp(A_log) already (conversion/qwen.py:395-396), `ssm_dt.bias` [Hv] holds HF's dt_bias; softplus as ggml's
  (x > 20 ? x : log(1 + exp(x)), ggml/src/ggml-cpu/unary-ops.cpp:80-82). beta = sigmoid(b). a, b come from `ssm_ba`
  (qwen3next: per key head Hv / Hk betas then Hv / Hk alphas, qwen3next.cpp:418-452) or `ssm_beta` / `ssm_alpha`
  (qwen35moe.cpp:382-397). `gate_and_beta` computes both.
- State and update. Per value head a float32 state S [Dk, Dv] (here [Hv, Dk, Dv]; llama.cpp keeps each head's S
  transposed in memory, [Hv, Dv, Dk] in numpy order: "s_out[j*S_v + i] = S[i][j]", ops.cpp:11228). Per token,
  in this order (ops.cpp:11220-11262 gated_delta_net; delta-net-base.cpp:338-366 the unfused one-token graph):
      S <- S * exp(g);  d = (v - S^T k) * beta;  S <- S + k d^T;  o = S^T q / sqrt(Dk)
  The scale 1 / sqrt(Dk) applies to q (delta-net-base.cpp:45-47 and 319-321; the fused op scales o instead, the same
  product). Here q is scaled before the update (`scale` overrides the factor).
- Chunked form (delta-net-base.cpp:16-287, chunk 64, flash-linear-attention's chunk_gated_delta_rule): within a chunk
  of C tokens with cumulative log-decay G_i = g_0 + .. + g_i and the state S0 at its start,
      A = strict_lower(beta_i exp(G_i - G_j) k_i . k_j),  Tm = (I + A)^-1  (unit lower triangular),
      U = Tm (beta v),  W = Tm (beta exp(G) k),  delta = U - W S0   (delta_i is the d of token i),
      o = exp(G) (q S0) + lower(exp(G_i - G_j) q_i . k_j) delta,
      S = exp(G_last) S0 + (exp(G_last - G) k)^T delta.
  Every exponent is <= 0 (no overflow). A ragged tail is padded with g = 0, beta = 0 (a padded token leaves S alone).

Shapes (docs/SHAPES.md; `Kw` = Kc - 1 is this module's letter for the conv window): q, k [T, Hk, Dk] (normalised),
v [T, Hv, Dv], g and beta [T, Hv], state [Hv, Dk, Dv] float32, conv input [T, Cc], window [Cc, Kw], weight [Cc, Kc].

Dispatch (`impl`, static): "ref" (these references), "pallas" (the kernels), "interpret" (the kernels in Pallas
interpret mode, CPU tests), None: "pallas" on a GPU, "ref" elsewhere. A shape a kernel does not take (`supported`)
runs the reference.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ops import gated_delta_chunk_pallas, gated_delta_step_pallas, on_gpu

IMPLS = ("ref", "pallas", "interpret")
HEAD_MAPS = gated_delta_chunk_pallas.HEAD_MAPS        # ("interleave", "tile")
HIGHEST = lax.Precision.HIGHEST


def default_impl() -> str:
  """"pallas" on a GPU backend (CUDA or ROCm), "ref" elsewhere; read at trace time."""
  return "pallas" if on_gpu() else "ref"


def _resolve_impl(impl: str | None) -> str:
  impl = impl or default_impl()
  if impl not in IMPLS:
    raise ValueError(f"gated_delta: impl {impl!r}, expected one of {IMPLS}")
  return impl


def key_head_index(Hv: int, Hk: int, head_map: str) -> np.ndarray:
  """The key head each value head reads, [Hv] int32: h // (Hv / Hk) ("interleave", qwen3next) or h % Hk ("tile",
  qwen35moe)."""
  if head_map not in HEAD_MAPS:
    raise ValueError(f"gated_delta: head_map {head_map!r}, expected one of {HEAD_MAPS}")
  if Hv % Hk:
    raise ValueError(f"gated_delta: Hv={Hv} is not a multiple of Hk={Hk}")
  h = np.arange(Hv, dtype=np.int32)
  return h // (Hv // Hk) if head_map == "interleave" else h % Hk


def expand_heads(x_THkDk, Hv: int, head_map: str):
  """q or k [T, Hk, Dk] -> [T, Hv, Dk], value head h holding its key head's row."""
  return x_THkDk[:, key_head_index(Hv, x_THkDk.shape[1], head_map)]


def silu(x):
  """x / (1 + exp(-x)), as ggml's silu."""
  return x / (1.0 + jnp.exp(-x))


def softplus(x):
  """ggml's softplus: x above 20, log(1 + exp(x)) below."""
  return jnp.where(x > 20.0, x, jnp.log(1.0 + jnp.exp(jnp.minimum(x, 20.0))))


def gate_and_beta(a_THv, b_THv, dt_bias_Hv, ssm_a_Hv):
  """(g, beta) [T, Hv] from the projections a (alpha) and b (beta): g = softplus(a + dt_bias) * ssm_a (ssm_a =
  -exp(A_log) as stored in the GGUF), beta = sigmoid(b)."""
  g = softplus(a_THv.astype(jnp.float32) + dt_bias_Hv) * ssm_a_Hv
  return g, jax.nn.sigmoid(b_THv.astype(jnp.float32))


def l2_normalize(x, eps: float):
  """x / sqrt(sum(x^2) + eps) over the last axis (llama.cpp's build_gdn_l2_norm)."""
  return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# ---------------------------------------------------------------------------------------------- conv


def _conv_ext(x_TCc, win_CcKw):
  """[Kw + T, Cc]: the window's inputs (oldest first) then x."""
  return jnp.concatenate([win_CcKw.T.astype(jnp.float32), x_TCc.astype(jnp.float32)], axis=0)


def _conv_taps(ext, w_CcKc, T: int):
  Kc = w_CcKc.shape[1]
  w = w_CcKc.astype(jnp.float32)
  y = ext[0:T] * w[:, 0]
  for i in range(1, Kc):                 # ggml's order of the sum
    y = y + ext[i:i + T] * w[:, i]
  return y


def causal_conv1d(x_TCc, win_CcKw, w_CcKc, *, silu_out: bool = True, keep_windows: bool = False):
  """Causal depthwise conv over T inputs after the window: (y [T, Cc], new window [Cc, Kw]); SiLU on y when
  silu_out. keep_windows: also the window after each token, [T, Cc, Kw] (row t: inputs t + 1 - Kw .. t)."""
  T = x_TCc.shape[0]
  Kw = win_CcKw.shape[1]
  ext = _conv_ext(x_TCc, win_CcKw)
  y = _conv_taps(ext, w_CcKc, T)
  if silu_out:
    y = silu(y)
  new_win = ext[T:].T
  if not keep_windows:
    return y, new_win
  idx = np.arange(T)[:, None] + 1 + np.arange(Kw)[None, :]              # [T, Kw] rows of ext
  return y, new_win, jnp.transpose(ext[idx], (0, 2, 1))


def conv_step(x_Cc, win_CcKw, w_CcKc, *, silu_out: bool = True):
  """One token of causal_conv1d: (y [Cc], new window [Cc, Kw])."""
  y, win = causal_conv1d(x_Cc[None], win_CcKw, w_CcKc, silu_out=silu_out)
  return y[0], win


def split_qkv(y_TCc, Hk: int, Dk: int, Hv: int, Dv: int, eps: float):
  """The conv output [T, Cc] as (q, k [T, Hk, Dk], L2-normalised; v [T, Hv, Dv])."""
  T = y_TCc.shape[0]
  q = l2_normalize(y_TCc[:, :Hk * Dk].reshape(T, Hk, Dk), eps)
  k = l2_normalize(y_TCc[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk), eps)
  return q, k, y_TCc[:, 2 * Hk * Dk:].reshape(T, Hv, Dv)


# ---------------------------------------------------------------------------------------------- delta rule


def _prepare(q_THkDk, k_THkDk, v_THvDv, g_THv, beta_THv, state_HvDkDv, head_map, scale):
  Hv, Dk, _ = state_HvDkDv.shape
  scale = 1.0 / math.sqrt(Dk) if scale is None else scale
  f32 = jnp.float32
  q = expand_heads(q_THkDk.astype(f32), Hv, head_map) * scale
  k = expand_heads(k_THkDk.astype(f32), Hv, head_map)
  return q, k, v_THvDv.astype(f32), g_THv.astype(f32), beta_THv.astype(f32), state_HvDkDv.astype(f32)


@functools.partial(jax.jit, static_argnames=("head_map", "scale", "keep_states"))
def gated_delta_recurrent(q_THkDk, k_THkDk, v_THvDv, g_THv, beta_THv, state_HvDkDv, *, head_map: str = "interleave",
                          scale: float | None = None, keep_states: bool = False):
  """The delta rule token by token (lax.scan): (o [T, Hv, Dv], state after the last token [Hv, Dk, Dv]), and with
  keep_states the state after each token [T, Hv, Dk, Dv]. q, k already L2-normalised; scale None: 1 / sqrt(Dk)."""
  q, k, v, g, beta, s0 = _prepare(q_THkDk, k_THkDk, v_THvDv, g_THv, beta_THv, state_HvDkDv, head_map, scale)

  def step(S, x):
    q_t, k_t, v_t, g_t, b_t = x
    S = S * jnp.exp(g_t)[:, None, None]
    d = (v_t - jnp.einsum("hk,hkv->hv", k_t, S, precision=HIGHEST)) * b_t[:, None]
    S = S + k_t[:, :, None] * d[:, None, :]
    o = jnp.einsum("hk,hkv->hv", q_t, S, precision=HIGHEST)
    return S, (o, S) if keep_states else o

  S, out = lax.scan(step, s0, (q, k, v, g, beta))
  if keep_states:
    return out[0], S, out[1]
  return out, S


@functools.partial(jax.jit, static_argnames=("chunk", "head_map", "scale"))
def gated_delta_chunked_ref(q_THkDk, k_THkDk, v_THvDv, g_THv, beta_THv, state_HvDkDv, *, chunk: int = 64,
                            head_map: str = "interleave", scale: float | None = None):
  """The chunked (WY / UT-transform) form in jnp: the intra-chunk parts of every chunk at once, a triangular solve
  per chunk, then a lax.scan passing the state between chunks. Same result as gated_delta_recurrent."""
  q, k, v, g, beta, s0 = _prepare(q_THkDk, k_THkDk, v_THvDv, g_THv, beta_THv, state_HvDkDv, head_map, scale)
  T, Hv, Dk = k.shape
  Dv = v.shape[-1]
  C = chunk
  N = -(-T // C)
  pad = N * C - T

  def chunks(x):                        # [T, Hv, ...] -> [N, Hv, C, ...] (padded with zeros)
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return jnp.swapaxes(x.reshape((N, C) + x.shape[1:]), 1, 2)

  q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))          # [N, Hv, C, (D)]
  G = jnp.cumsum(g, axis=-1)                                            # [N, Hv, C]
  i = np.arange(C)[:, None]
  j = np.arange(C)[None, :]
  decay = jnp.exp(jnp.where(i >= j, G[..., :, None] - G[..., None, :], -jnp.inf))      # [N, Hv, C, C]
  kk = jnp.einsum("nhik,nhjk->nhij", k, k, precision=HIGHEST)
  A = jnp.where(i > j, beta[..., :, None] * decay * kk, 0.0)
  eye = jnp.eye(C, dtype=jnp.float32)
  rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(G))[..., None] * k], axis=-1)   # [N, Hv, C, Dv + Dk]
  sol = jax.scipy.linalg.solve_triangular(eye + A, rhs, lower=True, unit_diagonal=True)
  U, W = sol[..., :Dv], sol[..., Dv:]
  qk = decay * jnp.einsum("nhik,nhjk->nhij", q, k, precision=HIGHEST)                        # lower incl. diagonal
  G_last = G[..., -1]                                                                           # [N, Hv]
  k_tail = k * jnp.exp(G_last[..., None] - G)[..., None]                                        # [N, Hv, C, Dk]

  def step(S, x):
    q_n, qk_n, U_n, W_n, kt_n, gl_n, G_n = x
    delta = U_n - jnp.einsum("hck,hkv->hcv", W_n, S, precision=HIGHEST)
    o = (jnp.exp(G_n)[..., None] * jnp.einsum("hck,hkv->hcv", q_n, S, precision=HIGHEST)
         + jnp.einsum("hij,hjv->hiv", qk_n, delta, precision=HIGHEST))
    S = jnp.exp(gl_n)[:, None, None] * S + jnp.einsum("hck,hcv->hkv", kt_n, delta, precision=HIGHEST)
    return S, o

  S, o = lax.scan(step, s0, (q, qk, U, W, k_tail, G_last, G))         # o [N, Hv, C, Dv]
  o = jnp.swapaxes(o, 1, 2).reshape(N * C, Hv, Dv)[:T]
  return o, S


def gated_delta_chunked(q_THkDk, k_THkDk, v_THvDv, g_THv, beta_THv, state_HvDkDv, *, chunk: int = 64,
                        head_map: str = "interleave", scale: float | None = None, impl: str | None = None,
                        tuning: gated_delta_chunk_pallas.Tuning | None = None):
  """The delta rule over a prefill chunk of T tokens from state_HvDkDv: (o [T, Hv, Dv], final state [Hv, Dk, Dv]).

  q, k [T, Hk, Dk] L2-normalised (unscaled), v [T, Hv, Dv], g (log-decay) and beta [T, Hv], state float32.
  chunk (static, a power of two): tokens per intra-chunk block, of the kernel (>= 16) and of the reference.
  head_map: "interleave" (qwen3next) | "tile" (qwen35moe). scale None: 1 / sqrt(Dk). impl as the module says;
  tuning (static): the chunk kernel's (gated_delta_chunk_pallas.Tuning, fields over its table)."""
  impl = _resolve_impl(impl)
  T, Hk, Dk = q_THkDk.shape
  _, Hv, Dv = v_THvDv.shape
  if impl != "ref" and gated_delta_chunk_pallas.supported(T, Hk, Hv, Dk, Dv, chunk) is None:
    return gated_delta_chunk_pallas.gated_delta_chunk_pallas(
        q_THkDk, k_THkDk, v_THvDv, g_THv, beta_THv, state_HvDkDv, chunk=chunk, head_map=head_map, scale=scale,
        interpret=impl == "interpret", tuning=tuning)
  return gated_delta_chunked_ref(q_THkDk, k_THkDk, v_THvDv, g_THv, beta_THv, state_HvDkDv, chunk=chunk,
                                 head_map=head_map, scale=scale)


# ---------------------------------------------------------------------------------------------- decode / verify


def conv_channels_split(Cc: int, Hv: int, Dk: int, Dv: int) -> int:
  """Hk from the conv width Cc = 2 Hk Dk + Hv Dv (ValueError when it does not divide)."""
  Hk, rem = divmod(Cc - Hv * Dv, 2 * Dk)
  if rem or Hk <= 0 or Hv % Hk:
    raise ValueError(f"gated_delta: Cc={Cc} is not 2 Hk Dk + Hv Dv for Hv={Hv}, Dk={Dk}, Dv={Dv}")
  return Hk


@functools.partial(jax.jit, static_argnames=("eps", "head_map", "scale", "keep_states"))
def gated_delta_step_ref(qkv_TCc, win_CcKw, w_CcKc, g_THv, beta_THv, state_HvDkDv, *, eps: float,
                         head_map: str = "interleave", scale: float | None = None, keep_states: bool = False):
  """The reference of gated_delta_step: conv (+ SiLU), split, L2 norm, then the recurrence token by token."""
  Hv, Dk, Dv = state_HvDkDv.shape
  Hk = conv_channels_split(qkv_TCc.shape[1], Hv, Dk, Dv)
  conv = causal_conv1d(qkv_TCc, win_CcKw, w_CcKc, keep_windows=keep_states)
  q, k, v = split_qkv(conv[0], Hk, Dk, Hv, Dv, eps)
  rec = gated_delta_recurrent(q, k, v, g_THv, beta_THv, state_HvDkDv, head_map=head_map, scale=scale,
                              keep_states=keep_states)
  if keep_states:
    return rec[0], conv[1], rec[1], conv[2], rec[2]
  return rec[0], conv[1], rec[1]


def gated_delta_step(qkv_TCc, win_CcKw, w_CcKc, g_THv, beta_THv, state_HvDkDv, *, eps: float,
                     head_map: str = "interleave", scale: float | None = None, keep_states: bool = False,
                     impl: str | None = None, tuning: gated_delta_step_pallas.Tuning | None = None):
  """A decode step or verify pass of T <= gated_delta_step_pallas.MAX_T tokens, conv fused with the delta rule.

  qkv_TCc: the pre-conv projection rows (q | k | v channels); win_CcKw: the conv window; w_CcKc: `ssm_conv1d`;
  g, beta [T, Hv]; state [Hv, Dk, Dv] float32 (Hk follows from Cc). eps: the L2 norm's (the RMS eps).
  Returns (o [T, Hv, Dv], window [Cc, Kw], state [Hv, Dk, Dv]), the window and state after the last token; with
  keep_states (static) also the window and state after each token, [T, Cc, Kw] and [T, Hv, Dk, Dv] (a verify pass
  keeps those after its accepted prefix). impl and tuning as gated_delta_chunked's (the step kernel's Tuning)."""
  impl = _resolve_impl(impl)
  T, Cc = qkv_TCc.shape
  Hv, Dk, Dv = state_HvDkDv.shape
  Hk = conv_channels_split(Cc, Hv, Dk, Dv)
  kw = dict(eps=eps, head_map=head_map, scale=scale, keep_states=keep_states)
  if impl != "ref" and gated_delta_step_pallas.supported(T, Hk, Hv, Dk, Dv) is None:
    return gated_delta_step_pallas.gated_delta_step_pallas(qkv_TCc, win_CcKw, w_CcKc, g_THv, beta_THv, state_HvDkDv,
                                                           interpret=impl == "interpret", tuning=tuning, **kw)
  return gated_delta_step_ref(qkv_TCc, win_CcKw, w_CcKc, g_THv, beta_THv, state_HvDkDv, **kw)
