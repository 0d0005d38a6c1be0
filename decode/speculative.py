"""Speculative decoding: draft k tokens, verify them in a forward pass of k + 1 positions, keep the longest
accepted prefix plus the target's own next token.

A verify pass runs at most VERIFY_ROWS positions at a time (k = 3 and below: one pass), so that every row is
computed as a one-token step computes it on the GPU too: the quantized matmuls keep their tiles up to
ops.qmatmul_pallas.INVARIANT_B rows, and neither they nor the attention kernel's rows are the steps' bitwise at 8
rows (docs/PERF.md 2026-12-07 (b)). A longer verify is that many passes in a row, like prefill chunks.

A round is one jitted function and the decode loop is a `lax.while_loop` over rounds with a static-size
history buffer and a donated state. Invariants (each a test):
  * greedy output equals plain greedy decoding, for every drafter;
  * rejected positions leave nothing that is read again: the main ring is rewound to the accepted length and
    keeps `scratch = k + 1` slots of slack (KVRing.scratch), the drafter ring likewise;
  * the NextN drafter ring and its pending hidden states advance with accepted tokens only.

NextN bookkeeping (DESIGN "MTP round"): drafter entry j pairs the target hidden state at position j (after
output_norm) with token j + 1, runs at position j + 1 and predicts token j + 2. After a round that accepted
n tokens at position P, entries P .. P + n are *pending*: their true hidden states came out of the verify pass,
and the next round's first drafter call writes them (k + 1 slots, the first n_pend valid) before drafting.
Depth i > 1 reuses the block on its own output hidden state; those speculative entries are dropped by
rewinding the drafter ring to P.

>>> from decode.engine import generate
>>> from configs.default import default_model_path
>>> from model.loader import load_model
>>> m = load_model(default_model_path())
>>> p = m.tokenizer.encode("def")
>>> r = speculative_generate(m, p, drafter="mtp", k=2, max_new_tokens=12)
>>> r.ids == generate(m, p, max_new_tokens=12).ids
True
>>> len(r.stats["drafts_accepted"])                  # accepted drafts per draft position
2
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from decode import drafters
from decode.engine import (GenConfig, GenResult, RequestError, cache_counts, cache_stats, check_finite,
                           commit_for_store, new_tokens_sized, nonfinite_error, request_params, start_request)
from decode.sampling import sample, target_probs
from model import api
from model.state import ModelState
from model.config import ModelConfig
from model.options import DEFAULT, Options
from ops import qmatmul_pallas

VERIFY_ROWS = qmatmul_pallas.INVARIANT_B    # positions per verify pass (batch invariant on the GPU up to here)


@struct.dataclass
class SpecState:
  model: ModelState
  hist: jax.Array        # int32 [H]: prompt + generated tokens; hist[n_hist - 1] is the last token (not yet verified)
  n_hist: jax.Array
  n_prompt: jax.Array
  pend_h: jax.Array      # [k + 1, D] pending drafter entries: target hidden states ...
  pend_t: jax.Array      # [k + 1] ... and the tokens that follow them
  n_pend: jax.Array
  key: jax.Array
  done: jax.Array
  proposed: jax.Array    # int32 [k] drafts proposed per draft position
  accepted: jax.Array    # int32 [k] drafts accepted per draft position
  rounds: jax.Array
  bad: jax.Array = -1    # int32: the generated token whose verify logits were not finite (the loop stopped), or -1


def _probs(logits, temperature, top_p):
  return target_probs(logits, temperature, top_p)


def _draft_mtp(params, s: SpecState, key, *, cfg, options, k, temperature, top_p):
  """k NextN drafts (and their proposal distributions when sampling)."""
  ring, ex = s.model.mtp_ring, s.model.experts
  P = s.model.ring.length
  J = ring.length

  def mtp(h, t, ring, ex):
    return api.mtp_forward(params, h, t, ring, cfg=cfg, options=options, experts=ex)

  logits, h, ring, ex = mtp(s.pend_h, s.pend_t, ring, ex)
  ring = ring.rewind(J + s.n_pend)
  lg, hh = logits[s.n_pend - 1], h[s.n_pend - 1]
  ds, qs = [], []
  keys = jax.random.split(key, k)
  for i in range(k):
    if temperature == 0.0:
      d = jnp.argmax(lg).astype(jnp.int32)
    else:
      q = _probs(lg, temperature, top_p)
      d = jax.random.categorical(keys[i], jnp.log(q)).astype(jnp.int32)
      qs.append(q)
    ds.append(d)
    if i < k - 1:
      lg1, h1, ring, ex = mtp(hh[None], d[None], ring, ex)
      lg, hh = lg1[0], h1[0]
  ring = ring.rewind(P)
  return jnp.stack(ds), (jnp.stack(qs) if qs else None), ring, ex


def verify_greedy(logits_SV, d_S, valid_S):
  """Greedy verification: accept the longest prefix of drafts equal to the target's argmax; the next token is
  the target's argmax after it. logits: [k+1, V] at positions P .. P+k. Returns (n_acc, next token)."""
  k = d_S.shape[0]
  g = jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)
  acc = valid_S & (d_S == g[:k])
  n_acc = jnp.sum(jnp.cumprod(acc.astype(jnp.int32)))
  return n_acc, g[n_acc]


