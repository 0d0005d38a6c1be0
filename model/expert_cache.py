"""Expert cache: N device slots (one pool per expert-tensor signature, shared across layers) over a store of
every expert's packed blocks (pinned host memory on a GPU).

The store is the params' routed-expert tensors (gate/up/down_exps of every MoE block). `place_store` moves them
to the memory kind `store_memory_kind()` picks: "pinned_host" on a GPU that exposes it, else "device" (CPU: a
no-op). Inside the jitted step a miss reads its expert's rows from the store with a dynamic slice and moves just
those rows to the device (`jax.device_put(row, jax.memory.Space.Device)`: XLA's host offloader turns the
dynamic-slice + MoveToDevice pair into one host -> device copy of the slice), so the bytes moved are the
missed experts' slabs only. `ExpertCache.store_memory_kind` records where the store was when the cache was made.

State is an explicit pytree that goes in and out of the decode step like the KV ring:
  slot_of [n_blocks, E]  slot holding (block, expert), -1 if not resident
  pools[p].{gate, up, down}  the packed planes of S_p experts (QTensor.planes with the expert dim cut to S_p:
                             the same bytes as the store)
  pools[p].owner [S_p]  block * E + expert held by each slot (-1 empty); pools[p].stamp [S_p]  LRU clock or LFU count
  hits / misses / steps [n_blocks]  per-block counters (steps: passes through the cache, one per forward step of
  the block, one per token in _cached_moe's token-by-token fallback; the NextN blocks are the last n_nextn rows:
  a class of their own, decode-only). Bytes moved host -> device are misses x the block's per-expert packed
  bytes (`bytes_moved`, exact integers).
A step that needs an expert that is not resident evicts the least recently (or frequently) used slot not
needed by the same step and copies the expert's slabs from the store. The MoE then runs the same gather
computation as with every expert resident, on slot ids instead of expert ids, so outputs are bitwise equal
whenever a step's routed experts fit the pool (N >= T * top_k per layer class; for one decode token N >= top_k).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from model.config import ModelConfig
from ops.attention import in_host_memory, on_device
from ops.qtensor import QTensor

POLICIES = ("lru", "lfu")
_BIG = jnp.iinfo(jnp.int32).max


@struct.dataclass
class Pool:
  gate: tuple            # planes [S, ...]
  up: tuple
  down: tuple
  owner: jax.Array
  stamp: jax.Array

  @property
  def n_slots(self) -> int:
    return self.owner.shape[0]

  @property
  def slot_bytes(self) -> int:
    return int(sum(p[0].size * p.dtype.itemsize for t in (self.gate, self.up, self.down) for p in t))


@struct.dataclass
class ExpertCache:
  pools: tuple
  slot_of: jax.Array
  clock: jax.Array
  hits: jax.Array
  misses: jax.Array
  steps: jax.Array
  pool_of_block: tuple = struct.field(pytree_node=False)    # block index -> pool index (-1: dense block)
  policy: str = struct.field(pytree_node=False, default="lru")
  n_trunk: int = struct.field(pytree_node=False, default=0)  # blocks < n_trunk are the trunk, the rest NextN
  store_memory_kind: str = struct.field(pytree_node=False, default="device")  # where the store was at create()

  @property
  def n_slots(self) -> int:
    return sum(p.n_slots for p in self.pools)

  @property
  def bytes_moved(self) -> list[int]:
    """Bytes copied store -> slots per block (host -> device when the store is in pinned host memory): misses x
    the block's per-expert packed bytes (gate + up + down slabs)."""
    return [int(m) * (self.pools[p].slot_bytes if p >= 0 else 0) for m, p in zip(self.misses, self.pool_of_block)]

  def stats(self) -> dict:
    """Counters per block, plus bytes_per_step: the mean bytes moved by one forward step of the trunk (sum over
    trunk blocks of bytes / steps) and of the NextN blocks (bytes_per_step_nextn)."""
    moved, steps = self.bytes_moved, [int(x) for x in self.steps]

    def per_step(blocks):
      return float(sum(moved[b] / steps[b] for b in blocks if steps[b]))

    nb = len(self.pool_of_block)
    return {"hits": [int(x) for x in self.hits], "misses": [int(x) for x in self.misses], "bytes_moved": moved,
            "steps": steps, "bytes_per_step": per_step(range(self.n_trunk)),
            "bytes_per_step_nextn": per_step(range(self.n_trunk, nb)), "slots": self.n_slots, "policy": self.policy,
            "store_memory_kind": self.store_memory_kind}


def expert_blocks(cfg: ModelConfig) -> list[int]:
  """Block indices (trunk then NextN) that have routed experts."""
  return [i for i in range(cfg.n_blocks) if cfg.is_moe_layer(i)]


