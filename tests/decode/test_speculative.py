"""Speculative decoding against plain decoding (DESIGN invariants 3 and 4, issue 5).

Greedy: every drafter (NextN at k = 1..4, lookup, replay) emits exactly the plain greedy tokens, for bf16 and
int8 KV and two ring capacities; acceptance counts do not depend on the ring's capacity; replay accepts 100 %.
Sampling: rejection-sampling verification has the target distribution (chi-square).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode.engine import generate
from decode.speculative import speculative_generate, verify_sample
from model.loader import load_model
from tests.models import model_path

N_NEW = 40


@functools.lru_cache(maxsize=None)
def _model():
  return load_model(model_path("glm4moe", "Q4_K_M"))


def _prompt(n=24, seed=3):
  # a prompt with repeats, so the lookup drafter finds matches
  base = [int(t) for t in np.random.default_rng(seed).integers(0, 1000, n // 2)]
  return base + base


@functools.lru_cache(maxsize=None)
def _plain(kv: str, cap: int):
  return generate(_model(), _prompt(), max_new_tokens=N_NEW, stop_at_eos=False, kv=kv, kv_resident=cap).ids


CASES = [("mtp", 1, "bf16", 1024), ("mtp", 2, "int8", 2048), ("mtp", 3, "bf16", 2048), ("mtp", 4, "int8", 1024),
         ("lookup", 3, "bf16", 1024), ("lookup", 2, "int8", 2048), ("replay", 3, "int8", 1024), ("replay", 4, "bf16", 2048),
         ("replay", 6, "int8", 1024)]   # k = 6: the verify in two passes (decode.speculative.VERIFY_ROWS)


@pytest.mark.parametrize("drafter,k,kv,cap", CASES)
def test_greedy_speculative_equals_plain_greedy(drafter, k, kv, cap):
  plain = _plain(kv, cap)
  r = speculative_generate(_model(), _prompt(), drafter=drafter, k=k, max_new_tokens=N_NEW, stop_at_eos=False,
                           kv=kv, kv_resident=cap, replay_ids=plain, mtp_window=256)
  print(f"\n{drafter} k={k} {kv} R={cap}: proposed {r.stats['drafts_proposed']} accepted {r.stats['drafts_accepted']}"
        f" rounds {r.stats['rounds']}")
  assert r.ids == plain
  if drafter == "replay":
    assert r.stats["drafts_accepted"] == r.stats["drafts_proposed"]          # 100 % acceptance
    assert r.stats["rounds"] == -(-(N_NEW - 1) // (k + 1))
  if drafter == "lookup":
    # both kinds of round ran: verify passes (drafts proposed) and draftless rounds (one plain step each)
    assert 0 < r.stats["drafts_proposed"][0] < r.stats["rounds"]


@pytest.mark.parametrize("drafter", ["mtp", "lookup"])
def test_acceptance_counts_do_not_depend_on_ring_capacity(drafter):
  runs = [speculative_generate(_model(), _prompt(), drafter=drafter, k=3, max_new_tokens=N_NEW, stop_at_eos=False,
                               kv="bf16", kv_resident=cap, mtp_window=256) for cap in (1024, 1536)]
  assert runs[0].ids == runs[1].ids
  for key in ("drafts_proposed", "drafts_accepted", "rounds"):
    assert runs[0].stats[key] == runs[1].stats[key]


def test_eager_rounds_equal_jitted_loop():
  kw = dict(drafter="lookup", k=2, max_new_tokens=16, stop_at_eos=False, kv="bf16", kv_resident=1024)
  a = speculative_generate(_model(), _prompt(), eager=True, **kw)
  b = speculative_generate(_model(), _prompt(), **kw)
  assert a.ids == b.ids and a.stats["drafts_accepted"] == b.stats["drafts_accepted"]


def _chi2_ok(counts, probs, n):
  """Pearson chi-square against expected counts, bins with expected >= 5; p-value > 1e-3."""
  from scipy import stats as st
  exp = probs * n
  m = exp >= 5
  chi = np.sum((counts[m] - exp[m]) ** 2 / exp[m])
  return st.chi2.sf(chi, df=int(m.sum()) - 1), chi


@pytest.mark.parametrize("k", [1, 2])
def test_rejection_sampling_has_the_target_distribution(k):
  """Emitted tokens of one round, over many keys: first token ~ p_0, and (for k = 2) the first two jointly
  ~ p_0 x p_1 (position-wise targets that do not depend on the prefix), whatever the proposal q."""
  V, N = 6, 40000
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(V), size=k + 1).astype(np.float32)
  q = rng.dirichlet(np.ones(V) * 0.5, size=k).astype(np.float32)

  def one(key):
    kd, kv = jax.random.split(key)
    d = jax.vmap(lambda kk, qq: jax.random.categorical(kk, jnp.log(qq)))(jax.random.split(kd, k), jnp.asarray(q))
    n_acc, nxt = verify_sample(jnp.asarray(p), jnp.asarray(q), d.astype(jnp.int32), jnp.ones(k, bool), kv)
    em = jnp.where(jnp.arange(k + 1) < n_acc, jnp.concatenate([d, d[-1:]]), nxt)
    return em, n_acc

  em, n_acc = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(1), N))
  em, n_acc = np.asarray(em), np.asarray(n_acc)
  pv, chi = _chi2_ok(np.bincount(em[:, 0], minlength=V), p[0], N)
  print(f"\nk={k}: first token chi2={chi:.1f} p={pv:.3f}; mean accepted {n_acc.mean():.2f}")
  assert pv > 1e-3
  if k == 2:
    two = n_acc >= 1                                   # rows that emitted at least two tokens
    joint = np.bincount(em[two, 0] * V + em[two, 1], minlength=V * V)
    # given >= 2 emitted, token 2 is still ~ p_1 independent of token 1
    cond = joint.reshape(V, V).sum(0)
    pv2, chi2 = _chi2_ok(cond, p[1], two.sum())
    assert pv2 > 1e-3
  # a wrong verifier (always accept) must fail the same test
  bad = np.asarray(jax.vmap(lambda kk: jax.random.categorical(kk, jnp.log(jnp.asarray(q[0]))))(
      jax.random.split(jax.random.PRNGKey(2), N)))
  assert _chi2_ok(np.bincount(bad, minlength=V), p[0], N)[0] < 1e-3


def test_sampled_mtp_runs_and_respects_the_budget():
  """The sampled NextN path end to end (drafts sampled from the drafter's distribution, rejection-sampling
  verification): exactly max_new_tokens in the vocab, and the same tokens for the same seed. With a nucleus so
  small that it keeps only the top token (top_p 1e-6), target and drafter distributions are one-hot at their
  argmax, so the sampled path must emit exactly plain greedy decoding's tokens and accept a draft exactly when it
  is the target's argmax: the same acceptance count as greedy speculative decoding."""
  kw = dict(drafter="mtp", k=2, max_new_tokens=20, stop_at_eos=False, kv="bf16", kv_resident=1024)
  r = speculative_generate(_model(), _prompt(), temperature=0.8, top_p=0.9, seed=5, **kw)
  assert len(r.ids) == 20 and all(0 <= t < _model().cfg.vocab_size for t in r.ids)
  assert speculative_generate(_model(), _prompt(), temperature=0.8, top_p=0.9, seed=5, **kw).ids == r.ids
  nucleus = speculative_generate(_model(), _prompt(), temperature=0.8, top_p=1e-6, seed=5, **kw)
  greedy = speculative_generate(_model(), _prompt(), **kw)
  plain = generate(_model(), _prompt(), max_new_tokens=20, stop_at_eos=False, kv="bf16", kv_resident=1024).ids
  assert nucleus.ids == greedy.ids == plain
  assert nucleus.stats["drafts_accepted"] == greedy.stats["drafts_accepted"]


