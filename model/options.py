"""`Options`: how the model runs, beside `ModelConfig` (what the model is).

Frozen and hashable: a static argument of every jitted entry (`model.api`), so an A/B of any choice here traces
and compiles each side on its own, with nothing to clear between them.

>>> Options().glue, Options(glue=False) == Options(glue=False)
(True, True)
"""
from __future__ import annotations

import dataclasses
from typing import Callable

PREFILL_PRECISIONS = ("auto", "f32", "bf16")


@dataclasses.dataclass(frozen=True)
class LayerOps:
  """Stand-ins for three of the model's layer functions, passed in by a caller that needs other maths under the
  same modules and params (the training script, tools/train_default.py: bf16 operands, capacity-limited experts,
  packed sequences). Each None keeps the model's own."""
  linear: Callable | None = None             # (x, w, b=None) -> y: ops.layers.linear
  moe: Callable | None = None                # (x_TD, ids_TX, w_TX, gate, up, down) -> y_TD: ops.moe.moe
  causal_attention: Callable | None = None   # (q_THDh, k_THkvDh, v_THkvDh, scale) -> o_THDh: cache-free attention


@dataclasses.dataclass(frozen=True)
class Options:
  # Decode and verify passes (T <= 16) run the per-token Pallas glue kernels (RMSNorm with the residual add,
  # routing, q/k norm + RoPE + ring write) whenever the block's quantized matmuls run Pallas kernels: fewer
  # launches, and every token's row computed the same way whatever T is, so a verify pass reproduces the plain
  # steps bitwise on the GPU (DESIGN invariant 3). False: the jnp ops.
  glue: bool = True
  # Operands of the prefill GEMMs: "f32" (three bf16 MMAs, float32-accurate), "bf16" (one MMA), "auto" (bf16 on a
  # GPU, f32 elsewhere). Decode and verify passes always run float32.
  prefill_precision: str = "auto"
  # Per-kernel tuning (ops.tuning.Tunings; None: every kernel's table default).
  tunings: object | None = None
  # Stand-ins for layer functions (LayerOps; None: the model's own). Inference never sets it.
  layer_ops: LayerOps | None = None
  # A jax.sharding.Mesh (model.mesh.make_mesh; hashable) the params are placed on: the routed experts run expert
  # parallel over its "ep" axis (model.mesh.expert_parallel). None: one device.
  mesh: object | None = None

  def __post_init__(self):
    if self.prefill_precision not in PREFILL_PRECISIONS:
      raise ValueError(f"Options: prefill_precision {self.prefill_precision!r}, expected one of "
                       f"{', '.join(PREFILL_PRECISIONS)}")

  def replace(self, **kw) -> "Options":
    return dataclasses.replace(self, **kw)


DEFAULT = Options()
