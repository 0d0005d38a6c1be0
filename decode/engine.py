"""The plain decode loop: prefill, then a jitted `lax.while_loop` of `decode_step` over a static-size output
buffer with a dynamic bound (stops at max_new_tokens or EOS), plus an eager loop for debugging.

>>> from configs.default import default_model_path
>>> from model.loader import load_model
>>> m = load_model(default_model_path())
>>> r = generate(m, m.tokenizer.encode("def"), max_new_tokens=4)
>>> len(r.ids)
4
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from decode.sampling import sample
from model import api
from model.config import ModelConfig
from model.options import DEFAULT, Options
from model import state as model_state
from model.state import ATTN_BLOCK, ModelState
from ops import on_gpu


class RequestError(ValueError):
  """A request the engine refuses (one line)."""


class NonFiniteError(RequestError):
  """The logits turned NaN or Inf: the request stops there and emits no token from them (one line)."""


def nonfinite_error(step: int, n_prompt: int) -> NonFiniteError:
  """The error of non-finite logits for generated token `step` (0: the prefill's last position)."""
  where = "the prompt's last position" if step == 0 else f"decode step {step}"
  return NonFiniteError(f"logits: NaN or Inf at generated token {step} ({where}, position {n_prompt - 1 + step}), "
                        f"so the request stops; likely cause: non-finite or overflowing weights in the model file "
                        f"(a damaged tensor)")


def check_finite(logits, step: int, n_prompt: int) -> None:
  """A NonFiniteError unless every logit is finite (a host sync: after the prefill, and per step of the eager loop;
  the jitted loops check inside and stop, setting `bad`)."""
  if not bool(jnp.all(jnp.isfinite(logits))):
    raise nonfinite_error(step, n_prompt)


@dataclasses.dataclass(frozen=True)
class GenConfig:
  max_new_tokens: int = 32
  temperature: float = 0.0
  top_p: float = 1.0
  seed: int = 0
  kv: str = "bf16"
  kv_resident: int | None = None      # main ring capacity R (None: smallest power of two >= the request, from 1024)
  max_context: int | None = None      # longest prompt + generation accepted (None: the ring's capacity)
  stop_at_eos: bool = True
  expert_slots: int | None = None     # expert cache device slots (None: every expert resident)
  expert_policy: str = "lru"
  prefill_chunk: int | None = None    # tokens per prefill call (None: engine.prefill_chunk's per-backend default)
  buffer_tokens: int | None = None    # size the static buffers and the ring for this many new tokens (>= max_new):
                                      # a short request then compiles exactly the loops of a longer one (the
                                      # bench's compiling run: a few tokens, not a deep cell's whole 256)
  expert_store: str | None = None     # where the expert store lives with expert_slots: None picks
                                      # expert_cache.store_memory_kind() ("pinned_host" on a GPU that has it, else
                                      # "device"); "pinned_host" forces it (jax's CPU client has the kind: tests)
  options: Options = DEFAULT          # how the model runs (glue kernels, idle-tier skip, prefill precision, tuning)


@dataclasses.dataclass
class GenResult:
  prompt_ids: list[int]
  ids: list[int]
  text: str
  stats: dict


@struct.dataclass
class LoopState:
  model: ModelState
  out: jax.Array        # int32 [N] static-size output buffer
  n: jax.Array          # tokens written to out
  token: jax.Array      # last token (the next step's input)
  key: jax.Array
  done: jax.Array
  bad: jax.Array = -1   # int32: the step whose logits were not finite (the loop stopped there), -1 while none


@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "top_p", "options"), donate_argnames=("ls",))
def decode_loop(params, ls: LoopState, n_max, eos_id, *, cfg: ModelConfig, temperature: float, top_p: float,
                options: Options = DEFAULT):
  """Generate until n == n_max or EOS: each iteration feeds `token` (already in out[n-1]) and stores the next.
  Logits with a NaN or Inf stop the loop without a token: `bad` is then that step (n, the token they would give)."""

  def cond(s):
    return (s.n < n_max) & ~s.done

  def body(s):
    logits, _, model = api.forward(params, s.token[None], s.model, cfg=cfg, options=options)
    ok = jnp.all(jnp.isfinite(logits[0]))
    key, sub = jax.random.split(s.key)
    nxt = sample(logits[0], sub, temperature, top_p)
    return LoopState(model, s.out.at[s.n].set(nxt), s.n + ok.astype(jnp.int32), nxt, key,
                     s.done | (nxt == eos_id) | ~ok, jnp.where(ok, s.bad, s.n))

  return jax.lax.while_loop(cond, body, ls)