def _block_ffn(params: dict, cfg: ModelConfig, i: int) -> dict:
  return params[f"blk_{i}"]["ffn"] if i < cfg.n_layers else params[f"mtp_{i - cfg.n_layers}"]["blk"]["ffn"]


def _planes(w) -> tuple:
  """A packed QTensor's planes, or a dense expert array as a single plane."""
  return w.planes if isinstance(w, QTensor) else (w,)


def _rebuild(w, planes: tuple):
  return w.replace(planes=planes) if isinstance(w, QTensor) else planes[0]


def _signature(ffn: dict) -> tuple:
  def sig(w):
    head = (w.qtype, w.n) if isinstance(w, QTensor) else ("dense", w.shape[-1])
    return head + (tuple((p.shape[1:], str(p.dtype)) for p in _planes(w)),)
  return tuple(sig(ffn[n]) for n in ("gate_exps", "up_exps", "down_exps"))


def signatures(params: dict, cfg: ModelConfig) -> tuple[list[tuple], dict[int, int]]:
  """The distinct expert signatures (qtype and slab shape of gate/up/down) and each MoE block's pool."""
  sigs, pool_of = [], {}
  for i in expert_blocks(cfg):
    ffn = _block_ffn(params, cfg, i)
    sig = _signature(ffn)
    if sig not in sigs:
      sigs.append(sig)
    pool_of[i] = sigs.index(sig)
  return sigs, pool_of


def slab_bytes(params: dict, cfg: ModelConfig) -> dict[int, int]:
  """Bytes of one expert (gate + up + down) per pool."""
  sigs, pool_of = signatures(params, cfg)
  out = {}
  for i, p in pool_of.items():
    ffn = _block_ffn(params, cfg, i)
    out[p] = sum(int(q[0].size * q.dtype.itemsize) for n in ("gate_exps", "up_exps", "down_exps")
                 for q in _planes(ffn[n]))
  return out


def store_memory_kind(dev=None) -> str:
  """Where the expert store should live on `dev` (default: the first device): "pinned_host" when it is a GPU
  exposing that memory kind (misses then cross host -> device inside the step), else "device", where placing the
  store is a no-op (on CPU host memory is the device's memory: nothing to move)."""
  from model.host_tier import host_memory_kind      # one rule for the host tier and the expert store
  return host_memory_kind(dev) or "device"


def _memory_kind(x) -> str:
  """The memory kind of an array: its sharding's when concrete, else from its abstract value's memory space."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    return x.sharding.memory_kind or "device"
  return "pinned_host" if in_host_memory(x) else "device"


def place_store(params: dict, cfg: ModelConfig, kind: str | None = None) -> dict:
  """The params with every MoE block's routed-expert tensors (the store) in memory kind `kind` (default:
  `store_memory_kind()`); the same object when the store is there already. Other params stay where they are.
  Moving a store back to "device" (e.g. `--expert_cache auto` found that every expert fits) works the same way.

  With the store in pinned host memory the cached decode path reads it only through `ensure` (missed rows move to
  the device); a step that reads the experts directly (T * top_k > n_experts, e.g. a prefill chunk) must first
  move them to the device (`to_device`)."""
  kind = kind or store_memory_kind()
  if all(k == kind for ks in store_kinds(params, cfg).values() for k in ks):
    return params
  dev = jax.devices()[0]
  sh = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)
  out = dict(params)
  for i in expert_blocks(cfg):
    if i < cfg.n_layers:
      blk = out[f"blk_{i}"] = dict(out[f"blk_{i}"])
    else:
      mtp = out[f"mtp_{i - cfg.n_layers}"] = dict(out[f"mtp_{i - cfg.n_layers}"])
      blk = mtp["blk"] = dict(mtp["blk"])
    ffn = blk["ffn"] = dict(blk["ffn"])
    for n in ("gate_exps", "up_exps", "down_exps"):
      ffn[n] = _put(ffn[n], sh)
  return out


def _put(w, sharding):
  """A store tensor (QTensor or dense array) with its planes put in `sharding` (a memory kind)."""
  return _rebuild(w, tuple(jax.device_put(p, sharding) for p in _planes(w)))


def is_store_path(path: tuple) -> bool:
  """Whether a params path (tuple of keys) names a routed-expert tensor, i.e. part of the store."""
  return len(path) >= 2 and path[-2] == "ffn" and path[-1] in ("gate_exps", "up_exps", "down_exps")


def placer(kind: str):
  """A `load_params` hook that puts each routed-expert tensor in memory kind `kind` as soon as it is built, so
  device memory never holds the whole store while a model loads (a model larger than the device loads)."""
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)

  def place(path: tuple, param):
    return _put(param, sh) if is_store_path(path) else param
  return place


def store_kinds(params: dict, cfg: ModelConfig) -> dict[str, list[str]]:
  """The memory kinds of the store's arrays, per tensor path (for inspection)."""
  out = {}
  for i in expert_blocks(cfg):
    ffn = _block_ffn(params, cfg, i)
    for n in ("gate_exps", "up_exps", "down_exps"):
      out[f"{i}.{n}"] = [_memory_kind(p) for p in _planes(ffn[n])]
  return out