@pytest.mark.parametrize("drafter", ["mtp", "lookup"])
def test_greedy_speculative_with_a_host_tier_equals_plain_greedy(drafter, monkeypatch, request):
  """A ring of 256 under max_context 1024 (the seed experiment's setting in small): a 600-token prompt and
  verify passes that move positions into the host tier as they leave the window; the tokens of plain greedy
  decoding on one ring that holds everything, and the same acceptance as speculative decoding on that ring."""
  prompt = _prompt(600, seed=4)
  plain = generate(_model(), prompt, max_new_tokens=N_NEW, stop_at_eos=False, kv="int8", kv_resident=2048).ids
  kw = dict(drafter=drafter, k=3, max_new_tokens=N_NEW, stop_at_eos=False, kv="int8", mtp_window=256)
  tier = speculative_generate(_model(), prompt, kv_resident=256, max_context=1024, **kw)
  big = speculative_generate(_model(), prompt, kv_resident=2048, **kw)
  assert tier.ids == plain
  assert tier.stats["drafts_accepted"] == big.stats["drafts_accepted"]


def test_prefill_cache_reuse_changes_no_token():
  """bench.prefill_cache.PrefillCache (bench.cells --reuse_prefill): a 600-token prompt prefilled once on a 256-slot ring
  with a host tier (max_context 1024: the prompt already wraps the ring) serves the later requests with the same
  ring, k and chunking. Every request emits the tokens and draft counts of the same request prefilling by itself;
  the plain, NextN and lookup requests (k = 3) share one entry (beside a host tier every request has the same
  scratch slots, engine.TIER_SCRATCH, and the drafter ring is filled after the prefill); each use gets its own
  copy of the state (the steps donate it)."""
  from bench.prefill_cache import PrefillCache
  m = _model()
  prompt = _prompt(600, seed=5)
  kw = dict(max_new_tokens=24, stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024, prefill_chunk=128)
  cache = PrefillCache(capacity=2)
  plain = generate(m, prompt, **kw)
  for _ in range(2):
    got = generate(m, prompt, prefill_cache=cache, **kw)
    assert got.ids == plain.ids
  assert got.stats["prefill_reused"] and not plain.stats["prefill_reused"]
  assert got.stats["ttft_s"] > 0 and (cache.hits, cache.misses) == (1, 1)
  # TTFT's parts: a prefilling request's setup (checks, allocation, the cache's bookkeeping) and prefill are inside
  # its window; a hit has no prefill of its own
  assert plain.stats["prefill_s"] > 0 and plain.stats["setup_s"] >= 0
  assert plain.stats["setup_s"] + plain.stats["prefill_s"] <= plain.stats["ttft_s"]
  assert got.stats["prefill_s"] is None and 0 <= got.stats["setup_s"] <= got.stats["ttft_s"]
  for drafter in ("mtp", "lookup", "mtp"):
    alone = speculative_generate(m, prompt, drafter=drafter, k=3, mtp_window=256, **kw)
    shared = speculative_generate(m, prompt, drafter=drafter, k=3, mtp_window=256, prefill_cache=cache, **kw)
    assert alone.ids == shared.ids == plain.ids
    assert alone.stats["setup_s"] + alone.stats["prefill_s"] <= alone.stats["ttft_s"]
    assert (alone.stats["drafts_proposed"], alone.stats["drafts_accepted"]) == \
        (shared.stats["drafts_proposed"], shared.stats["drafts_accepted"])
  assert (cache.hits, cache.misses, len(cache)) == (4, 1, 1)