def verify_sample(p_SV, q_SV, d_S, valid_S, key):
  """Rejection-sampling verification (the emitted tokens have the target distribution p).

  p: [k+1, V] target distributions at positions P .. P+k; q: [k, V] the drafter's proposal distributions
  (one-hot for deterministic drafters, zero rows for missing drafts); d: [k] drafts. Draft i is accepted with
  probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is drawn from the normalised
  residual max(p - q, 0), after k acceptances from p_k. Returns (n_acc, next token)."""
  k = d_S.shape[0]
  k_acc, k_res = jax.random.split(key)
  pd = jnp.take_along_axis(p_SV[:k], d_S[:, None], axis=-1)[:, 0]
  qd = jnp.take_along_axis(q_SV, d_S[:, None], axis=-1)[:, 0]
  u = jax.random.uniform(k_acc, (k,))
  acc = valid_S & (u * qd < pd)
  n_acc = jnp.sum(jnp.cumprod(acc.astype(jnp.int32)))
  pr = p_SV[n_acc]
  qr = jnp.where(n_acc < k, q_SV[jnp.minimum(n_acc, k - 1)], 0.0)
  res = jnp.maximum(pr - qr, 0.0)
  tot = jnp.sum(res)
  res = jnp.where(tot > 0, res / jnp.where(tot > 0, tot, 1.0), pr)
  return n_acc, jax.random.categorical(k_res, jnp.log(res)).astype(jnp.int32)


def verify_chunks(S: int) -> list[tuple[int, int]]:
  """(first position, tokens) of each pass of an S-token verify: passes of VERIFY_ROWS, the last one shorter."""
  return [(c, min(VERIFY_ROWS, S - c)) for c in range(0, S, VERIFY_ROWS)]


def verify_pass(params, tokens_S, state: ModelState, *, cfg: ModelConfig, options: Options = DEFAULT):
  """api.forward(..., keep_states=True) over the S = k + 1 verify tokens, one pass per `verify_chunks(S)`, their
  outputs joined: (logits [S, V], hidden [S, D], state, kept per-token recurrent states or None)."""
  parts = []
  for c, n in verify_chunks(tokens_S.shape[0]):
    lg, h, state, kp = api.forward(params, tokens_S[c:c + n], state, cfg=cfg, options=options, keep_states=True)
    parts.append((lg, h, kp))
  cat = lambda xs: jnp.concatenate(xs, axis=0)    # noqa: E731
  kept = parts[-1][2]
  if kept is not None:
    kept = tuple(last.replace(conv_T=cat([p[2][i].conv_T for p in parts]),
                              delta_T=cat([p[2][i].delta_T for p in parts])) for i, last in enumerate(kept))
  return cat([p[0] for p in parts]), cat([p[1] for p in parts]), state, kept