def to_device(w, after=None):
  """A store tensor (QTensor or dense array) moved to device memory inside a jitted step; unchanged when it is
  already there. For the paths that read the whole store (T * top_k > n_experts).

  `after` (an array of the step, e.g. the block's input): the move starts only once it is computed. Nothing else
  ties a store's copy to its block, so XLA schedules every block's copy at the program's start and holds all of
  them at once (a prefill chunk of the seed-mtp shape asked for 30.8 GiB, the whole store, where the plan counts
  two blocks). Each plane moves in two dynamic slices of its experts whose offset (0) comes through an
  optimization barrier with `after` (a slice of the whole extent would be simplified away), joined on the device."""
  def move(p):
    if after is None or not in_host_memory(p) or p.shape[0] < 2:
      return on_device(p)
    off = jax.lax.optimization_barrier((jnp.zeros((), jnp.int32), after))[0]
    h = p.shape[0] // 2
    return jnp.concatenate([on_device(jax.lax.dynamic_slice_in_dim(p, off + a, n, axis=0))
                            for a, n in ((0, h), (h, p.shape[0] - h))], axis=0)
  return _rebuild(w, tuple(move(p) for p in _planes(w)))


def _fetch(plane: jax.Array, e) -> jax.Array:
  """Row e of a store plane, [1, ...] in device memory: a dynamic slice, then (store on the host) a move of just
  that slice to the device."""
  return on_device(jax.lax.dynamic_slice_in_dim(plane, e, 1, axis=0))


