"""Expert cache: N device slots (one pool per expert-tensor signature, shared across layers) over a store of
every expert's packed blocks (pinned host memory on a GPU).

State is an explicit pytree that goes in and out of the decode step like the KV ring:
  slot_of [n_blocks, E]  slot holding (block, expert), -1 if not resident
  pools[p].{gate, up, down}  the packed planes of S_p experts (QTensor.planes with the expert dim cut to S_p:
                             the same bytes as the store)
  pools[p].owner [S_p]  block * E + expert held by each slot (-1 empty); pools[p].stamp [S_p]  LRU clock or LFU count
  hits / misses / bytes [n_blocks]  per-block counters (the NextN blocks are the last n_nextn rows: a class of
  their own, decode-only)
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
  bytes_moved: jax.Array
  pool_of_block: tuple = struct.field(pytree_node=False)    # block index -> pool index (-1: dense block)
  policy: str = struct.field(pytree_node=False, default="lru")

  @property
  def n_slots(self) -> int:
    return sum(p.n_slots for p in self.pools)

  def stats(self) -> dict:
    return {"hits": [int(x) for x in self.hits], "misses": [int(x) for x in self.misses],
            "bytes_moved": [int(x) for x in self.bytes_moved], "slots": self.n_slots, "policy": self.policy}


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
  return ExpertCache(tuple(pools), jnp.full((nb, cfg.n_experts), -1, jnp.int32), jnp.zeros((), jnp.int32),
                     jnp.zeros((nb,), jnp.int32), jnp.zeros((nb,), jnp.int32), jnp.zeros((nb,), jnp.float32),
                     tuple(pool_of.get(i, -1) for i in range(nb)), policy)


def ensure(cache: ExpertCache, block: int, ids_M: jax.Array, gate: QTensor, up: QTensor, down: QTensor,
           n_experts: int):
  """Make experts ids_M of `block` resident; returns (slot ids [M], cache). Slots needed by this call are never
  evicted by it (requires M <= the pool's slots)."""
  p = cache.pool_of_block[block]
  pool = cache.pools[p]
  S = pool.n_slots
  clock = cache.clock + 1
  slab = float(pool.slot_bytes)

  def one(m, carry):
    pool, slot_of, used, hits, misses, moved, out = carry
    e = ids_M[m]
    s = slot_of[block, e]
    hit = s >= 0

    def load(args):
      pool, slot_of = args
      score = jnp.where(used, _BIG, pool.stamp)
      v = jnp.argmin(score).astype(jnp.int32)
      old = pool.owner[v]
      ob, oe = old // n_experts, old % n_experts
      slot_of = jnp.where(old >= 0, slot_of.at[ob, oe].set(-1), slot_of)
      put = lambda dst, src: tuple(d.at[v].set(s_[e]) for d, s_ in zip(dst, _planes(src)))  # noqa: E731
      pool = pool.replace(gate=put(pool.gate, gate), up=put(pool.up, up), down=put(pool.down, down),
                          owner=pool.owner.at[v].set(block * n_experts + e), stamp=pool.stamp.at[v].set(0))
      return (pool, slot_of.at[block, e].set(v)), v

    (pool, slot_of), s = jax.lax.cond(hit, lambda a: (a, s), load, (pool, slot_of))
    stamp = clock if cache.policy == "lru" else pool.stamp[s] + jnp.where(used[s], 0, 1)
    pool = pool.replace(stamp=pool.stamp.at[s].set(stamp))
    return (pool, slot_of, used.at[s].set(True), hits + hit, misses + (~hit), moved + jnp.where(hit, 0.0, slab),
            out.at[m].set(s))

  M = ids_M.shape[0]
  init = (pool, cache.slot_of, jnp.zeros((S,), bool), jnp.int32(0), jnp.int32(0), jnp.float32(0.0),
          jnp.zeros((M,), jnp.int32))
  pool, slot_of, _, h, mi, mv, slots = jax.lax.fori_loop(0, M, one, init)
  pools = cache.pools[:p] + (pool,) + cache.pools[p + 1:]
  return slots, cache.replace(pools=pools, slot_of=slot_of, clock=clock, hits=cache.hits.at[block].add(h),
                              misses=cache.misses.at[block].add(mi), bytes_moved=cache.bytes_moved.at[block].add(mv))


def pool_tensors(cache: ExpertCache, block: int, gate: QTensor, up: QTensor, down: QTensor):
  """The pool of `block` as QTensors indexed by slot (same qtype, n and kernel as the store's)."""
  pool = cache.pools[cache.pool_of_block[block]]
  return _rebuild(gate, pool.gate), _rebuild(up, pool.up), _rebuild(down, pool.down)
