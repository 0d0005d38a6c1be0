"""`kv_plan`: the memory plan computed before anything is allocated.

Items (device unless noted): weights, expert cache slots, main ring (mode 0; a hybrid model's attention layers
only), the recurrent state of a hybrid model's DeltaNet layers and, with k drafts, the k + 1 per-token states a
verify pass keeps for its rollback, host tier (mode 1, pinned host memory) and the largest piece of one layer's
tier that attention moves to the device ("tier pieces"), drafter ring (mode 2, sized from --mtp_window),
workspace; with expert slots and prefill chunks that stream each block's experts, "streamed experts" (phase
"prefill": live before the slots are allocated, so the device holds the larger of the two, not both);
free = budget - the device at its fullest. A plan over the budget is refused with a one-line error naming the
largest items. Under a mesh (model.mesh) the plan has a row per device (its share of the params, the
replicated rest) and is refused naming the first device over the budget.

>>> from configs.presets import QWEN3MOE_30B_A3B as cfg
>>> p = make_plan(cfg, weight_bytes=13 << 30, ring=32768, kv="int8", budget=24 << 30)
>>> round(p.get("main ring") / GiB, 3)               # 48 layers x 4 kv heads x 128 x (K + V) + scales, 32K tokens
1.547
>>> make_plan(cfg, weight_bytes=13 << 30, ring=131072, kv="bf16", budget=16 << 30).check()
Traceback (most recent call last):
...
decode.kv_plan.PlanError: memory plan: 25.80 GiB on the device exceeds the budget 16.00 GiB (largest: weights 13.00 GiB, main ring 12.00 GiB, workspace 0.80 GiB)
>>> from configs.presets import QWEN3NEXT_80B_A3B as hybrid     # 12 attention layers of 48 hold K/V
>>> p = make_plan(hybrid, weight_bytes=30 << 30, ring=32768, kv="int8", k=3)
>>> [round(p.get(n) / GiB, 3) for n in ("main ring", "recurrent state", "verify states")]
[0.381, 0.074, 0.294]
>>> p = make_plan(hybrid, weight_bytes=30 << 30, ring=32768, kv="int8", k=3, max_context=139264)
>>> p.get("tier pieces") / 2**20                        # one layer's span of 16,384 positions, K and V and scales
16.25
"""
from __future__ import annotations

import dataclasses
import math
import re

from model.config import ModelConfig

GiB = 1 << 30
_KV_BYTES = {"f32": 4, "bf16": 2, "int8": 1}


class PlanError(ValueError):
  """The plan does not fit the device budget (one line)."""


def parse_bytes(s: str | int | None) -> int | None:
  """'24GiB', '24G', '512MiB', '1e9' or an int -> bytes; anything else (or under one byte) is a PlanError."""
  if s is None or isinstance(s, int):
    return s
  m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?B?)\s*", s)
  v = math.nan
  if m:
    try:
      v = float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2)]
    except ValueError:                      # a number float() refuses ("1.2.3")
      pass
  if not math.isfinite(v) or v < 1:
    raise PlanError(f"--device_budget: {s!r}, expected a size such as 24GiB")
  return int(v)


def kv_bytes_per_token(cfg: ModelConfig, n_layers: int, kv: str) -> int:
  per = 2 * n_layers * cfg.n_kv_heads * cfg.head_dim * _KV_BYTES[kv]
  if kv == "int8":
    per += 2 * n_layers * cfg.n_kv_heads * 4          # absmax scales
  return per