def request_params(model, gen: GenConfig) -> dict:
  """The params a request runs with: model.params, or, with gen.expert_slots and a store kind other than "device"
  (gen.expert_store, else expert_cache.store_memory_kind()), the params with the routed experts (the store) placed
  in that memory kind by expert_cache.place_store. Placed once per model and kind: the placed params are kept on
  the model object (attribute `_placed_stores`, valid while model.params is the same object), so later requests
  reuse them. model.params itself is untouched, so its device copy of the experts stays alive beside the host one."""
  if not gen.expert_slots:
    return model.params
  from model import expert_cache as xc
  kind = gen.expert_store or xc.store_memory_kind()
  if kind == "device":
    return model.params
  with _PLACING:                  # requests started in threads (bench.cells --compile_jobs) place the store once
    placed = getattr(model, "_placed_stores", None)
    if placed is None or placed[0] is not model.params:
      placed = (model.params, {})
      object.__setattr__(model, "_placed_stores", placed)   # works on a frozen dataclass too
    if kind not in placed[1]:
      placed[1][kind] = xc.place_store(model.params, model.cfg, kind)
    return placed[1][kind]


_PLACING = threading.Lock()


def commit_for_store(tree, params, cfg: ModelConfig):
  """`tree` with every uncommitted array committed to the first device when the routed experts of `params` live
  outside device memory (a placed store) or `tree` already holds a committed array (a host tier placed in pinned
  host memory), else `tree` itself. A jitted call with committed inputs returns committed outputs, so its other
  inputs must be committed up front or the next call, fed those outputs, compiles again (a 32K prompt with a
  tier compiled its second 1,024-token chunk anew on the H200: 13 s). Committed arrays stay where they are.
  Params on a mesh (model.mesh): every uncommitted array is placed on it instead (model.mesh.place_state: rings split
  by K/V head over tp where the heads divide, the rest replicated)."""
  from model import expert_cache as xc
  from model.mesh import mesh_of, place_state
  mesh = mesh_of(params)
  if mesh is not None:
    return place_state(tree, mesh, cfg)
  held = any(isinstance(x, jax.Array) and x.committed for x in jax.tree.leaves(tree))
  if not held and all(k == "device" for ks in xc.store_kinds(params, cfg).values() for k in ks):
    return tree
  dev = jax.devices()[0]
  return jax.tree.map(lambda x: jax.device_put(x, dev) if isinstance(x, jax.Array) and not x.committed else x, tree)


def init_state(model, cap: int, gen: GenConfig, mtp_window: int | None = None, scratch: int = 0,
               host: int | None = None, params: dict | None = None, experts: bool = True) -> ModelState:
  """The request's state: rings, a host tier of `host` positions when given, and, with gen.expert_slots (and
  `experts`), an empty expert cache over the store of `params` (default model.params)."""
  state = model_state.init_state(model.cfg, cap, gen.kv, mtp_window=mtp_window, scratch=scratch)
  if host:
    from model.host_tier import HostTier, place_on_host
    state = state.replace(host=place_on_host(HostTier.like(state.ring, host)))
  if gen.expert_slots and experts:
    state = with_expert_cache(model, state, gen, params)
  return state


