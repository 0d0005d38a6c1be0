"""`RecurrentState`: the fixed-size state of a hybrid model's Gated DeltaNet layers, and `RecurrentLayer`, one
layer's part of it as that layer's block receives and returns it.

Per DeltaNet layer (model.config.ModelConfig.recurrent_layers, in order):
  conv  [Cc, Kc - 1]   the conv window: the last Kc - 1 inputs of the causal conv1d (pre-activation q | k | v rows)
  delta [Hv, Dk, Dv]   float32, the delta rule's state of every value head
Both float32, as llama.cpp keeps them. Nothing in it grows with the context, so the ring's capacity never touches
it. A pass of T tokens moves it T steps; a verify pass keeps the state after each of its tokens so that the round
leaves the state after its accepted prefix (`RecurrentLayer.select`).

>>> from configs.presets import TINY_QWEN3NEXT as cfg
>>> st = RecurrentState.create(cfg)
>>> len(st.conv) == len(cfg.recurrent_layers), st.delta[0].shape == (cfg.Hv, cfg.Dk, cfg.Dv)
(True, True)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from model.config import ModelConfig

def _set(t: tuple, i: int, a) -> tuple:
  return t[:i] + (a,) + t[i + 1:]


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zeros(n: int, conv_shape: tuple, delta_shape: tuple):
  """Every layer's zeroed arrays in one compiled call."""
  return (tuple(jnp.zeros(conv_shape, jnp.float32) for _ in range(n)),
          tuple(jnp.zeros(delta_shape, jnp.float32) for _ in range(n)))


@struct.dataclass
class RecurrentState:
  conv: tuple                   # L x [Cc, Kc - 1] float32 conv windows (one array per DeltaNet layer)
  delta: tuple                  # L x [Hv, Dk, Dv] float32 delta-rule states

  @classmethod
  def create(cls, cfg: ModelConfig) -> "RecurrentState":
    return cls(*_zeros(len(cfg.recurrent_layers), (cfg.Cc, cfg.Kc - 1), (cfg.Hv, cfg.Dk, cfg.Dv)))

  @property
  def n_layers(self) -> int:
    return len(self.conv)

  @property
  def nbytes(self) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in self.conv + self.delta))

  def cache(self, j: int) -> "RecurrentLayer":
    """DeltaNet layer j's part, as its block takes it."""
    return RecurrentLayer(self.conv[j], self.delta[j])

  def with_cache(self, j: int, c: "RecurrentLayer") -> "RecurrentState":
    return self.replace(conv=_set(self.conv, j, c.conv), delta=_set(self.delta, j, c.delta))


@struct.dataclass
class RecurrentLayer:
  """One DeltaNet layer's state. With `keep` (a verify pass) the block also returns the state after each of its T
  tokens, `conv_T` [T, Cc, Kc - 1] and `delta_T` [T, Hv, Dk, Dv], so that the round can keep the state after its
  accepted prefix (`select`)."""
  conv: jax.Array               # [Cc, Kc - 1]
  delta: jax.Array              # [Hv, Dk, Dv] float32
  conv_T: jax.Array | None = None
  delta_T: jax.Array | None = None

  def select(self, t) -> "RecurrentLayer":
    """The state after token t of the pass that kept per-token states (t traced)."""
    return RecurrentLayer(self.conv_T[t], self.delta_T[t])


def state_bytes(cfg: ModelConfig) -> int:
  """Bytes of the whole recurrent state: every DeltaNet layer's conv window and delta state (float32)."""
  return len(cfg.recurrent_layers) * 4 * (cfg.Cc * (cfg.Kc - 1) + cfg.Hv * cfg.Dk * cfg.Dv)
