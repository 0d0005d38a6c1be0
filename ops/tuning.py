"""Kernel tuning as static values: `Tunings` bundles one optional tuning value per kernel and the attention impls.

Each kernel module defines its tuning as a NamedTuple `Tuning` whose fields default to None, and a table of
complete values (keyed by quant type, head dim, ...). A kernel takes `tuning=None` as a static argument: the
fields a value sets replace the table's (`fill`), so `Tuning(S=4)` changes one tile size and keeps the rest, and
None is the table itself. Values are hashable, so jit keys its cache on them: an A/B of two tunings traces each
side on its own, with nothing to clear between them.

`Tunings` is what the model's dispatch functions take (`ops.layers.linear`, `ops.moe.moe`,
`ops.attention.ring_attention` / `tier_attention`; the glue kernels take their own piece). Fields of the
quantized kernels hold one `Tuning` of that kernel (for every quant type) or a `ByType` of them (per type);
None everywhere is every kernel's table, today's defaults.

>>> from ops import qmatmul_pallas
>>> t = Tunings(qmatmul=ByType(Q4_K=qmatmul_pallas.Tuning(S=4)))
>>> t.pick("qmatmul", "Q4_K"), t.pick("qmatmul", "Q8_0")
(Tuning(BN=None, S=4, num_warps=None, num_stages=None, unroll=None, natural_b=None, programs=None, x8=None), None)
>>> hash(t) == hash(Tunings(qmatmul=ByType(Q4_K=qmatmul_pallas.Tuning(S=4))))
True
"""
from __future__ import annotations

import dataclasses

ATTENTION_IMPLS = ("ref", "pallas", "interpret")
# Work of a decode or verify pass moved into a neighbouring kernel, each saving one launch a layer (Tunings.fuse):
#   "residual"  a block's FFN output (the routed experts' X rows unsummed, a shared expert's) is added to the
#               residual stream by the next norm kernel (ops.rmsnorm_pallas's pieces) instead of an XLA launch
#   "router"    a MoE layer's FFN norm and its router's logits in one kernel (ops.norm_router_pallas)
#   "topk"      the routed experts' gate/up programs route for themselves from the logits (ops.moe.moe_routed)
#               instead of ops.router_pallas's top-k kernel (every expert resident, one device)
#   "gated_norm" a Gated DeltaNet layer's output norm multiplies by its silu(z) gate in the norm kernel
#   "rope"      q/k norm, RoPE and the ring write inside the decode attention kernel (ops.rope_attention_pallas)
#               instead of ops.rope_write_pallas's launch before it
FUSIONS = ("residual", "router", "topk", "gated_norm", "rope")


def fill(given, table_value):
  """`table_value` (a complete NamedTuple) with the fields `given` sets (not None); `given` None: the table's."""
  if given is None:
    return table_value
  return table_value._replace(**{k: v for k, v in given._asdict().items() if v is not None})


@dataclasses.dataclass(frozen=True, init=False)
class ByType:
  """One kernel's tunings per quant type, hashable: `ByType(Q4_K=t, IQ3_S=u)`; a type not named takes the table."""
  pairs: tuple

  def __init__(self, **by_type):
    object.__setattr__(self, "pairs", tuple(sorted(by_type.items())))

  def get(self, qtype: str):
    return dict(self.pairs).get(qtype)


@dataclasses.dataclass(frozen=True)
class Tunings:
  qmatmul: object = None             # decode projections: ops.qmatmul_pallas.Tuning, per weight type
  moe: object = None                 # decode routed experts: ops.moe_pallas.Tuning, per gate/up type
  qgemm: object = None               # prefill projections: ops.qgemm_pallas.Tuning, per weight type
  grouped: object = None             # prefill routed experts: ops.moe_grouped_pallas.Tuning, per gate/up type
  attention: object = None           # decode attention: ops.attention_pallas.Tuning
  prefill_attention: object = None   # prefill attention: ops.prefill_attention_pallas.Tuning
  router: object = None              # routing: ops.router_pallas.Tuning
  rope_write: object = None          # q/k norm + RoPE + ring write: ops.rope_write_pallas.Tuning
  rmsnorm: object = None             # RMSNorm + residual: ops.rmsnorm_pallas.Tuning
  # Attention over a host tier (ops.attention.tier_attention) reads it in pieces, each one host -> device copy per
  # array and one kernel call: spans of tier_span positions where a row sees them whole, then blocks of tier_block
  # positions. Powers of two; None: model.host_tier.HOST_BLOCK and HOST_SPAN.
  tier_block: int | None = None
  tier_span: int | None = None
  # The expert cache's miss copies (model.expert_cache.ensure): misses copied per group, and groups copied before
  # the loop over the rest (each of its tests waits for the device on a GPU). None: 1 and 0 (a group per miss,
  # all in the loop: no copy wasted, misses + 1 waits a layer).
  miss_lanes: int | None = None
  miss_eager: int | None = None
  # Attention of decode and verify passes (T <= ops.attention_pallas.MAX_T) and of prefill chunks: "pallas" |
  # "ref" | "interpret" (the kernels in interpret mode, CPU tests); None: "pallas" on a GPU, "ref" elsewhere.
  attention_impl: str | None = None
  prefill_attention_impl: str | None = None
  # The FUSIONS to make (a tuple of their names; empty: none). Default: all of them, each where it applies (the
  # bundle is 2-4 % faster a step on the 30B and seed-mtp shapes, and exact: docs/PERF.md 2026-12-06, 2026-12-07).
  fuse: tuple = FUSIONS

  def __post_init__(self):
    if not isinstance(self.fuse, tuple) or not set(self.fuse) <= set(FUSIONS):
      raise ValueError(f"Tunings: fuse {self.fuse!r}, expected a tuple of names from {FUSIONS}")
    for name in ("attention_impl", "prefill_attention_impl"):
      v = getattr(self, name)
      if v is not None and v not in ATTENTION_IMPLS:
        raise ValueError(f"Tunings: {name} {v!r}, expected one of {ATTENTION_IMPLS} or None")
    for name, least in (("miss_lanes", 1), ("miss_eager", 0)):
      v = getattr(self, name)
      if v is not None and (not isinstance(v, int) or v < least):
        raise ValueError(f"Tunings: {name} {v!r}, expected an int >= {least} or None")
    for name in ("tier_block", "tier_span"):
      b = getattr(self, name)
      if b is not None and (not isinstance(b, int) or b < 1 or b & (b - 1)):
        raise ValueError(f"Tunings: {name} {b!r}, expected a power of two or None")

  def pick(self, field: str, qtype: str):
    """The tuning of kernel `field` for weights of `qtype`: the ByType's entry, or the one value for every type."""
    v = getattr(self, field)
    return v.get(qtype) if isinstance(v, ByType) else v

  def replace(self, **kw) -> "Tunings":
    return dataclasses.replace(self, **kw)


DEFAULT = Tunings()


def pick(tunings: Tunings | None, field: str, qtype: str | None = None):
  """`tunings.pick(field, qtype)` (or the field itself without a type), None when tunings is None."""
  if tunings is None:
    return None
  return tunings.pick(field, qtype) if qtype is not None else getattr(tunings, field)