def with_expert_cache(model, state: ModelState, gen: GenConfig, params: dict | None = None) -> ModelState:
  """`state` with an empty expert cache of gen.expert_slots slots over the store of `params` (default
  model.params)."""
  from model import expert_cache
  params = model.params if params is None else params
  return state.replace(experts=expert_cache.create(params, model.cfg, gen.expert_slots, gen.expert_policy))


def streams_experts(cfg: ModelConfig, chunk: int) -> bool:
  """Whether a prefill chunk of `chunk` tokens routes more (token, expert) pairs than a block has experts, so that
  with expert slots it runs MoE's direct path, streaming each block's experts from the store (and not the slots)."""
  return bool(cfg.n_experts) and chunk * cfg.top_k > cfg.n_experts


PREFILL_CHUNK = 2048          # tokens per prefill call on CPU (GenConfig.prefill_chunk None)
KERNEL_PREFILL_CHUNK = 8      # on a GPU: the decode kernels' batch (attention kernel T <= 8, MoE kernels B <= 16)
GEMM_PREFILL_CHUNK = 1024     # on a GPU: full chunks through the tensor-core GEMMs


def prefill_chunk(gen: GenConfig) -> int:
  """Tokens per prefill call: gen.prefill_chunk, else the backend's default.

  On a GPU: GEMM_PREFILL_CHUNK, so full chunks of the prompt run the tensor-core GEMMs (ops/qgemm_pallas,
  ops/moe_grouped_pallas). With expert slots too: a chunk routing more (token, expert) pairs than a block has
  experts streams each MoE block's experts from the store once (model.ffn.MoE's direct path, run before the
  slots exist: `start_request`, decode.kv_plan "streamed experts"), where 8-token chunks through the slots loaded
  every chunk's misses (206 GB moved for a 1K prompt on seed-mtp, 6.5x the store: docs/PERF.md "Replay rounds
  against the faster step"). The remainder after the full chunks runs 8 tokens a call (`prefill_tail`). On CPU:
  PREFILL_CHUNK (one big call is fastest)."""
  if gen.prefill_chunk is not None:
    if gen.prefill_chunk < 1:
      raise RequestError(f"prefill_chunk: {gen.prefill_chunk}, expected at least 1 token per call")
    return gen.prefill_chunk
  return GEMM_PREFILL_CHUNK if on_gpu() else PREFILL_CHUNK


def prefill_tail(chunk: int) -> int:
  """Tokens per call for what is left after the full chunks: KERNEL_PREFILL_CHUNK on a GPU (one small compile
  serves every remainder; a call of the remainder's own length would compile a graph per prompt length), the
  chunk itself elsewhere (the remainder in one call)."""
  return min(chunk, KERNEL_PREFILL_CHUNK) if on_gpu() else chunk


def prefill_chunked(params, prompt: list[int], state: ModelState, cfg: ModelConfig, chunk: int,
                    tail: int | None = None, options: Options = DEFAULT, keep: int | None = None):
  """The prompt in calls of `chunk` tokens while at least `chunk` are left, then of `tail` (default chunk) tokens
  (a ring with a host tier needs chunk <= its window; long prompts also bound the activations). Returns (last
  logits [1, V], hidden [min(T, keep), D]: the last `keep` positions' hidden states (None: all), state); chunks
  wholly before those are dropped as the prompt goes, so a long prompt never holds [T, D] on the device."""
  hs, logits, a = [], None, 0
  tail = tail or chunk
  start = int(state.ring.length) if state.host is not None else 0
  while a < len(prompt):
    c = chunk if len(prompt) - a >= chunk else tail
    state, held = api.split_idle_tier(state, start + a + c - 1)       # a chunk inside the window: ring-only
    logits, h, state = api.prefill(params, jnp.asarray(prompt[a:a + c], jnp.int32), state, cfg=cfg, options=options,
                                   last_only=True)
    state = api.join_tier(state, held)
    hs.append(h)
    while keep is not None and len(hs) > 1 and sum(x.shape[0] for x in hs[1:]) >= keep:
      hs.pop(0)
    a += c
  return logits, _last_rows(hs[0] if len(hs) == 1 else jnp.concatenate(hs), keep), state


