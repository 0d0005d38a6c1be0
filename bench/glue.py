"""The glue kernels' switch and tuning overrides as one string, shared by the benchmark CLIs (`bench.step --glue`,
`bench.cells --glue`): "on" | "off" | "on/key=value/..." -> (glue on, ops.tuning.Tunings)."""
from __future__ import annotations

from absl import app

GLUE_USAGE = ("expected on, off, or on with /-separated overrides rope=N, router=P:DC:W:RW, norm=W, "
              "xnat=T:B+T:B or 0, qmm=P, x8=dp4a|int, px8=dp4a|int, dx8=dp4a|int, tier=N, span=N (powers of two), "
              "fuse=NAME+NAME or none, miss=L:G")


def glue_options(spec: str):
  """(glue on, the Tunings of its overrides) for one --glue value; a malformed value is a one-line usage error.
  Overrides, "/"-separated after "on":
    rope=N             ops.rope_write_pallas.Tuning(q_programs=N) (q programs per token)
    router=P:DC:W:RW   ops.router_pallas.Tuning (logits programs, D chunk, warps; top-k warps)
    norm=W             ops.rmsnorm_pallas.Tuning(num_warps=W) (the norm kernels' warps: more loads in flight
                       for a row with residual pieces)
    xnat=T:B+T:B | 0   the quantized kernels' x layout per type (ops.qmatmul_pallas.Tuning.natural_b for the
                       projections and both MoE kernels: natural order up to B tokens; types not named and 0:
                       the permuted view)
    qmm=P              the projections' ops.qmatmul_pallas.Tuning(programs=P) (BN halves to reach P programs)
    x8=dp4a | int      the routed experts' gate/up on 8-bit x with integer dots (its tile's
                       ops.qmatmul_pallas.Tuning.x8, for the types of ops.dot8.TILES; the others keep the float tiles)
    px8=dp4a | int     the same for the projections (the norm rounds for wqkv / win, XLA for the others)
    dx8=dp4a | int     the routed experts' down on h rounded to 8 bits (gate/up's epilogue rounds it; sets the
                       gate/up tile's BN to 32 and programs to 0); the down type must be one of ops.dot8.TILES
    tier=N             positions per block of attention over a host tier (ops.tuning.Tunings.tier_block)
    span=N             positions per span of it, the pieces a row sees whole (ops.tuning.Tunings.tier_span)
    fuse=NAME+NAME     the work moved into a neighbouring kernel (ops.tuning.FUSIONS; Tunings.fuse; default all
                       of them), or none
    miss=L:G           the expert cache's miss copies in groups of L, the first G groups before its loop
                       (Tunings.miss_lanes, miss_eager)

  >>> glue_options("on/rope=1")[1].rope_write
  Tuning(q_programs=1, num_warps=None)
  """
  from ops import dot8, moe_pallas, qmatmul_pallas, rmsnorm_pallas, rope_write_pallas, router_pallas
  from ops.tuning import ByType, Tunings
  base, *parts = spec.split("/")
  if base not in ("on", "off") or (base == "off" and parts):
    raise app.UsageError(f"--glue {spec!r}: {GLUE_USAGE}")
  kw = {}
  proj, gate, down = ({t: {} for t in qmatmul_pallas.KERNEL_TYPES} for _ in range(3))    # tile fields per type
  for part in parts:
    key, _, val = part.partition("=")
    try:
      if key == "rope":
        kw["rope_write"] = rope_write_pallas.Tuning(q_programs=int(val))
      elif key == "norm":
        if int(val) < 1:
          raise ValueError(val)
        kw["rmsnorm"] = rmsnorm_pallas.Tuning(num_warps=int(val))
      elif key == "router":
        p, dc, w, rw = (int(a) for a in val.split(":"))
        kw["router"] = router_pallas.Tuning(programs=p, dc=dc, warps=w, route_warps=rw)
      elif key == "xnat":
        named = {} if val == "0" else {t: int(b) for t, b in (v.split(":") for v in val.split("+"))}
        if not set(named) <= set(qmatmul_pallas.KERNEL_TYPES):
          raise ValueError(val)
        for t in qmatmul_pallas.KERNEL_TYPES:
          proj[t]["natural_b"] = gate[t]["natural_b"] = down[t]["natural_b"] = named.get(t, 0)
      elif key in ("x8", "px8"):
        if val not in dot8.DOTS:
          raise ValueError(val)
        for t in dot8.TILES:
          (gate if key == "x8" else proj)[t]["x8"] = val
      elif key == "dx8":
        if val not in dot8.DOTS:
          raise ValueError(val)
        for t in qmatmul_pallas.KERNEL_TYPES:    # by the gate/up type; down's own type must have 8-bit tiles
          down[t]["x8"] = val
          gate[t].update(BN=32, programs=0)      # gate/up rounds h in whole 32-value blocks
      elif key == "qmm":
        if int(val) < 0:
          raise ValueError(val)
        for t in qmatmul_pallas.KERNEL_TYPES:
          proj[t]["programs"] = int(val)
      elif key == "fuse":
        kw["fuse"] = () if val == "none" else tuple(val.split("+"))
        Tunings(fuse=kw["fuse"])                           # names from FUSIONS, else ValueError
      elif key == "miss":
        lanes, eager = (int(a) for a in val.split(":"))
        kw.update(miss_lanes=lanes, miss_eager=eager)
        Tunings(miss_lanes=lanes, miss_eager=eager)        # lanes >= 1, eager >= 0, else ValueError
      elif key in ("tier", "span"):
        name = {"tier": "tier_block", "span": "tier_span"}[key]
        kw[name] = int(val)
        Tunings(**{name: kw[name]})                        # a power of two, else ValueError
      else:
        raise ValueError(key)
    except ValueError:
      raise app.UsageError(f"--glue {spec!r}: override {part!r}, {GLUE_USAGE}") from None
  if any(proj.values()):
    kw["qmatmul"] = ByType(**{t: qmatmul_pallas.Tuning(**f) for t, f in proj.items()})
  if any(gate.values()) or any(down.values()):
    tile = lambda f: qmatmul_pallas.Tuning(**f) if f else None
    kw["moe"] = ByType(**{t: moe_pallas.Tuning(gateup=tile(gate[t]), down=tile(down[t])) for t in gate})
  return base == "on", Tunings(**kw)