def spec_round(params, s: SpecState, replay, eos_id, *, cfg: ModelConfig, k: int, drafter: str,
               temperature: float, top_p: float, options: Options = DEFAULT) -> SpecState:
  P = s.model.ring.length
  tok = s.hist[s.n_hist - 1]
  key, k_draft, k_acc = jax.random.split(s.key, 3)
  model = s.model
  q = None
  if drafter == "mtp":
    d, q, mtp_ring, ex = _draft_mtp(params, s, k_draft, cfg=cfg, options=options, k=k, temperature=temperature,
                                    top_p=top_p)
    model = model.replace(mtp_ring=mtp_ring, experts=ex)
  elif drafter == "lookup":
    d = drafters.lookup_draft(s.hist, s.n_hist, k)
  elif drafter == "replay":
    d = drafters.replay_draft(replay, s.n_hist, k)
  else:
    raise ValueError(f"drafter {drafter!r}")
  valid = d >= 0
  d = jnp.where(valid, d, 0)
  # verify: the target on [t_P, d_1 .. d_k] at positions P .. P + k; a hybrid model's DeltaNet layers keep their
  # state after each of these tokens, so that the round leaves the state after its accepted prefix
  keep = model.recurrent is not None

  def verify(m):
    return verify_pass(params, jnp.concatenate([tok[None], d]), m, cfg=cfg, options=options)

  def rows(x):
    return jnp.broadcast_to(x, (k + 1,) + x.shape[1:])

  if drafter != "lookup":
    # NextN always proposes, and replay does up to its recording's end: every round verifies (rows of invalid
    # drafts are rejected; one pass in the program, not two under a lax.cond)
    logits, hidden, model, kept = verify(model)
  else:
    # lookup often has nothing to propose: then the round is one plain step (T = 1), its outputs repeated to the
    # round's shapes (only row 0 is read)
    def step(m):
      lg, h, m, kp = api.forward(params, tok[None], m, cfg=cfg, options=options, keep_states=True)
      kp = None if kp is None else tuple(c.replace(conv_T=rows(c.conv_T), delta_T=rows(c.delta_T)) for c in kp)
      return rows(lg), rows(h), m, kp
    logits, hidden, model, kept = jax.lax.cond(valid[0], verify, step, model)
  if temperature == 0.0:
    n_acc, nxt = verify_greedy(logits, d, valid)
  else:
    p = jax.vmap(lambda l: _probs(l, temperature, top_p))(logits)                    # [k+1, V]
    if q is None:                                                                     # deterministic drafter
      q = jax.nn.one_hot(d, cfg.vocab_size, dtype=jnp.float32) * valid[:, None]
    n_acc, nxt = verify_sample(p, q, d, valid, k_acc)
  i = jnp.arange(k + 1, dtype=jnp.int32)
  em = jnp.where(i < n_acc, jnp.concatenate([d, d[-1:]]), nxt)                      # emitted tokens (first n_acc + 1)
  count = n_acc + 1
  is_eos = (em == eos_id) & (i < count)
  hit = jnp.any(is_eos)
  count = jnp.where(hit, jnp.argmax(is_eos) + 1, count)
  # emitted token i comes from verify row i: a non-finite row among the first `count` ends the request before it
  fin = jnp.all(jnp.isfinite(logits), axis=-1)                                     # [k+1]
  j = jnp.argmin(fin).astype(jnp.int32)                                            # first non-finite row (else 0)
  broken = ~fin[j] & (j < count)
  count = jnp.where(broken, j, count)
  hist = jax.lax.dynamic_update_slice(s.hist, em, (s.n_hist,))
  model = model.replace(ring=model.ring.rewind(P + n_acc + 1))
  if keep:
    model = api.select_recurrent(model, kept, n_acc)
  return SpecState(
      model=model, hist=hist, n_hist=s.n_hist + count, n_prompt=s.n_prompt,
      pend_h=hidden.astype(s.pend_h.dtype), pend_t=em, n_pend=n_acc + 1, key=key, done=s.done | hit | broken,
      proposed=s.proposed + valid.astype(jnp.int32), accepted=s.accepted + (i[:k] < n_acc).astype(jnp.int32),
      rounds=s.rounds + 1, bad=jnp.where(broken, s.n_hist - s.n_prompt + j, s.bad))


@functools.partial(jax.jit, static_argnames=("cfg", "k", "drafter", "temperature", "top_p", "options"),
                   donate_argnames=("s",))
def spec_loop(params, s: SpecState, replay, eos_id, max_new, until=None, *, cfg: ModelConfig, k: int, drafter: str,
              temperature: float, top_p: float, options: Options = DEFAULT) -> SpecState:
  """Rounds until max_new tokens are generated or EOS, and (with `until`) while a round's positions P .. P + k
  stay below until (`speculative_generate` runs the rounds inside the ring's window with the host tier held out)."""
  def cond(s):
    go = ~s.done & (s.n_hist - s.n_prompt < max_new)
    return go if until is None else go & (s.model.ring.length + k < until)

  def body(s):
    return spec_round(params, s, replay, eos_id, cfg=cfg, k=k, drafter=drafter, temperature=temperature, top_p=top_p,
                      options=options)

  return jax.lax.while_loop(cond, body, s)


def _hist_size(n: int) -> int:
  b = 64
  while b < n:
    b *= 2
  return b


@dataclasses.dataclass
class SpecStart:
  """A request ready for its rounds: the loop state after the prefill (first token sampled, the drafter ring
  filled), the replay buffer and `spec_round` / `spec_loop`'s static arguments."""
  s: SpecState
  replay: jax.Array
  params: dict
  kwargs: dict          # spec_round's keyword arguments (cfg, k, drafter, temperature, top_p, options)
  eos: int
  prompt: list
  st: object            # decode.engine.start_request's result
  ttft: float
  prefilled: object     # expert-cache counters after the prefill