def _last_rows(x, n: int | None):
  return x if n is None or x.shape[0] <= n else x[x.shape[0] - n:]


# The prompt's hidden states a request keeps (Started.hidden): its last HIDDEN_ROWS positions (64 MB at d_model
# 2,048), or the NextN drafter ring's capacity + 1 where that is more (decode.speculative prefills the drafter from
# them); never [T, D] of a long prompt (1 GiB at 128K on seed-mtp).
HIDDEN_ROWS = 8192


def hidden_rows(mtp_window: int | None, scratch: int) -> int:
  """Rows of the prompt's hidden states a request keeps: HIDDEN_ROWS, or more for a NextN drafter ring of
  `mtp_window` + `scratch` entries rounded up to a whole attention block (model.state.init_state)."""
  return HIDDEN_ROWS if not mtp_window else max(HIDDEN_ROWS, mtp_window + scratch + ATTN_BLOCK)


@dataclasses.dataclass
class Started:
  state: ModelState
  logits: jax.Array       # [1, V] at the last prompt position
  hidden: jax.Array       # [min(T, hidden_rows), D] after output_norm: the prompt's last positions
  cap: int
  grow: bool
  reused_s: float | None = None   # the prompt came from a prefill cache: seconds its original prefill took
  setup_s: float = 0.0            # start_request's seconds outside the prefill: checks, the state's allocation
                                  # (a host tier's pinned memory), a cache hit's copy, a cache entry's bookkeeping
  prefill_s: float | None = None  # seconds of the prefill itself, waited for (None on a cache hit)


def _fresh(tree):
  """A copy of every array of `tree` in its own buffers, where it was (memory kind included) and as committed as it
  was (jit keys its programs on committedness: a committed copy of an uncommitted prefill would compile the decode
  loop again): the jitted steps donate the state, so a cached prefill hands out copies and keeps its own."""
  def copy(a):
    return jax.device_put(a, a.sharding if a.committed else None, may_alias=False)
  return jax.tree.map(lambda a: copy(a) if isinstance(a, jax.Array) else a, tree)


# Scratch slots of every request on a fixed ring beside a host tier, plain or speculative (k + 1 <= this). The window
# (capacity - scratch) decides which positions attention takes from the ring and which from the tier, and the two
# sum in different orders: with one window for all, a speculative request's verify rows are the plain request's
# steps bitwise (the replay arms at depth accept every draft), and both share a prefill (bench.prefill_cache).
TIER_SCRATCH = 8


def tier_layout(max_context: int, cap: int, k: int) -> tuple[int, int | None]:
  """(scratch slots, host tier positions or None) of a request with k drafts and `max_context` on a fixed ring of
  `cap` slots: beside a tier TIER_SCRATCH scratch slots (one window for plain and speculative requests) and a
  tier indexed by position, max_context plus the scratch; without one k + 1 (0 for a plain request).

  >>> tier_layout(139264, 32768, 3), tier_layout(1000, 4096, 3)
  ((8, 139272), (4, None))
  """
  slack = k + 1 if k else 0
  if max_context + max(slack, TIER_SCRATCH) <= cap:
    return slack, None
  slack = max(slack, TIER_SCRATCH)
  return slack, max_context + slack