def test_plain_and_speculative_requests_beside_a_tier_share_one_window():
  """Beside a host tier the window (capacity - scratch) decides which positions attention takes from the ring and
  which from the tier, and the two parts sum in different orders; so a plain request and a speculative one at any
  k <= 7 get the same scratch (engine.TIER_SCRATCH) and window, and replay's drafts (the plain request's tokens)
  are all accepted. Without a tier the scratch stays k + 1."""
  from decode import engine
  m = _model()
  prompt = _prompt(600, seed=6)
  gen = engine.GenConfig(max_new_tokens=24, stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024)
  windows = {k: engine.start_request(m, prompt, gen, k=k).state.ring.window for k in (0, 1, 3, 7)}
  assert set(windows.values()) == {256 - engine.TIER_SCRATCH}, windows
  small = engine.GenConfig(max_new_tokens=8, stop_at_eos=False, kv="int8", kv_resident=256)
  assert engine.start_request(m, prompt[:100], small, k=3).state.ring.scratch == 4
  kw = dict(max_new_tokens=24, stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024)
  plain = generate(m, prompt, **kw)
  rep = speculative_generate(m, prompt, drafter="replay", k=3, replay_ids=plain.ids, **kw)
  assert rep.ids == plain.ids and rep.stats["acceptance"] == 1.0


def test_memory_plan_counts_the_host_tier_the_engine_allocates():
  """kv_plan's host tier item is the bytes of the tier a request allocates: indexed by position, max_context plus
  the scratch slots (it said max_context - ring before, 1.6 GB short of the 6.9 GB tier of a seed4 arm); its
  "tier pieces" item the largest piece of it that attention moves to the device, at the request's tunings."""
  from decode import engine
  from decode.kv_plan import make_plan
  from ops.tuning import Tunings
  m = _model()
  gen = engine.GenConfig(max_new_tokens=8, stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024)
  for k in (0, 3):
    host = engine.start_request(m, _prompt(300, seed=7), gen, k=k).state.host
    plan = make_plan(m.cfg, weight_bytes=0, ring=256, kv="int8", max_context=1024, k=k)
    assert plan.get("host tier") == sum(x.nbytes for x in jax.tree.leaves(host)) > 0
    # the largest piece attention moves to the device: one layer's span, the default 16,384 halved to fit the
    # tier of 1,032 positions, 1,024 (ops.attention.tier_pieces)
    C = host.k[0].shape[0]
    per_position = sum(a[0].nbytes for a in (host.k, host.v, host.k_scale, host.v_scale)) // C
    assert C == 1032 and plan.get("tier pieces") == 1024 * per_position > 0
    # a request's own tunings: spans of 256 positions (the ring's 256-position attention block is the floor)
    spans = make_plan(m.cfg, weight_bytes=0, ring=256, kv="int8", max_context=1024, k=k,
                      tunings=Tunings(tier_span=256))
    assert spans.get("tier pieces") == 256 * per_position
  # an auto ring grows to hold the request and never gets a tier: the plan lists none
  auto = dataclasses.replace(gen, kv_resident=None)
  started = engine.start_request(m, _prompt(300, seed=7), auto, k=3)
  assert started.state.host is None and started.grow
  plan = make_plan(m.cfg, weight_bytes=0, ring=started.cap, kv="int8", max_context=1024, k=3, fixed_ring=False)
  assert plan.get("host tier") == 0 and plan.get("main ring") > 0