def _prefill_drafter(params, hidden_TD, prompt: list[int], state, cfg, options):
  """The NextN drafter ring after a prompt of T tokens: entries 0 .. T - 2 (entry j pairs the hidden state at
  position j with prompt[j + 1]; `hidden_TD` holds the prompt's last positions, engine.hidden_rows of them). The
  ring keeps the newest `capacity` entries, and an entry's K/V depend on its own row alone, so only those run, in
  one call: the older ones would have been overwritten, and a call of more rows than slots writes some slots twice
  (which row a scatter with duplicate indices keeps is unspecified on the GPU). The entries before them count as
  written (the ring's length), as if they had run."""
  ring, T, rows = state.mtp_ring, len(prompt), hidden_TD.shape[0]
  n = min(T - 1, ring.capacity)
  if rows < n + 1:
    raise ValueError(f"_prefill_drafter: {rows} hidden rows kept, expected at least {n + 1} (the drafter ring's "
                     f"capacity {ring.capacity} + 1)")
  ring = ring.advance(T - 1 - n)
  h, toks = hidden_TD[rows - 1 - n:rows - 1], jnp.asarray(prompt[T - n:], jnp.int32)
  if state.experts is None:
    return state.replace(mtp_ring=api.mtp_step(params, h, toks, ring, cfg=cfg, options=options)[2])
  _, _, ring, ex = api.mtp_forward(params, h, toks, ring, cfg=cfg, options=options, experts=state.experts)
  return state.replace(mtp_ring=ring, experts=ex)


def start_speculative(model, prompt_ids, gen: GenConfig, *, drafter: str = "mtp", k: int = 3, mtp_window: int = 4096,
                      replay_ids=None, prefill_cache=None) -> SpecStart:
  """Check the request, prefill the prompt, sample the first token and fill the drafter ring: what
  `speculative_generate` runs before its rounds (and what a test that drives `spec_round` itself starts from)."""
  cfg, tok = model.cfg, model.tokenizer
  params = request_params(model, gen)             # the store in pinned host memory with expert slots on a GPU
  if drafter not in ("mtp", "lookup", "replay"):
    raise RequestError(f"--draft: {drafter!r}, expected mtp, lookup or replay")
  if drafter == "mtp" and not cfg.n_nextn:
    raise RequestError(f"--draft mtp: the model ({cfg.arch}) has no NextN block")
  if k < 1:
    raise RequestError(f"--mtp_draft: {k}, expected >= 1")
  prompt = [int(i) for i in prompt_ids]
  T = len(prompt)
  t0 = time.perf_counter()
  st = start_request(model, prompt, gen, k=k, mtp_window=mtp_window if drafter == "mtp" else None, params=params,
                     prefill_cache=prefill_cache)
  state, logits, hidden = st.state, st.logits, st.hidden
  key = jax.random.PRNGKey(gen.seed)
  key, sub = jax.random.split(key)
  first = sample(logits[-1], sub, gen.temperature, gen.top_p)
  check_finite(logits[-1], 0, len(prompt))
  pend_h = jnp.zeros((k + 1, cfg.d_model), jnp.float32).at[0].set(hidden[-1])
  pend_t = jnp.zeros((k + 1,), jnp.int32).at[0].set(first)
  if drafter == "mtp" and T > 1:
    state = _prefill_drafter(params, hidden, prompt, state, cfg, gen.options)
  first.block_until_ready()
  ttft = time.perf_counter() - t0 + (st.reused_s or 0.0)
  prefilled = cache_counts(state)
  H = _hist_size(T + new_tokens_sized(gen) + k + 2)
  hist = jnp.zeros((H,), jnp.int32).at[:T].set(jnp.asarray(prompt, jnp.int32)).at[T].set(first)
  replay = jnp.full((H,), -1, jnp.int32)
  if drafter == "replay":
    if replay_ids is None:
      raise RequestError("--draft replay: needs a recorded continuation (replay_ids)")
    rec = np.asarray(prompt + [int(i) for i in replay_ids], np.int32)[:H]
    replay = replay.at[: len(rec)].set(rec)
  eos = tok.eos_id if (gen.stop_at_eos and tok.eos_id is not None) else -1
  s = SpecState(state, hist, jnp.int32(T + 1), jnp.int32(T), pend_h, pend_t, jnp.int32(1), key,
                jnp.asarray(int(first) == eos), jnp.zeros((k,), jnp.int32), jnp.zeros((k,), jnp.int32), jnp.int32(0),
                jnp.int32(-1))
  kwargs = dict(cfg=cfg, k=k, drafter=drafter, temperature=gen.temperature, top_p=gen.top_p, options=gen.options)
  s, replay = commit_for_store((s, replay), params, cfg)   # else the timed call after the compile call compiles again
  return SpecStart(s, replay, params, kwargs, eos, prompt, st, ttft, prefilled)