def start_request(model, prompt: list[int], gen: GenConfig, *, k: int = 0, mtp_window: int | None = None,
                  ring_start: int | None = None, params: dict | None = None,
                  prefill_cache=None) -> Started:
  """Check the request, size the ring (and host tier), allocate the state and prefill the prompt with `params`
  (default model.params; `generate` passes request_params(model, gen)).

  k > 0 reserves k + 1 scratch slots for speculative overshoot, and any request beside a host tier TIER_SCRATCH
  (so that plain and speculative requests see the same window). Without --kv_resident the ring is the smallest
  power-of-two bucket from 1024 holding the request (or `ring_start` tokens, at least the prompt, then grown);
  with a fixed R and max_context > R, positions older than the ring's window live in the host tier. With
  `prefill_cache` a prompt prefilled before under the same ring, tier and chunking is copied instead of run again
  (Started.reused_s); with expert slots only a prompt that streams whole (every chunk full, `streams_experts`),
  whose prefill never reads the slots."""
  t_in = time.perf_counter()
  if not prompt:
    raise RequestError("prompt: empty, expected at least one token")
  slack = k + 1 if k else 0
  need = len(prompt) + new_tokens_sized(gen)
  fixed = gen.kv_resident is not None
  max_ctx = gen.max_context or (ring_capacity(need + slack, gen.kv_resident) - slack)
  if need > max_ctx:
    raise RequestError(f"prompt: {len(prompt)} tokens + max_new_tokens {gen.max_new_tokens} = {need} exceeds "
                       f"max_context {max_ctx}")
  cap = ring_capacity((max(ring_start, len(prompt)) if ring_start else need) + slack, gen.kv_resident)
  host = None
  if fixed and gen.max_context:
    slack, host = tier_layout(max_ctx, cap, k)
  if fixed and cap <= 2 * slack:
    raise RequestError(f"kv_resident {cap} is too small beside a host tier: expected more than {2 * slack} slots"
                       if host else f"kv_resident {cap} is too small for {k} drafts")
  params = model.params if params is None else params
  chunk = min(prefill_chunk(gen), cap - slack) if host else prefill_chunk(gen)      # cap - slack: the window
  # full chunks that stream every block's experts run before the slots exist (they never read them), so the plan
  # counts the streamed blocks and the slots once, the larger of the two (decode.kv_plan phase "prefill")
  n_streamed = len(prompt) // chunk * chunk if gen.expert_slots and streams_experts(model.cfg, chunk) else 0
  key = hit = None
  # with slots a prompt is cached only when it streams whole: its state then holds no expert cache (a hit gets
  # empty slots, as after its own prefill); a tail through the slots would leave them warm
  keep = hidden_rows(mtp_window, slack)
  if prefill_cache is not None and (not gen.expert_slots or n_streamed == len(prompt)):
    key = (id(params), model.cfg, gen.options, tuple(prompt), cap, slack, host, gen.kv, chunk, keep)
    hit = prefill_cache.get(key)                 # an entry keeps its params alive, so their id stays theirs
  # on a hit the tier comes from the entry: allocate none (a 139K tier is 6.9 GB of pinned memory, ~4 s on the H200)
  state = init_state(model, cap, gen, mtp_window=mtp_window, scratch=slack, host=None if hit else host,
                     params=params, experts=not n_streamed)
  if hit is not None:
    ring, tier, rec, logits, hidden = _fresh(hit[0])
    state = state.replace(ring=ring, host=tier, recurrent=rec)
    if n_streamed:
      state = with_expert_cache(model, state, gen, params)
    state = commit_for_store(state, params, model.cfg)
    jax.block_until_ready((state, logits))
    return Started(state, logits, hidden, cap, grow=not fixed, reused_s=hit[1], setup_s=time.perf_counter() - t_in)
  state = commit_for_store(state, params, model.cfg)      # the prefill chunks share one compile
  # the trunk's prefill never reads the NextN drafter's ring: held out of the calls, so requests with and without
  # a drafter run (and compile) the same prefill programs
  drafter_ring, state = state.mtp_ring, state.replace(mtp_ring=None)
  t0 = time.perf_counter()
  if n_streamed:
    logits, hidden, state = prefill_chunked(params, prompt[:n_streamed], state, model.cfg, chunk,
                                            options=gen.options, keep=keep)
    state = commit_for_store(with_expert_cache(model, state, gen, params), params, model.cfg)
  if n_streamed < len(prompt):
    logits, h, state = prefill_chunked(params, prompt[n_streamed:], state, model.cfg, chunk, prefill_tail(chunk),
                                       gen.options, keep=keep)
    hidden = _last_rows(jnp.concatenate([hidden, h]), keep) if n_streamed else h
  jax.block_until_ready(logits)                            # the caller waits for the first token right after
  prefill_s = time.perf_counter() - t0
  state = state.replace(mtp_ring=drafter_ring)
  if key is not None:
    prefill_cache.put(key, (_fresh((state.ring, state.host, state.recurrent, logits, hidden)), prefill_s, params))
  return Started(state, logits, hidden, cap, grow=not fixed, setup_s=time.perf_counter() - t_in - prefill_s,
                 prefill_s=prefill_s)