def test_drafter_prefill_runs_the_entries_its_ring_keeps(monkeypatch):
  """A prompt longer than the NextN drafter's ring (mtp_window 32, k = 3: 36 slots): the drafter's prefill runs its
  ring's newest 36 entries in one call (never a slot written twice in a call, whose winner a GPU scatter leaves
  unspecified) and leaves the ring that entry-by-entry order leaves (chunks of at most 36 rows over the whole
  prompt, the reference); the speculative tokens equal plain greedy."""
  from decode.engine import GenConfig
  from decode.speculative import start_speculative
  from model import api
  from model import state as model_state
  m, k, W = _model(), 3, 32
  prompt = _prompt(100, seed=8)
  gen = GenConfig(max_new_tokens=N_NEW, stop_at_eos=False, kv="f32", kv_resident=1024)
  real, rows = api.mtp_step, []
  monkeypatch.setattr(api, "mtp_step", lambda p, h, t, ring, **kw: rows.append((h.shape[0], ring.capacity))
                      or real(p, h, t, ring, **kw))
  got = start_speculative(m, prompt, gen, drafter="mtp", k=k, mtp_window=W).s.model.mtp_ring
  assert rows == [(36, 36)], rows
  st = model_state.init_state(m.cfg, 1024, "f32", mtp_window=W, scratch=k + 1)
  _, hidden, _ = api.prefill(m.params, jnp.asarray(prompt, jnp.int32), st.replace(mtp_ring=None), cfg=m.cfg)
  ring = st.mtp_ring
  for a in range(0, len(prompt) - 1, ring.capacity):       # entries a .. : hidden[j] with prompt[j + 1]
    b = min(a + ring.capacity, len(prompt) - 1)
    ring = real(m.params, hidden[a:b], jnp.asarray(prompt[a + 1:b + 1], jnp.int32), ring, cfg=m.cfg)[2]
  assert int(got.length) == int(ring.length) == len(prompt) - 1
  with pytest.raises(ValueError, match="37 entries in one call, expected at most the drafter ring's capacity 36"):
    real(m.params, hidden[:37], jnp.asarray(prompt[1:38], jnp.int32), ring, cfg=m.cfg)
  for x, y in zip(jax.tree.leaves((got.k, got.v)), jax.tree.leaves((ring.k, ring.v))):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
  plain = generate(m, prompt, max_new_tokens=N_NEW, stop_at_eos=False, kv="f32", kv_resident=1024).ids
  assert speculative_generate(m, prompt, drafter="mtp", k=k, max_new_tokens=N_NEW, stop_at_eos=False, kv="f32",
                              kv_resident=1024, mtp_window=W).ids == plain


def test_a_request_keeps_the_prompts_last_hidden_states(monkeypatch):
  """start_request keeps engine.hidden_rows of the prompt's hidden states (the last positions; a chunked prefill
  drops older chunks as it goes), equal to those rows of one whole-prompt prefill."""
  from decode import engine
  from decode.engine import GenConfig, start_request
  from model import api
  from model import state as model_state
  m = _model()
  prompt = _prompt(100, seed=9)
  monkeypatch.setattr(engine, "HIDDEN_ROWS", 20)
  st = model_state.init_state(m.cfg, 1024, "f32")
  _, want, _ = api.prefill(m.params, jnp.asarray(prompt, jnp.int32), st, cfg=m.cfg)
  for chunk in (None, 16, 7):
    got = start_request(m, prompt, GenConfig(max_new_tokens=4, kv="f32", kv_resident=1024, prefill_chunk=chunk)).hidden
    assert got.shape == (20, m.cfg.d_model), (chunk, got.shape)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[-20:]), rtol=2e-5, atol=2e-5, err_msg=str(chunk))