@dataclasses.dataclass(frozen=True)
class Item:
  name: str
  bytes: int
  where: str = "device"     # device | host
  mode: int | None = None   # kv_plan mode of a cache item (0 main ring, 1 host tier, 2 drafter ring)
  phase: str | None = None  # "prefill": live only while the prompt's streamed chunks run, before the expert slots
                            # exist (decode.engine.start_request allocates them after), so it shares their memory


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """The plan's items (under a mesh: those of its fullest device, whose share of the params is the "weights" item)
  and the budget of each device. `devices` (under a mesh): (device, bytes of the params it holds) per device; every
  other device item (rings, state, workspace) is replicated, on each device whole."""
  items: tuple[Item, ...]
  budget: int | None
  devices: tuple[tuple[str, int], ...] = ()

  @property
  def steady_bytes(self) -> int:
    """Bytes on the device once the expert slots exist: every device item but the prefill-phase ones."""
    return sum(i.bytes for i in self.items if i.where == "device" and i.phase is None)

  @property
  def device_bytes(self) -> int:
    """Bytes on the device at its fullest (under a mesh: on the fullest device): the steady items, plus what the
    prefill-phase items need beyond the slots they precede."""
    early = sum(i.bytes for i in self.items if i.where == "device" and i.phase == "prefill")
    return self.steady_bytes + max(0, early - self.get("expert cache slots"))

  def device_totals(self) -> list[tuple[str, int]]:
    """(device, its bytes) per device: one row "device" without a mesh; under one each device's share of the params
    plus the replicated items."""
    if not self.devices:
      return [("device", self.device_bytes)]
    rest = self.device_bytes - self.get("weights")
    return [(d, w + rest) for d, w in self.devices]

  @property
  def free(self) -> int | None:
    """Budget less the device's bytes (under a mesh: the least any device has left)."""
    return None if self.budget is None else self.budget - max(t for _, t in self.device_totals())

  def get(self, name: str) -> int:
    return sum(i.bytes for i in self.items if i.name == name)

  def table(self) -> str:
    rows = ["| item | mode | where | GiB |", "| --- | ---: | --- | ---: |"]
    for i in self.items:
      where = i.where if i.phase is None else f"{i.where} ({i.phase})"
      rows.append(f"| {i.name} | {'' if i.mode is None else i.mode} | {where} | {i.bytes / GiB:.3f} |")
    if not self.devices:
      rows.append(f"| device total | | device | {self.device_bytes / GiB:.3f} |")
    if self.budget is not None:
      rows.append(f"| budget | | {'each device' if self.devices else 'device'} | {self.budget / GiB:.3f} |")
    if self.devices:
      rows += ["", "| device | weights GiB | replicated GiB | total GiB | free GiB |",
               "| --- | ---: | ---: | ---: | ---: |"]
      for (d, w), (_, t) in zip(self.devices, self.device_totals()):
        free = "" if self.budget is None else f"{(self.budget - t) / GiB:.3f}"
        rows.append(f"| {d} | {w / GiB:.3f} | {(t - w) / GiB:.3f} | {t / GiB:.3f} | {free} |")
    elif self.budget is not None:
      rows.append(f"| free | | device | {self.free / GiB:.3f} |")
    return "\n".join(rows)

  def check(self) -> "MemoryPlan":
    """The plan, or a PlanError naming the first device over the budget and the largest items."""
    if self.budget is None:
      return self
    for d, t in self.device_totals():
      if t > self.budget:
        items = [Item(i.name, dict(self.devices).get(d, i.bytes) if i.name == "weights" and self.devices else i.bytes)
                 for i in self.items if i.where == "device"]
        big = sorted(items, key=lambda i: -i.bytes)[:3]
        names = ", ".join(f"{i.name} {i.bytes / GiB:.2f} GiB" for i in big)
        where = "the device" if not self.devices else f"device {d}"
        raise PlanError(f"memory plan: {t / GiB:.2f} GiB on {where} exceeds the budget "
                        f"{self.budget / GiB:.2f} GiB (largest: {names})")
    return self

  def to_json(self) -> dict:
    out = {"items": [dataclasses.asdict(i) for i in self.items], "budget": self.budget, "free": self.free}
    if self.devices:
      out["devices"] = [{"device": d, "weights": w, "total": t} for (d, w), (_, t) in
                        zip(self.devices, self.device_totals())]
    return out


