"""Samplers: greedy, temperature and top-p (nucleus). `target_probs` is the distribution a sampler draws from,
which speculative verification needs too."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def target_probs(logits_V: jax.Array, temperature: float, top_p: float) -> jax.Array:
  """The sampling distribution (float32 [V]) for temperature > 0 with nucleus top_p in (0, 1]."""
  p = jax.nn.softmax(logits_V.astype(jnp.float32) / temperature)
  if top_p >= 1.0:
    return p
  order = jnp.argsort(-p)
  sp = p[order]
  keep_sorted = (jnp.cumsum(sp) - sp) < top_p          # smallest prefix whose mass reaches top_p
  keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
  q = jnp.where(keep, p, 0.0)
  return q / jnp.sum(q)


def sample(logits_V: jax.Array, key: jax.Array, temperature: float, top_p: float = 1.0) -> jax.Array:
  """One token id (int32). temperature == 0 is greedy (argmax, lowest id on ties)."""
  if temperature == 0.0:
    return jnp.argmax(logits_V).astype(jnp.int32)
  p = target_probs(logits_V, temperature, top_p)
  return jax.random.categorical(key, jnp.log(p)).astype(jnp.int32)
