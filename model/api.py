"""Pure, jitted entry points of the model: `prefill`, `decode_step`, `mtp_step`.

Each takes (params, inputs, state) and returns (logits, hidden, state); `cfg` (what the model is), `options`
(how it runs: model.options.Options) and block sizes are static keyword arguments, the state
(model.state.ModelState) is donated, the weights never are. The position of the next token is
`state.ring.length`.

>>> from configs.presets import TINY_QWEN3MOE as cfg
>>> from model.transformer import Decoder
>>> import jax, jax.numpy as jnp
>>> params = Decoder(cfg).init(jax.random.PRNGKey(0), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))["params"]
>>> st = init_state(cfg, capacity=256)
>>> logits, hidden, st = prefill(params, jnp.array([1, 2, 3]), st, cfg=cfg)
>>> int(st.ring.length), logits.shape
(3, (3, 1024))
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from model import host_tier
from model.config import ModelConfig
from model.kv_ring import KVRing
from model.options import DEFAULT, Options
from model.state import ATTN_BLOCK, ModelState, init_state  # noqa: F401  (the api's state types)
from model.transformer import Decoder, MTPBlock

# Float32 matmuls at full precision: XLA's default on GPUs is TF32, whose error (~1e-3 relative) differs between
# a 1-row step and a (k+1)-row verify pass and flips near-tied routing decisions (docs/PERF.md, GPU probe).
MATMUL_PRECISION = "highest"


def fuse_qkv(params: dict) -> dict:
  """The params with each attention's wq, wk, wv (and bq, bk, bv) stacked into one `wqkv` (`bqkv`) where they
  share a type (ops.qtensor.concat_rows): one matmul and one kernel launch instead of three, and the small k and
  v projections (N = Hkv * Dh rows) no longer run on a few programs each; likewise a Gated DeltaNet layer's wqkv,
  wz, wbeta and walpha into one `win` (four launches to one; beta and alpha are Hv rows each), and a SwiGLU's gate
  and up (the shared expert's `gateup_shexp`, a dense block's `gateup`). The bytes are the file's; every output row
  is computed as before. Applied by model.loader.load_model; unfused params run as
  well."""
  from ops.qtensor import concat_rows

  def walk(node):
    if not isinstance(node, dict):
      return node
    node = {k: walk(v) for k, v in node.items()}
    if all(n in node for n in ("wq", "wk", "wv")):
      w = concat_rows([node["wq"], node["wk"], node["wv"]])
      if w is not None:
        for n in ("wq", "wk", "wv"):
          del node[n]
        node["wqkv"] = w
        if all(n in node for n in ("bq", "bk", "bv")):
          node["bqkv"] = jnp.concatenate([node.pop("bq"), node.pop("bk"), node.pop("bv")])
    gdn = ("wqkv", "wz", "wbeta", "walpha")
    if all(n in node for n in gdn) and "conv" in node:     # a Gated DeltaNet layer's four input projections
      w = concat_rows([node[n] for n in gdn])
      if w is not None:
        for n in gdn:
          del node[n]
        node["win"] = w
    for g, u, name in (("gate_shexp", "up_shexp", "gateup_shexp"), ("gate", "up", "gateup")):
      if g in node and u in node:   # a SwiGLU's gate and up: one matmul, split after
        w = concat_rows([node[g], node[u]])
        if w is not None:
          del node[g], node[u]
          node[name] = w
    return node
  return walk(params)


def trunk_params(params: dict) -> dict:
  return {k: v for k, v in params.items() if not k.startswith("mtp_")}


def _block(ring: KVRing, attn_block: int) -> int:
  return min(attn_block, ring.capacity)


def forward(params, tokens_T, state: ModelState, *, cfg: ModelConfig, options: Options = DEFAULT,
            last_only: bool = False, attn_block: int = ATTN_BLOCK, keep_states: bool = False):
  """Run the trunk on T new tokens at positions ring.length + [0, T): (logits, hidden, state).

  keep_states (a verify pass of a hybrid model): also return the DeltaNet layers' states after each of the T
  tokens, a tuple of model.recurrent.RecurrentLayer (conv_T, delta_T), as a fourth result; `select_recurrent`
  then keeps those after the accepted prefix. A ring masks rejected positions; a recurrent state cannot.

  With a host tier, positions leaving the ring's window move to the tier before any layer writes, and each
  layer's attention merges the ring's part with the tier's. A caller whose positions all stay inside the window
  holds the tier out of the call instead (`split_idle_tier`): the trunk then compiles and runs ring-only."""
  ring = state.ring
  if tokens_T.shape[0] > ring.capacity:
    raise ValueError(f"forward: {tokens_T.shape[0]} tokens in one call, expected at most the ring's capacity "
                     f"{ring.capacity} (a call writes each slot at most once)")
  tokens_T = tokens_T.astype(jnp.int32)
  pos = ring.length + jnp.arange(tokens_T.shape[0], dtype=jnp.int32)
  block = _block(ring, attn_block)

  host = state.host
  if host is not None:
    host, ring = host_tier.evict_leaving(host, ring, pos)
  with jax.default_matmul_precision(MATMUL_PRECISION):
    logits, hidden, ring, experts, rec = Decoder(cfg, options, keep_states).apply(
        {"params": trunk_params(params)}, tokens_T, pos, ring, block, last_only, state.experts, host, state.recurrent)
  kept = None
  if keep_states and state.recurrent is not None:
    kept, rec = rec, state.recurrent.replace(conv=tuple(c.conv for c in rec), delta=tuple(c.delta for c in rec))
  state = state.replace(ring=ring.advance(tokens_T.shape[0]), experts=experts, host=host, recurrent=rec)
  return (logits, hidden, state, kept) if keep_states else (logits, hidden, state)


def split_idle_tier(state: ModelState, last_pos: int) -> tuple[ModelState, object]:
  """(state without its host tier, the tier) for a call whose positions end at `last_pos` (a Python int) when no
  position up to it leaves the ring's window: the tier then holds nothing attention reads and takes nothing, and
  the call compiles and runs the ring-only trunk (`join_tier` puts the tier back after). Else (state, None)."""
  if state.host is None or last_pos >= state.ring.window:
    return state, None
  return state.replace(host=None), state.host


def join_tier(state: ModelState, held) -> ModelState:
  """The state with the tier `split_idle_tier` held out put back (unchanged when nothing was held)."""
  return state if held is None else state.replace(host=held)


def select_recurrent(state: ModelState, kept, t) -> ModelState:
  """The state with its recurrent part taken after token t (traced) of the pass that kept per-token states
  (`forward(..., keep_states=True)`): a speculative round keeps the state after its accepted prefix."""
  if kept is None:
    return state
  return state.replace(recurrent=state.recurrent.replace(conv=tuple(c.conv_T[t] for c in kept),
                                                         delta=tuple(c.delta_T[t] for c in kept)))


@functools.partial(jax.jit, static_argnames=("cfg", "options", "last_only", "attn_block"),
                   donate_argnames=("state",))
def prefill(params, tokens_T, state: ModelState, *, cfg: ModelConfig, options: Options = DEFAULT,
            last_only: bool = False, attn_block: int = ATTN_BLOCK):
  """The prompt (or any T tokens) through the trunk; logits for every position unless last_only."""
  return forward(params, tokens_T, state, cfg=cfg, options=options, last_only=last_only, attn_block=attn_block)


@functools.partial(jax.jit, static_argnames=("cfg", "options", "attn_block"), donate_argnames=("state",))
def decode_step(params, token, state: ModelState, *, cfg: ModelConfig, options: Options = DEFAULT,
                attn_block: int = ATTN_BLOCK):
  """One token: (logits [V], hidden [D], state)."""
  logits, hidden, state = forward(params, jnp.reshape(token, (1,)), state, cfg=cfg, options=options,
                                  attn_block=attn_block)
  return logits[0], hidden[0], state


def mtp_forward(params, hidden_TD, tokens_T, mtp_ring: KVRing, *, cfg: ModelConfig, options: Options = DEFAULT,
                j: int = 0, attn_block: int = ATTN_BLOCK, experts=None):
  """NextN block j over T entries: entry i pairs the target hidden state at position p = mtp_ring.length + i
  with the token at p + 1, runs at RoPE position p + 1 and predicts the token at p + 2.
  Returns (logits [T, V], h [T, D] after shared_head_norm, ring advanced by T, expert cache or None). T must not
  exceed the ring's capacity: a call writes each slot at most once (which of two writes to one slot a scatter
  keeps is unspecified on the GPU)."""
  if tokens_T.shape[0] > mtp_ring.capacity:
    raise ValueError(f"mtp_forward: {tokens_T.shape[0]} entries in one call, expected at most the drafter ring's "
                     f"capacity {mtp_ring.capacity}")
  pos = mtp_ring.length + jnp.arange(tokens_T.shape[0], dtype=jnp.int32)
  head = params.get("output", params["token_embd"])
  with jax.default_matmul_precision(MATMUL_PRECISION):
    logits, h, ring, experts = MTPBlock(cfg, j, options).apply(
        {"params": params[f"mtp_{j}"]}, hidden_TD, tokens_T.astype(jnp.int32), pos, mtp_ring, params["token_embd"],
        head, _block(mtp_ring, attn_block), experts)
  return logits, h, ring.advance(tokens_T.shape[0]), experts


@functools.partial(jax.jit, static_argnames=("cfg", "options", "j", "attn_block"), donate_argnames=("mtp_ring",))
def mtp_step(params, hidden_TD, tokens_T, mtp_ring: KVRing, *, cfg: ModelConfig, options: Options = DEFAULT,
             j: int = 0, attn_block: int = ATTN_BLOCK):
  """Jitted `mtp_forward` without an expert cache: (logits, h, ring)."""
  return mtp_forward(params, hidden_TD, tokens_T, mtp_ring, cfg=cfg, options=options, j=j,
                     attn_block=attn_block)[:3]