def make_plan(cfg: ModelConfig, *, weight_bytes: int, ring: int, kv: str = "bf16", max_context: int | None = None,
              mtp_window: int | None = None, k: int = 0, expert_bytes: int = 0, expert_cache_bytes: int | None = None,
              prefill_chunk: int = 1024, budget: int | None = None, fixed_ring: bool = True,
              devices: dict[str, int] | None = None, kv_shards: int = 1, tunings=None) -> MemoryPlan:
  """The plan for one request shape. weight_bytes: all params; expert_bytes: the routed experts' share of it;
  expert_cache_bytes: device slots when experts are cached (None: all resident). fixed_ring: the ring is the
  request's --kv_resident; False for an auto ring (the request's bucket), which grows and never gets a host tier.
  devices (under a mesh): the params' bytes on each device (model.mesh.device_bytes); the "weights" item is then
  the fullest device's, every other item replicated on each device, but the K/V rings, split by head over
  `kv_shards` devices (the mesh's tp where the heads divide: model.mesh.heads_split). tunings (ops.tuning.Tunings):
  the request's, for the tier's piece sizes (None: the defaults)."""
  items = []
  if devices:
    if expert_cache_bytes is not None:
      raise ValueError("make_plan: expert cache slots under a mesh are not supported")
    items.append(Item("weights", max(devices.values())))
  elif expert_cache_bytes is None:
    items.append(Item("weights", weight_bytes))
  else:
    items.append(Item("weights (non-expert)", weight_bytes - expert_bytes))
    items.append(Item("expert cache slots", expert_cache_bytes))
    items.append(Item("expert store", expert_bytes, "host"))
    if cfg.n_experts and prefill_chunk * cfg.top_k > cfg.n_experts:
      # a prefill chunk of more (token, expert) pairs than experts runs the direct path: each MoE block's experts
      # move from the store whole (model.ffn.MoE), one block's buffer beside its neighbour's; the engine
      # runs those chunks before it allocates the slots, so the two never share the device
      from model.expert_cache import expert_blocks
      items.append(Item("streamed experts", 2 * -(-expert_bytes // len(expert_blocks(cfg))), phase="prefill"))
  n_attn = len(cfg.attention_layers)                  # a hybrid model's ring holds its attention layers only
  items.append(Item("main ring", ring * kv_bytes_per_token(cfg, n_attn, kv) // kv_shards, mode=0))
  if cfg.recurrent_layers:
    from model.recurrent import state_bytes
    items.append(Item("recurrent state", state_bytes(cfg)))
    if k:                                              # a verify pass keeps each of its k + 1 tokens' states
      items.append(Item("verify states", (k + 1) * state_bytes(cfg)))
  if fixed_ring and max_context and max_context > ring:
    from decode.engine import tier_layout     # indexed by position: max_context plus the scratch slots
    scratch, tier = tier_layout(max_context, ring, k)
    items.append(Item("host tier", tier * kv_bytes_per_token(cfg, n_attn, kv), "host", mode=1))
    # attention moves the tier to the device one piece of one layer at a time (ops.attention.tier_attention): the
    # largest piece, a span (model.host_tier, the request's tunings), is on the device while it runs
    from model.host_tier import tier_block, tier_span
    from model.state import ATTN_BLOCK
    from ops.attention import tier_pieces
    tb = tier_block(ring - scratch, ATTN_BLOCK, tunings and tunings.tier_block)
    span = tier_span(tb, tunings and tunings.tier_span)
    items.append(Item("tier pieces", max(tier_pieces(tier, tb, span)) * kv_bytes_per_token(cfg, 1, kv)))
  if cfg.n_nextn and mtp_window:
    items.append(Item("drafter ring", (mtp_window + k + 1) * kv_bytes_per_token(cfg, cfg.n_nextn, kv) // kv_shards,
                      mode=2))
  # activations of one prefill chunk: residual stream, q/k/v, expert hidden, last logits (float32), plus the
  # grouped expert GEMM's row tiles (ops/moe_grouped_pallas: <= T*k + E*(M-1) rows) holding the gathered x
  # (float32, then in the piece layout), its output, and the per-pair outputs [T*k, D]
  act = prefill_chunk * 4 * (4 * cfg.d_model + 2 * cfg.n_heads * cfg.head_dim + 2 * cfg.top_k * cfg.d_ff_expert)
  if cfg.n_experts and prefill_chunk > 16:
    from ops.moe_grouped_pallas import tile_rows
    pairs = prefill_chunk * cfg.top_k
    rows = pairs + min(cfg.n_experts, pairs) * (tile_rows(pairs, cfg.n_experts) - 1)
    act += rows * 4 * (3 * cfg.d_model + cfg.d_ff_expert) + pairs * 4 * cfg.d_model
  items.append(Item("workspace", act + 4 * cfg.vocab_size * (k + 1) * 4))
  return MemoryPlan(tuple(items), budget, tuple((devices or {}).items()))


def param_bytes(params) -> tuple[int, int]:
  """(all params, routed experts) in bytes, as they sit in memory (packed QTensors counted packed)."""
  import jax

  from ops.qtensor import QTensor
  leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, QTensor))
  nb = lambda x: x.nbytes if isinstance(x, QTensor) else int(x.size * x.dtype.itemsize)  # noqa: E731
  total = sum(nb(x) for _, x in leaves)
  experts = sum(nb(x) for p, x in leaves if "_exps" in jax.tree_util.keystr(p))
  return total, experts


def device_budget(flag: str | None) -> int | None:
  """--device_budget, else the accelerator's own limit (None on CPU: no limit)."""
  if flag:
    return parse_bytes(flag)
  import jax
  d = jax.devices()[0]
  if d.platform == "cpu":
    return None
  try:
    return int(d.memory_stats()["bytes_limit"])
  except Exception:  # noqa: BLE001 - some backends report no stats
    return None


def host_memory() -> int | None:
  """The host's physical memory in bytes (None where the OS does not say)."""
  import os
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def check_host_memory(plan: MemoryPlan, limit: int | None = None) -> MemoryPlan:
  """A plan without a device budget (CPU, where device memory is host memory) refused when all its items, device
  and host, exceed `limit` (default: host_memory()): a PlanError naming the largest items."""
  limit = host_memory() if limit is None else limit
  # under a mesh of CPU devices every device's items are in host memory
  total = sum(t for _, t in plan.device_totals()) + sum(i.bytes for i in plan.items if i.where != "device")
  if limit is not None and total > limit:
    big = sorted(plan.items, key=lambda i: -i.bytes)[:3]
    names = ", ".join(f"{i.name} {i.bytes / GiB:.2f} GiB" for i in big)
    raise PlanError(f"memory plan: {total / GiB:.2f} GiB exceeds the host's memory {limit / GiB:.2f} GiB (no device "
                    f"budget on CPU; largest: {names})")
  return plan


def plan_request(model, *, ring: int, kv: str, max_context: int | None, mtp_window: int | None, k: int,
                 expert_cache: str = "all", budget: int | None = None, prefill_chunk: int = 1024,
                 fixed_ring: bool = True, tunings=None) -> tuple[MemoryPlan, int | None]:
  """The plan of one request and the expert-cache slots it gives: (plan, slots or None for all resident).

  expert_cache: "all" | "auto" (slots from what is free after everything else; all resident, slots None, when
  every expert fits) | a number of slots.
  prefill_chunk: tokens per prefill call, the prompt's first (the workspace; with slots, a chunk of more (token,
  expert) pairs than experts also needs two streamed blocks, before the slots exist: `auto` sizes the slots from
  what the steady items leave; the engine's chunk is decode.engine.prefill_chunk(gen));
  fixed_ring, tunings: as make_plan's (False for an auto ring: no host tier)."""
  from model.mesh import device_bytes, heads_split, mesh_of, tp_of
  total, experts = param_bytes(model.params)
  base = dict(weight_bytes=total, expert_bytes=experts, ring=ring, kv=kv, max_context=max_context,
              mtp_window=mtp_window, k=k, budget=budget, prefill_chunk=prefill_chunk, fixed_ring=fixed_ring,
              tunings=tunings)
  if mesh_of(model.params) is not None:          # per device: its share of the params, the rest replicated
    if expert_cache != "all":
      raise PlanError(f"memory plan: --expert_cache {expert_cache} under a mesh, expected all (every expert resident)")
    mesh = mesh_of(model.params)
    shards = tp_of(mesh) if heads_split(mesh, model.cfg.n_kv_heads) else 1
    return make_plan(model.cfg, **base, devices=device_bytes(model.params), kv_shards=shards).check(), None
  if expert_cache == "all":
    return make_plan(model.cfg, **base).check(), None
  from model import expert_cache as xc
  slab = max(xc.slab_bytes(model.params, model.cfg).values())
  n_experts_total = len(xc.expert_blocks(model.cfg)) * model.cfg.n_experts
  if expert_cache == "auto":
    if budget is None:
      return make_plan(model.cfg, **base).check(), None      # no budget known (CPU): everything resident
    slots = max(0, (budget - make_plan(model.cfg, **base, expert_cache_bytes=0).steady_bytes) // slab)
    if slots >= n_experts_total:                             # every expert fits:
      return make_plan(model.cfg, **base).check(), None      # all resident, no cache to run
  else:
    slots = int(expert_cache)
  if slots < model.cfg.top_k:
    if budget is None:
      raise PlanError(f"memory plan: {slots} expert slots < top_k {model.cfg.top_k} (a token's experts must all be "
                      f"resident)")
    raise PlanError(f"memory plan: {slots} expert slots < top_k {model.cfg.top_k} (budget {budget / GiB:.2f} GiB "
                    f"leaves {max(0, budget - make_plan(model.cfg, **base, expert_cache_bytes=0).device_bytes) / GiB:.2f} GiB for experts)")
  return make_plan(model.cfg, **base, expert_cache_bytes=slots * slab).check(), slots