def cache_counts(state: ModelState) -> dict | None:
  """Totals of the expert cache's counters so far (hits, misses, bytes_moved), or None without a cache: what
  generate takes after prefill so that cache_stats can split the request into its two phases."""
  if state.experts is None:
    return None
  return _totals(state.experts.stats())


def _totals(st: dict) -> dict:
  return {k: sum(st[k]) for k in ("hits", "misses", "bytes_moved")}


def cache_stats(state: ModelState, n_tokens: int, after_prefill: dict | None = None) -> dict | None:
  """The expert cache's counters per block over the whole request, and with `after_prefill` (cache_counts taken
  once the prompt ran) the two phases apart: "prefill" and "decode" totals with their hit rates, and
  "per_token" over the `n_tokens` generated tokens from the decode phase alone. Without it, per_token divides
  the whole request (prefill included) by n_tokens."""
  if state.experts is None:
    return None
  st = state.experts.stats()
  keys = ("hits", "misses", "bytes_moved")
  total = _totals(st)
  rate = lambda c: c["hits"] / (c["hits"] + c["misses"]) if c["hits"] + c["misses"] else None
  if after_prefill is not None:
    dec = {k: total[k] - after_prefill[k] for k in keys}
    st["prefill"] = dict(after_prefill, hit_rate=rate(after_prefill))
    st["decode"] = dict(dec, hit_rate=rate(dec))
    st["per_token"] = {k: dec[k] / max(n_tokens, 1) for k in keys}
  else:
    st["per_token"] = {k: total[k] / max(n_tokens, 1) for k in keys}
  st["hit_rate"] = rate(total)
  return st


def ring_capacity(need: int, requested: int | None) -> int:
  if requested:
    return int(requested)
  cap = 1024
  while cap < need:
    cap *= 2
  return cap


def new_tokens_sized(gen: GenConfig) -> int:
  """The new tokens a request's shapes are sized for: max_new_tokens, or buffer_tokens when larger."""
  return max(gen.max_new_tokens, gen.buffer_tokens or 0)


def _buffer_size(n: int) -> int:
  b = 16
  while b < n:
    b *= 2
  return b