def speculative_generate(model, prompt_ids, gen: GenConfig | None = None, *, drafter: str = "mtp", k: int = 3,
                         mtp_window: int = 4096, replay_ids=None, eager: bool = False, prefill_cache=None,
                         **kw) -> GenResult:
  """Generate with drafts from `drafter` (mtp | lookup | replay), k per round.

  replay_ids: for drafter="replay", the continuation to propose (e.g. a plain greedy run's ids).
  eager=True runs the rounds one by one from Python (same jitted round, easier to inspect).
  prefill_cache: a bench.prefill_cache.PrefillCache to reuse the main trunk's prefill of this prompt (ttft_s counts the
  original prefill's seconds; the drafter ring is still filled here).
  """
  gen = dataclasses.replace(gen or GenConfig(), **kw)
  sp = start_speculative(model, prompt_ids, gen, drafter=drafter, k=k, mtp_window=mtp_window, replay_ids=replay_ids,
                         prefill_cache=prefill_cache)
  s, replay, params, kwargs, eos, prompt, st = sp.s, sp.replay, sp.params, sp.kwargs, sp.eos, sp.prompt, sp.st
  T, n, tok = len(prompt), gen.max_new_tokens, model.tokenizer

  def held_out(s):
    """(s with its host tier held out, the tier) while a round's positions P .. P + k stay inside the window."""
    model, held = api.split_idle_tier(s.model, int(s.model.ring.length) + k)
    return s.replace(model=model), held

  def rejoin(s, held):
    return s.replace(model=api.join_tier(s.model, held))

  if eager:
    rnd = jax.jit(functools.partial(spec_round, **kwargs))
    t1 = time.perf_counter()
    while not bool(s.done) and int(s.n_hist) - T < n:
      s, held = held_out(s)
      s = rejoin(rnd(params, s, replay, jnp.int32(eos)), held)
  else:
    def segment(s, max_new):
      """Rounds inside the window with the tier held out (the ring-only program), else rounds with the tier."""
      s, held = held_out(s)
      until = jnp.int32(s.model.ring.window if held is not None else np.iinfo(np.int32).max - k)
      return rejoin(spec_loop(params, s, replay, jnp.int32(eos), jnp.int32(max_new), until, **kwargs), held)

    s = segment(s, 0)                                                             # compile (no round runs)
    m = s.model
    if m.host is not None and int(m.ring.length) + k < m.ring.window <= int(m.ring.length) + n + k:
      s = spec_loop(params, s, replay, jnp.int32(eos), jnp.int32(0), jnp.int32(0), **kwargs)   # the tier's form too
    jax.block_until_ready(s)
    t1 = time.perf_counter()
    while not bool(s.done) and int(s.n_hist) - T < n:
      s = segment(s, n)
    jax.block_until_ready(s)
  dt = time.perf_counter() - t1
  if int(s.bad) >= 0:
    raise nonfinite_error(int(s.bad), T)
  got = int(s.n_hist) - T
  ids = [int(i) for i in np.asarray(s.hist)[T: T + min(got, n)]]
  rounds = int(s.rounds)
  prop, accd = np.asarray(s.proposed).tolist(), np.asarray(s.accepted).tolist()
  stats = {"prompt_tokens": T, "generated_tokens": len(ids), "ttft_s": sp.ttft, "setup_s": st.setup_s,
           "prefill_s": st.prefill_s, "decode_s": dt,
           "decode_tok_s": (got - 1) / dt if dt > 0 else 0.0, "kv": gen.kv, "kv_resident": st.cap, "eager": eager,
           "prefill_reused": st.reused_s is not None, "drafter": drafter, "k": k, "rounds": rounds,
           "drafts_proposed": prop, "drafts_accepted": accd,
           "acceptance": (sum(accd) / sum(prop)) if sum(prop) else 0.0,
           "mean_accepted_len": (sum(accd) / rounds) if rounds else 0.0,
           "mtp_window": mtp_window if drafter == "mtp" else None, "expert_cache": cache_stats(s.model, got, sp.prefilled)}
  return GenResult(prompt, ids, tok.decode(ids), stats)
