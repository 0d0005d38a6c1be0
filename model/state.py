"""`ModelState`: everything the pure steps of `model.api` carry from one call to the next, and `init_state`.

A state pytree holds arrays; every size that shapes a trace is a static field of its part:
- `ring` (model.kv_ring.KVRing): the main K/V ring of the attention layers (a hybrid model's full-attention
  layers only), capacity R static;
- `mtp_ring` (KVRing): the NextN drafter's own ring, capacity W static (None without NextN drafting);
- `experts` (model.expert_cache.ExpertCache): device slots over the routed experts' store (None: every expert
  resident);
- `host` (model.host_tier.HostTier): positions older than the ring's window, in (pinned) host memory (None:
  the ring holds the whole request);
- `recurrent` (model.recurrent.RecurrentState): a hybrid model's Gated DeltaNet layers' conv windows and delta
  states, fixed size (None without such layers).
The position of the next token is `ring.length`. Each block of the decoder receives its own layer's part
(`KVRing.cache(i, host)`) and returns it.

>>> from configs.presets import TINY_QWEN3MOE as cfg
>>> st = init_state(cfg, capacity=256)
>>> int(st.ring.length), st.ring.capacity, st.mtp_ring is None
(0, 256, True)
"""
from __future__ import annotations

from flax import struct

from model.config import ModelConfig
from model.expert_cache import ExpertCache
from model.host_tier import HostTier
from model.kv_ring import KVRing
from model.recurrent import RecurrentState

ATTN_BLOCK = 256


@struct.dataclass
class ModelState:
  ring: KVRing                          # main K/V ring (capacity R static)
  mtp_ring: KVRing | None = None        # NextN drafter ring (capacity W static): entry j is the draft input at j
  experts: ExpertCache | None = None    # expert slots over the store (None: every expert resident)
  host: HostTier | None = None          # host tier: positions older than the ring's window
  recurrent: RecurrentState | None = None   # Gated DeltaNet layers' state (hybrid models)


def init_state(cfg: ModelConfig, capacity: int, kv: str = "bf16", mtp_window: int | None = None,
               attn_block: int = ATTN_BLOCK, scratch: int = 0) -> ModelState:
  """Empty state: a main ring of `capacity` slots (attention layers only), a zero recurrent state for a hybrid
  model's DeltaNet layers and, for models with NextN blocks and an `mtp_window`, a
  drafter ring that sees the last `mtp_window` entries (capacity: window + scratch, rounded up to a whole
  attention block). `scratch` reserves slots for speculative overshoot (k + 1 for k drafts)."""
  blk = min(attn_block, capacity)
  ring = KVRing.create(len(cfg.attention_layers), capacity, cfg.n_kv_heads, cfg.head_dim, kv, block=blk,
                       scratch=scratch)
  mtp = None
  if cfg.n_nextn and mtp_window:
    cap = mtp_window + scratch
    mblk = min(attn_block, cap)
    cap = -(-cap // mblk) * mblk
    mtp = KVRing.create(cfg.n_nextn, cap, cfg.n_kv_heads, cfg.head_dim, kv, block=mblk, scratch=cap - mtp_window)
  return ModelState(ring, mtp, recurrent=RecurrentState.create(cfg) if cfg.recurrent_layers else None)