def generate(model, prompt_ids, gen: GenConfig | None = None, eager: bool = False, ring_start: int | None = None,
             prefill_cache=None, **kw) -> GenResult:
  """Greedy or sampled generation from `prompt_ids` (a LoadedModel from model.loader).

  ring_start: with kv_resident auto, size the first bucket for this many tokens instead of the whole request
  (the ring then grows into the next bucket when the request runs past it; one compile per bucket).
  prefill_cache: reuse a prompt prefilled before (bench.prefill_cache.PrefillCache, or any object with get and
  put); ttft_s then counts the original prefill's
  seconds and stats["prefill_reused"] is True.
  With gen.expert_slots the store is placed by request_params (pinned host memory on a GPU that has it)."""
  gen = dataclasses.replace(gen or GenConfig(), **kw)
  cfg, tok = model.cfg, model.tokenizer
  params = request_params(model, gen)
  prompt = list(int(i) for i in prompt_ids)
  t0 = time.perf_counter()
  st = start_request(model, prompt, gen, ring_start=None if eager else ring_start, params=params,
                     prefill_cache=prefill_cache)
  state, logits, cap, grow = st.state, st.logits, st.cap, st.grow
  key = jax.random.PRNGKey(gen.seed)
  key, sub = jax.random.split(key)
  first = sample(logits[-1], sub, gen.temperature, gen.top_p)
  first.block_until_ready()
  check_finite(logits[-1], 0, len(prompt))
  ttft = time.perf_counter() - t0 + (st.reused_s or 0.0)
  prefilled = cache_counts(state)
  eos = tok.eos_id if (gen.stop_at_eos and tok.eos_id is not None) else -1
  n = gen.max_new_tokens
  if eager:
    ids, t1 = [int(first)], time.perf_counter()
    token = first
    while len(ids) < n and ids[-1] != eos:
      state, held = api.split_idle_tier(state, int(state.ring.length))
      lg, _, state = api.decode_step(params, token, state, cfg=cfg, options=gen.options)
      state = api.join_tier(state, held)
      check_finite(lg, len(ids), len(prompt))
      key, sub = jax.random.split(key)
      token = sample(lg, sub, gen.temperature, gen.top_p)
      ids.append(int(token))
    dt = time.perf_counter() - t1
  else:
    ls = LoopState(state, jnp.zeros(_buffer_size(new_tokens_sized(gen)), jnp.int32).at[0].set(first),
                   jnp.ones((), jnp.int32), first,
                   key, first == eos, jnp.int32(-1))
    ls = commit_for_store(ls, params, cfg)       # else the timed call after the compile call compiles again
    kwargs = dict(cfg=cfg, temperature=gen.temperature, top_p=gen.top_p, options=gen.options)

    def segment(ls, n_max):
      """The loop up to n_max tokens, or while its steps' positions stay inside the ring's window (a host tier
      held out: the ring-only program), or until the ring is full (no tier)."""
      m, L = ls.model, int(ls.model.ring.length)
      room = n if m.host is not None else m.ring.capacity - L
      model, held = api.split_idle_tier(m, L)
      if held is not None:
        room = m.ring.window - L                  # step i writes position L + i
      ls = decode_loop(params, ls.replace(model=model), jnp.int32(min(n_max, int(ls.n) + room)), jnp.int32(eos),
                       **kwargs)
      return ls.replace(model=api.join_tier(ls.model, held))

    ls = segment(ls, 0)                          # compile (zero iterations)
    m = ls.model
    if m.host is not None and int(m.ring.length) + n - 2 >= m.ring.window > int(m.ring.length):
      ls = decode_loop(params, ls, jnp.int32(0), jnp.int32(eos), **kwargs)   # it crosses the window: the tier's form
    jax.block_until_ready(ls)
    t1 = time.perf_counter()
    buckets = [cap]
    while True:
      ls = segment(ls, n)
      if int(ls.bad) >= 0:
        raise nonfinite_error(int(ls.bad), len(prompt))
      if int(ls.n) >= n or bool(ls.done):
        break
      if not grow and ls.model.host is None:
        raise RequestError(f"kv_resident {cap} is full after {int(ls.model.ring.length)} positions")
      if not grow:
        continue                  # the host tier takes what leaves the window: the ring wraps
      new_cap = ls.model.ring.capacity * 2
      ls = ls.replace(model=ls.model.replace(ring=ls.model.ring.grow(new_cap)))
      buckets.append(new_cap)
    count = int(ls.n)
    dt = time.perf_counter() - t1
    ids = [int(i) for i in np.asarray(ls.out)[:count]]
    state = ls.model
  stats = {"prompt_tokens": len(prompt), "generated_tokens": len(ids), "ttft_s": ttft, "setup_s": st.setup_s,
           "prefill_s": st.prefill_s,
           "decode_s": dt, "decode_tok_s": (len(ids) - 1) / dt if dt > 0 and len(ids) > 1 else 0.0,
           "kv": gen.kv, "kv_resident": cap, "eager": eager, "prefill_reused": st.reused_s is not None,
           "ring_buckets": [cap] if eager else buckets, "expert_cache": cache_stats(state, len(ids), prefilled)}
  return GenResult(prompt, ids, tok.decode(ids), stats)
