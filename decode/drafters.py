"""Drafters: what proposes the k tokens a speculative round verifies.

- `mtp`: the model's NextN block (see decode/speculative.py, which owns its ring);
- `lookup`: n-gram match over prompt + output: the longest suffix (n = 3, 2, 1) that occurred before proposes
  the k tokens that followed its most recent earlier occurrence (the path used when MTP is off);
- `replay`: a recorded continuation (e.g. the plain greedy output) proposed verbatim, so the round's mechanics
  can be measured at 100 % acceptance.
Deterministic drafters propose one token per position (their q is one-hot).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

DRAFTERS = ("mtp", "lookup", "replay", "none")


def lookup_draft(hist: jax.Array, n_hist: jax.Array, k: int, max_ngram: int = 3) -> jax.Array:
  """k drafted tokens from the history buffer hist[:n_hist] (int32 [H]); -1 where nothing matched.

  For n from max_ngram down to 1, the n-gram ending at the last token is searched for among all earlier end
  positions; the latest match wins and proposes hist[e+1 : e+1+k] (clipped to the history)."""
  H = hist.shape[0]
  idx = jnp.arange(H, dtype=jnp.int32)
  best = jnp.int32(-1)
  for n in range(max_ngram, 0, -1):
    ok = (idx >= n - 1) & (idx < n_hist - 1)        # candidate end positions e (strictly before the last token)
    for i in range(n):
      a = jnp.take(hist, jnp.clip(idx - i, 0, H - 1))
      b = jnp.take(hist, jnp.clip(n_hist - 1 - i, 0, H - 1))
      ok = ok & (a == b)
    ok = ok & (n_hist >= n)
    e = jnp.max(jnp.where(ok, idx, -1))
    best = jnp.where(best >= 0, best, e)
  src = best + 1 + jnp.arange(k, dtype=jnp.int32)
  got = jnp.take(hist, jnp.clip(src, 0, H - 1))
  return jnp.where((best >= 0) & (src < n_hist), got, -1).astype(jnp.int32)


def replay_draft(replay: jax.Array, n_hist: jax.Array, k: int) -> jax.Array:
  """The recorded tokens for history positions n_hist .. n_hist+k-1 (replay is int32 [H], -1 past its end)."""
  H = replay.shape[0]
  src = n_hist + jnp.arange(k, dtype=jnp.int32)
  return jnp.where(src < H, jnp.take(replay, jnp.clip(src, 0, H - 1)), -1).astype(jnp.int32)