def create(params: dict, cfg: ModelConfig, n_slots: int, policy: str = "lru") -> ExpertCache:
  """Empty cache of `n_slots` slots, split over pools in proportion to the blocks that use each."""
  if policy not in POLICIES:
    raise ValueError(f"--expert_policy {policy!r}, expected one of {POLICIES}")
  sigs, pool_of = signatures(params, cfg)
  blocks_per_pool = [sum(1 for p in pool_of.values() if p == j) for j in range(len(sigs))]
  total_blocks = sum(blocks_per_pool)
  pools = []
  for j, sig in enumerate(sigs):
    s = max(cfg.top_k, n_slots * blocks_per_pool[j] // total_blocks)
    planes = [tuple(jnp.zeros((s,) + shape, dt) for shape, dt in t[2]) for t in sig]
    pools.append(Pool(*planes, jnp.full((s,), -1, jnp.int32), jnp.zeros((s,), jnp.int32)))
  nb = cfg.n_blocks
  kinds = {k for ks in store_kinds(params, cfg).values() for k in ks}
  return ExpertCache(tuple(pools), jnp.full((nb, cfg.n_experts), -1, jnp.int32), jnp.zeros((), jnp.int32),
                     jnp.zeros((nb,), jnp.int32), jnp.zeros((nb,), jnp.int32), jnp.zeros((nb,), jnp.int32),
                     tuple(pool_of.get(i, -1) for i in range(nb)), policy, cfg.n_layers,
                     "/".join(sorted(kinds)) or "device")


def ensure(cache: ExpertCache, block: int, ids_M: jax.Array, gate: QTensor, up: QTensor, down: QTensor,
           n_experts: int, lanes: int = 1, eager: int = 0):
  """Make experts ids_M of `block` resident; returns (slot ids [M], cache). Slots needed by this call are never
  evicted by it (requires M <= the pool's slots). A miss copies its expert's rows from the store (gate, up, down:
  the params' tensors, possibly in pinned host memory) into the evicted slot; a hit moves nothing.

  Hits, victims and stamps are computed for all M entries at once; only the copies run in a loop. The distinct
  misses go in groups of `lanes` (one scatter per plane a group; a group's lanes past the last miss fetch a row
  and write nothing): the first `eager` groups unconditionally, the rest in a `lax.while_loop` with the miss count
  as its bound. On a GPU each loop test waits for the device (its predicate goes to the host), so a layer pays
  ceil(max(misses - eager x lanes, 0) / lanes) + 1 waits (none when eager x lanes >= M: no loop) for at most
  lanes - 1 wasted row copies a layer (eager groups: whole groups when the layer misses less). lanes 1, eager 0:
  misses + 1 waits, no wasted copy. Victims: the misses, in entry order, take the slots with the lowest stamp (LRU
  clock or LFU count) among those no hit of this call uses, lowest slot first on ties. The state is the same
  whatever `lanes` and `eager` are."""
  if lanes < 1 or eager < 0:
    raise ValueError(f"expert cache copies: lanes {lanes} (expected >= 1), eager {eager} (expected >= 0)")
  p = cache.pool_of_block[block]
  pool = cache.pools[p]
  S = pool.n_slots
  M = ids_M.shape[0]
  lanes = min(lanes, M)
  groups = -(-M // lanes)
  eager = min(eager, groups)
  nb = cache.slot_of.shape[0]
  clock = cache.clock + 1
  m_M = jnp.arange(M)
  slot_M = cache.slot_of[block, ids_M]
  first_M = ~jnp.any((ids_M[:, None] == ids_M[None, :]) & (m_M[None, :] < m_M[:, None]), axis=1)
  miss_M = first_M & (slot_M < 0)
  n_miss = jnp.sum(miss_M).astype(jnp.int32)
  held = jnp.zeros((S,), bool).at[jnp.where(slot_M >= 0, slot_M, S)].set(True, mode="drop")
  # the M lowest scores, lowest slot first on ties (lax.top_k keeps the lower index first): one small kernel,
  # where a full sort of the pool's S stamps (16K slots on seed-mtp at 24 GiB) would run per layer and step
  victims = jax.lax.top_k(-jnp.where(held, _BIG, pool.stamp), M)[1].astype(jnp.int32)
  missing = jnp.nonzero(miss_M, size=M, fill_value=0)[0]          # entry index of the i-th distinct miss

  def load(j, pool, slot_of):
    """Copy group j: the misses j x lanes .. (j + 1) x lanes - 1 below n_miss (the others are dropped: index S,
    or block row nb, is out of range). A victim's old owner is never one of this call's experts (it would be a
    hit, holding the slot), so a group's evictions and loads commute."""
    i_L = j * lanes + jnp.arange(lanes)
    live_L = i_L < n_miss
    i_L = jnp.minimum(i_L, M - 1)
    v_L, e_L = victims[i_L], ids_M[missing[i_L]]
    dst_L = jnp.where(live_L, v_L, S)
    old_L = pool.owner[v_L]
    slot_of = slot_of.at[jnp.where(live_L & (old_L >= 0), old_L // n_experts, nb), old_L % n_experts].set(
        -1, mode="drop")

    def put(dst, src):
      return tuple(d.at[dst_L].set(jnp.concatenate([_fetch(s_, e_L[a]) for a in range(lanes)]), mode="drop")
                   for d, s_ in zip(dst, _planes(src)))
    pool = pool.replace(gate=put(pool.gate, gate), up=put(pool.up, up), down=put(pool.down, down),
                        owner=pool.owner.at[dst_L].set(block * n_experts + e_L, mode="drop"),
                        stamp=pool.stamp.at[dst_L].set(0, mode="drop"))
    return pool, slot_of.at[jnp.where(live_L, block, nb), e_L].set(v_L, mode="drop")

  slot_of = cache.slot_of
  for j in range(eager):
    pool, slot_of = load(j, pool, slot_of)
  if eager < groups:
    def body(c):
      j, pool, slot_of = c
      return (j + 1,) + load(j, pool, slot_of)
    _, pool, slot_of = jax.lax.while_loop(lambda c: c[0] * lanes < n_miss, body, (jnp.int32(eager), pool, slot_of))
  slots = slot_of[block, ids_M]
  used = jnp.zeros((S,), bool).at[slots].set(True)
  stamp = jnp.where(used, clock, pool.stamp) if cache.policy == "lru" else pool.stamp + used.astype(jnp.int32)
  pools = cache.pools[:p] + (pool.replace(stamp=stamp),) + cache.pools[p + 1:]
  return slots, cache.replace(pools=pools, slot_of=slot_of, clock=clock, hits=cache.hits.at[block].add(M - n_miss),
                              misses=cache.misses.at[block].add(n_miss), steps=cache.steps.at[block].add(1))


def pool_tensors(cache: ExpertCache, block: int, gate: QTensor, up: QTensor, down: QTensor):
  """The pool of `block` as QTensors indexed by slot (same qtype, n and kernel as the store's)."""
  pool = cache.pools[cache.pool_of_block[block]]
  return _rebuild(gate, pool.gate), _rebuild(up, pool.up), _rebuild(down, pool.down)
