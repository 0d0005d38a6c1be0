"""ops/gated_delta (the jnp references) and its Pallas kernels (chunked prefill, fused decode step) against an
independent float64 numpy recurrence and conv written here, the kernels in interpret mode on CPU, and both kernels
lowered for an abstract CUDA and ROCm device. Tiny shapes: Hk = 2, Hv = 4, Dk = Dv = 16 or 32, Kc = 4."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops import gated_delta as gd
from ops import gated_delta_chunk_pallas as chunk_pallas
from ops import gated_delta_step_pallas as step_pallas
from tools.lowering import DEVICES, lower as _lower

EPS = 1e-6
RTOL = 1e-5
Hk, Hv, Kc = 2, 4, 4


# ------------------------------------------------------------------------------------------- numpy oracle


def np_key_heads(head_map):
  h = np.arange(Hv)
  return h // (Hv // Hk) if head_map == "interleave" else h % Hk


def np_l2(x):
  return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + EPS)


def np_conv(x, win, w):
  """Causal depthwise conv of x [T, Cc] after the window [Cc, Kc - 1] (oldest first) with w [Cc, Kc]: (y, window)."""
  ext = np.concatenate([win.T, x], axis=0).astype(np.float64)
  T = x.shape[0]
  y = np.zeros((T, x.shape[1]))
  for t in range(T):
    for i in range(w.shape[1]):
      y[t] += ext[t + i] * w[:, i]
  return y, ext[T:].T


def np_recurrence(q, k, v, g, beta, s0, head_map):
  """The delta rule token by token in float64: q, k [T, Hk, Dk], v [T, Hv, Dv] -> (o, final S, S after each)."""
  q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
  kh = np_key_heads(head_map)
  q, k = q[:, kh] / math.sqrt(q.shape[-1]), k[:, kh]
  S = np.array(s0, np.float64)
  o, states = np.zeros(v.shape), []
  for t in range(v.shape[0]):
    S = S * np.exp(g[t])[:, None, None]
    d = (v[t] - np.einsum("hk,hkv->hv", k[t], S)) * beta[t][:, None]
    S = S + k[t][:, :, None] * d[:, None, :]
    o[t] = np.einsum("hk,hkv->hv", q[t], S)
    states.append(S.copy())
  return o, S, np.stack(states)


def np_layer(x, win, w, g, beta, s0, head_map, Dk, Dv):
  """Conv, SiLU, split, L2 norm, recurrence over x [T, Cc]: (o, window, S, S after each token)."""
  y, win = np_conv(x, win, w)
  y = y / (1.0 + np.exp(-y))
  T = x.shape[0]
  q = np_l2(y[:, :Hk * Dk].reshape(T, Hk, Dk))
  k = np_l2(y[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk))
  o, S, states = np_recurrence(q, k, y[:, 2 * Hk * Dk:].reshape(T, Hv, Dv), g, beta, s0, head_map)
  return o, win, S, states


def close(got, want, rtol=RTOL):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape
  err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
  assert err <= rtol, f"relative error {err:.3g} > {rtol}"


# ------------------------------------------------------------------------------------------- inputs


def delta_inputs(T, Dk, Dv, seed=0, repeat_keys=False):
  """q, k normalised [T, Hk, Dk], v [T, Hv, Dv], g in [-2, -0.01], beta in (0, 1), a nonzero state; repeat_keys:
  runs of equal keys with beta near 1 (a nearly singular chunk system, the hard case of the triangular solve)."""
  r = np.random.default_rng(seed)
  q = np_l2(r.normal(size=(T, Hk, Dk)))
  k = np_l2(r.normal(size=(T, Hk, Dk)))
  beta = r.uniform(0.05, 0.95, size=(T, Hv))
  if repeat_keys:
    k[1:T:2] = k[0:T - 1:2]
    beta[:] = 0.99
  v = r.normal(size=(T, Hv, Dv))
  g = -r.uniform(0.01, 2.0, size=(T, Hv))
  s0 = r.normal(size=(Hv, Dk, Dv)) * 0.5
  return tuple(np.asarray(a, np.float32) for a in (q, k, v, g, beta, s0))


def layer_inputs(T, Dk, Dv, seed=0):
  """Pre-conv rows x [T, Cc], a window [Cc, Kc - 1], conv weight [Cc, Kc], g, beta [T, Hv], a state."""
  r = np.random.default_rng(seed)
  Cc = 2 * Hk * Dk + Hv * Dv
  x = r.normal(size=(T, Cc))
  win = r.normal(size=(Cc, Kc - 1))
  w = r.normal(size=(Cc, Kc)) * 0.5
  g = -r.uniform(0.01, 2.0, size=(T, Hv))
  beta = r.uniform(0.05, 0.95, size=(T, Hv))
  s0 = r.normal(size=(Hv, Dk, Dv)) * 0.5
  return tuple(np.asarray(a, np.float32) for a in (x, win, w, g, beta, s0))


# ------------------------------------------------------------------------------------------- references


def test_key_head_maps():
  np.testing.assert_array_equal(gd.key_head_index(4, 2, "interleave"), [0, 0, 1, 1])
  np.testing.assert_array_equal(gd.key_head_index(4, 2, "tile"), [0, 1, 0, 1])
  with pytest.raises(ValueError):
    gd.key_head_index(4, 2, "grouped")


def test_conv_matches_numpy():
  x, win, w, *_ = layer_inputs(5, 16, 16)
  y, new_win, wins = gd.causal_conv1d(x, win, w, silu_out=False, keep_windows=True)
  y_np, win_np = np_conv(x, win, w)
  close(y, y_np)
  np.testing.assert_array_equal(np.asarray(new_win), win_np.astype(np.float32))
  for t in range(5):                                           # the window after token t
    np.testing.assert_array_equal(np.asarray(wins[t]), np_conv(x[:t + 1], win, w)[1].astype(np.float32))
  y1, win1 = gd.conv_step(x[0], win, w)                        # one token, with SiLU
  close(y1, y_np[0] / (1.0 + np.exp(-y_np[0])))
  np.testing.assert_array_equal(np.asarray(win1), np_conv(x[:1], win, w)[1].astype(np.float32))
  y2, _ = gd.causal_conv1d(x[:2], win, w)                      # T < Kc - 1: the window keeps an old input
  close(y2, np_conv(x[:2], win, w)[0] / (1.0 + np.exp(-np_conv(x[:2], win, w)[0])))


def test_gate_and_beta():
  a = np.array([[-30.0, -1.0, 0.0, 25.0]], np.float32)
  b = np.array([[-2.0, 0.0, 1.0, 3.0]], np.float32)
  dt = np.array([0.5, 0.5, 0.5, 0.5], np.float32)
  A = -np.exp(np.array([0.1, -0.3, 1.0, 0.0], np.float32))             # ssm_a as stored: -exp(A_log)
  g, beta = gd.gate_and_beta(a, b, dt, A)
  close(g, np.logaddexp(0.0, a.astype(np.float64) + dt) * A)
  close(beta, 1.0 / (1.0 + np.exp(-b.astype(np.float64))))


@pytest.mark.parametrize("head_map", gd.HEAD_MAPS)
def test_recurrent_ref(head_map):
  q, k, v, g, beta, s0 = delta_inputs(11, 16, 32)
  o, S, states = gd.gated_delta_recurrent(q, k, v, g, beta, s0, head_map=head_map, keep_states=True)
  o_np, S_np, states_np = np_recurrence(q, k, v, g, beta, s0, head_map)
  close(o, o_np)
  close(S, S_np)
  close(states, states_np)


@pytest.mark.parametrize("T,chunk,head_map,repeat_keys", [
    (5, 16, "interleave", False),        # T < chunk
    (16, 16, "tile", False),             # one full chunk
    (37, 16, "interleave", False),       # several chunks and a ragged tail
    (37, 8, "tile", True),               # repeated keys, beta near 1
])
def test_chunked_ref(T, chunk, head_map, repeat_keys):
  q, k, v, g, beta, s0 = delta_inputs(T, 16, 16, seed=T, repeat_keys=repeat_keys)
  o, S = gd.gated_delta_chunked(q, k, v, g, beta, s0, chunk=chunk, head_map=head_map, impl="ref")
  o_np, S_np, _ = np_recurrence(q, k, v, g, beta, s0, head_map)
  close(o, o_np)
  close(S, S_np)


# ------------------------------------------------------------------------------------------- chunk kernel


# Interpret-mode kernels compile per shape and static arguments: the later tests reuse the shapes (and tuning None)
# of the first ones, so each compiled kernel serves several tests.
@pytest.mark.parametrize("T,Dv,head_map,tuning,repeat_keys", [
    (5, 16, "interleave", None, False),                                    # T < chunk
    (37, 32, "tile", chunk_pallas.Tuning(solve="doubling", BV=16), True),   # 3 chunks, ragged, 2 value tiles
    (40, 16, "interleave", None, True),     # repeated keys (beta near 1) through the table's solve
])
def test_chunk_kernel(T, Dv, head_map, tuning, repeat_keys):
  q, k, v, g, beta, s0 = delta_inputs(T, 16, Dv, seed=T + 1, repeat_keys=repeat_keys)
  o, S = gd.gated_delta_chunked(q, k, v, g, beta, s0, chunk=16, head_map=head_map, impl="interpret", tuning=tuning)
  o_np, S_np, _ = np_recurrence(q, k, v, g, beta, s0, head_map)
  close(o, o_np)
  close(S, S_np)


def test_unsupported_shape_runs_reference():
  q, k, v, g, beta, s0 = delta_inputs(6, 8, 8)                 # Dk = 8: below a Triton dot's 16
  assert chunk_pallas.supported(6, Hk, Hv, 8, 8, 16) is not None
  o, S = gd.gated_delta_chunked(q, k, v, g, beta, s0, chunk=16, impl="interpret")
  close(o, np_recurrence(q, k, v, g, beta, s0, "interleave")[0])


# ------------------------------------------------------------------------------------------- step kernel


@pytest.mark.parametrize("T,Dv,head_map,tuning", [(3, 16, "interleave", None),
                                                 (1, 32, "tile", step_pallas.Tuning(BV=16))])   # 2 value tiles
def test_step_kernel(T, Dv, head_map, tuning):
  x, win, w, g, beta, s0 = layer_inputs(T, 16, Dv, seed=T)
  o, new_win, S, wins, states = gd.gated_delta_step(x, win, w, g, beta, s0, eps=EPS, head_map=head_map,
                                                    keep_states=True, impl="interpret", tuning=tuning)
  o_np, win_np, S_np, states_np = np_layer(x, win, w, g, beta, s0, head_map, 16, Dv)
  close(o, o_np)
  close(new_win, win_np)
  close(S, S_np)
  close(states, states_np)
  for t in range(T):
    close(wins[t], np_conv(x[:t + 1], win, w)[1])
  ref = gd.gated_delta_step(x, win, w, g, beta, s0, eps=EPS, head_map=head_map, impl="ref")
  for a, b in zip((o, new_win, S), ref):
    close(a, b)


def test_step_over_T_tokens_equals_T_single_steps():
  T = 3
  x, win, w, g, beta, s0 = layer_inputs(T, 16, 16, seed=7)
  o, win_T, S_T, wins, states = gd.gated_delta_step(x, win, w, g, beta, s0, eps=EPS, keep_states=True,
                                                    impl="interpret")
  cw, cs = win, s0
  for t in range(T):
    o1, cw, cs = gd.gated_delta_step(x[t:t + 1], cw, w, g[t:t + 1], beta[t:t + 1], cs, eps=EPS, impl="interpret")
    close(o[t], o1[0], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(wins[t]), np.asarray(cw))
    close(states[t], cs, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(win_T), np.asarray(cw))
  close(S_T, cs, rtol=1e-6)


def test_prefill_then_steps_equals_recurrence():
  """A prompt of 40 tokens through the conv reference and the chunk kernel (3 chunks of 16), then 4 tokens through
  the step kernel (a pass of 3, then 1), against the numpy layer over all 44 tokens from a zero window and state."""
  P, Dk, Dv = 40, 16, 16
  x, _, w, g, beta, _ = layer_inputs(P + 4, Dk, Dv, seed=3)
  Cc = x.shape[1]
  win0, s0 = np.zeros((Cc, Kc - 1), np.float32), np.zeros((Hv, Dk, Dv), np.float32)
  o_np, win_np, S_np, _ = np_layer(x, win0, w, g, beta, s0, "interleave", Dk, Dv)

  y, win = gd.causal_conv1d(x[:P], win0, w)
  q, k, v = gd.split_qkv(y, Hk, Dk, Hv, Dv, EPS)
  o_pre, S = gd.gated_delta_chunked(q, k, v, g[:P], beta[:P], s0, chunk=16, impl="interpret")
  close(o_pre, o_np[:P])
  o3, win, S, _, _ = gd.gated_delta_step(x[P:P + 3], win, w, g[P:P + 3], beta[P:P + 3], S, eps=EPS,
                                         keep_states=True, impl="interpret")
  o1, win, S = gd.gated_delta_step(x[P + 3:], win, w, g[P + 3:], beta[P + 3:], S, eps=EPS, impl="interpret")
  close(jnp.concatenate([o_pre, o3, o1]), o_np)
  close(win, win_np)
  close(S, S_np)


# ------------------------------------------------------------------------------------------- lowering


@pytest.mark.parametrize("platform", list(DEVICES))
def test_chunk_kernel_lowers(platform):
  f = jnp.float32
  T, Dk, Dv = 100, 128, 128                                    # the seed model's head dims, a ragged T
  args = [jax.ShapeDtypeStruct(s, f) for s in ((T, Hk, Dk), (T, Hk, Dk), (T, Hv, Dv), (T, Hv), (T, Hv), (Hv, Dk, Dv))]
  for solve in chunk_pallas.SOLVES:
    txt = _lower(platform, lambda *a: chunk_pallas.gated_delta_chunk_pallas(
        *a, chunk=64, head_map="tile", tuning=chunk_pallas.Tuning(solve=solve)), *args)
    assert txt.count("__gpu$xla.gpu.triton") == 2                 # the prep kernel, the scan kernel


@pytest.mark.parametrize("platform", list(DEVICES))
def test_step_kernel_lowers(platform):
  f = jnp.float32
  T, Dk, Dv = 4, 128, 128
  Cc = 2 * Hk * Dk + Hv * Dv
  args = [jax.ShapeDtypeStruct(s, f) for s in ((T, Cc), (Cc, Kc - 1), (Cc, Kc), (T, Hv), (T, Hv), (Hv, Dk, Dv))]
  for keep in (False, True):
    txt = _lower(platform, lambda *a: step_pallas.gated_delta_step_pallas(*a, eps=EPS, keep_states=keep), *args)
    assert txt.count("__gpu$xla.gpu.triton") == 1
