"""The KV ring (issue 4, DESIGN invariants 1, 2, 5): capacity invariance, sliding windows, int8 bound, growth."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode import engine
from decode.engine import generate
from model.options import Options
from model.kv_ring import KVRing
from model import api
from model.loader import load_model
from ops.attention import ring_attention_ref
from tools import llama_ref
from tests.models import model_path
from tests.ref_forward import RefModel

DEPTH = 1000


@functools.lru_cache(maxsize=None)
def _model(kind="Q4_K_M"):
  return load_model(model_path("qwen3moe", kind))


def _run(cap: int, kv: str, steps: int = 4):
  """Logits of a DEPTH-token prefill plus `steps` greedy decode steps on a ring of capacity `cap`."""
  m = _model()
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 1024, DEPTH), jnp.int32)
  st = api.init_state(m.cfg, cap, kv)
  lg, _, st = api.prefill(m.params, toks, st, cfg=m.cfg)
  out, t = [np.asarray(lg)], jnp.argmax(lg[-1])
  for _ in range(steps):
    l, _, st = api.decode_step(m.params, t, st, cfg=m.cfg)
    out.append(np.asarray(l)[None])
    t = jnp.argmax(l)
  return np.concatenate(out)


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_capacity_invariance_bitwise_at_depth_1k(kv):
  """Rings of 1536 (not a power of two), 2048, 4096 and 49152 slots: bitwise-equal logits and tokens."""
  ref = _run(1536, kv)
  for cap in (2048, 4096, 49152):
    got = _run(cap, kv)
    np.testing.assert_array_equal(got, ref, err_msg=f"R={cap} differs from R=1536 ({kv})")


def _sliding_reference(q, k_all, v_all, q_pos, window, scale):
  """Full-cache attention where a query at q sees positions (q - window, q] (float64)."""
  T, Hq, D = q.shape
  Hkv = k_all.shape[1]
  G = Hq // Hkv
  out = np.zeros((T, Hq, D))
  for t in range(T):
    lo = max(0, q_pos[t] - window + 1)
    for h in range(Hq):
      s = k_all[lo:q_pos[t] + 1, h // G] @ q[t, h] * scale
      p = np.exp(s - s.max())
      out[t, h] = (p / p.sum()) @ v_all[lo:q_pos[t] + 1, h // G]
  return out


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_wrapped_ring_is_a_sliding_window(kv):
  """A ring of R slots with `scratch` slack, written far past R, attends over exactly the last R - scratch
  positions at every step (what the drafter ring relies on), against a full-cache float64 reference."""
  rng = np.random.default_rng(1)
  R, scratch, block, n, Hkv, Hq, D = 64, 8, 16, 200, 2, 4, 32
  ks, vs = rng.standard_normal((n, Hkv, D)), rng.standard_normal((n, Hkv, D))
  ring = KVRing.create(1, R, Hkv, D, kv, block=block, scratch=scratch)
  window = R - scratch
  worst = 0.0
  for p in range(n):
    ring = ring.write(0, jnp.asarray([p]), jnp.asarray(ks[p:p + 1], jnp.float32), jnp.asarray(vs[p:p + 1], jnp.float32))
    # a speculative overshoot write past the accepted length, then a rewind: must never be read
    ring = ring.write(0, jnp.asarray([p + 1 + p % scratch]), jnp.full((1, Hkv, D), 1e3, jnp.float32),
                      jnp.full((1, Hkv, D), 1e3, jnp.float32)).advance(1)
    if p % 13:
      continue
    q = rng.standard_normal((1, Hq, D))
    got = ring_attention_ref(jnp.asarray(q, jnp.float32), ring.k[0], ring.v[0],
                             None if ring.k_scale is None else ring.k_scale[0],
                             None if ring.v_scale is None else ring.v_scale[0],
                             jnp.asarray([p]), ring.length + scratch, block=block, scale=D ** -0.5)
    want = _sliding_reference(q, ks, vs, [p], window, D ** -0.5)
    worst = max(worst, llama_ref.rel_l2(np.asarray(got), want))
  assert worst < (1e-5 if kv == "f32" else 2e-2), worst


# int8 KV: absmax per (token, head) gives |x - x_q| <= s/2 = max|x| / 254 per element. Stated bound on the
# logits of the tiny models against the float64 forward at depth 64: relative L2 < 2e-2 (bf16 KV: < 1e-2).
INT8_BOUND, BF16_BOUND = 2e-2, 1e-2


@pytest.mark.parametrize("arch", ["qwen3moe", "glm4moe"])
def test_int8_and_bf16_kv_error_bounds(arch):
  m = load_model(model_path(arch, "F32"))
  toks = [int(t) for t in np.random.default_rng(0).integers(0, 1024, 64)]
  ref, _ = RefModel(model_path(arch, "F32")).forward(toks)
  errs = {}
  for kv in ("f32", "bf16", "int8"):
    lg, _, _ = api.prefill(m.params, jnp.asarray(toks, jnp.int32), api.init_state(m.cfg, 256, kv), cfg=m.cfg)
    errs[kv] = llama_ref.rel_l2(np.asarray(lg), ref)
  print(f"\n{arch}: logits rel L2 vs float64 forward: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
  assert errs["f32"] < 1e-5
  assert errs["bf16"] < BF16_BOUND
  assert errs["int8"] < INT8_BOUND
  assert errs["int8"] > errs["f32"]          # the int8 path really quantizes


def test_growth_across_buckets_equals_one_large_ring():
  m = _model()
  prompt = [int(t) for t in np.random.default_rng(2).integers(0, 1024, 1000)]
  grown = generate(m, prompt, max_new_tokens=60, stop_at_eos=False, kv="int8", ring_start=1000)
  big = generate(m, prompt, max_new_tokens=60, stop_at_eos=False, kv="int8", kv_resident=4096)
  assert grown.stats["ring_buckets"] == [1024, 2048]
  assert grown.ids == big.ids


def test_a_first_bucket_smaller_than_the_prompt_still_holds_it():
  """ring_start below the prompt's length: the first bucket still holds the whole prompt (a prefill into a smaller
  ring overwrote its oldest positions and decoded other tokens with exit status 0), so the tokens equal one large
  ring's; a forward pass of more tokens than the ring has slots is refused with a one-line error."""
  m = _model()
  prompt = [int(t) for t in np.random.default_rng(2).integers(0, 1024, 1500)]
  grown = generate(m, prompt, max_new_tokens=8, stop_at_eos=False, kv="int8", ring_start=100)
  big = generate(m, prompt, max_new_tokens=8, stop_at_eos=False, kv="int8", kv_resident=4096)
  assert grown.stats["ring_buckets"][0] == 2048 and grown.ids == big.ids
  with pytest.raises(ValueError, match="forward: 300 tokens in one call, expected at most the ring's capacity 256"):
    api.prefill(m.params, jnp.zeros((300,), jnp.int32), api.init_state(m.cfg, 256, "int8"), cfg=m.cfg)


def test_fixed_ring_that_cannot_hold_the_request_is_refused():
  from decode.engine import RequestError
  with pytest.raises(RequestError, match="exceeds max_context 1024"):
    generate(_model(), list(range(1000)), max_new_tokens=60, kv_resident=1024)


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_host_tier_wrapping_ring_equals_full_cache(kv):
  """R = 256 with max_context 1024: 600-token prompt (chunked prefill) and 60 generated tokens wrap the ring
  twice; positions older than its window live in the host tier, merged exactly (log-sum-exp). Same greedy
  tokens and logits within float tolerance of one ring holding everything."""
  from decode.engine import GenConfig, start_request
  m = _model()
  prompt = [int(t) for t in np.random.default_rng(2).integers(0, 1024, 600)]
  big = generate(m, prompt, max_new_tokens=60, stop_at_eos=False, kv=kv, kv_resident=2048)
  small = generate(m, prompt, max_new_tokens=60, stop_at_eos=False, kv=kv, kv_resident=256, max_context=1024)
  assert small.ids == big.ids
  logits = []
  for gen in (GenConfig(max_new_tokens=8, kv=kv, kv_resident=2048),
              GenConfig(max_new_tokens=8, kv=kv, kv_resident=256, max_context=1024)):
    st = start_request(m, prompt, gen)
    assert (st.state.host is None) == (gen.kv_resident == 2048)
    out, state = [np.asarray(st.logits)], st.state
    for t in big.ids[:8]:
      l, _, state = api.decode_step(m.params, jnp.int32(t), state, cfg=m.cfg)
      out.append(np.asarray(l)[None])
    logits.append(np.concatenate(out))
  err = llama_ref.rel_l2(logits[1], logits[0])
  print(f"\nhost tier vs one ring ({kv}): logits rel L2 {err:.2e}")
  # only the summation order differs (two partial softmaxes merged, chunked prefill): f32 measured 2.8e-7,
  # int8 1.4e-5 (same stored bytes; the larger int8 dynamic range amplifies the reordering)
  assert err < (1e-5 if kv == "f32" else 1e-4)


def test_host_tier_block_tuning_reaches_the_tier_and_keeps_the_tokens(monkeypatch):
  """Tunings.tier_block and tier_span set the pieces of attention over the tier (model.host_tier.tier_block: on a
  1,024-slot ring the default block is 512, HOST_BLOCK halved to the window; tier_span: HOST_SPAN, at least the
  block): the tier's calls take them, and the greedy tokens equal one ring holding everything. (The pieces
  themselves: tests/ops/test_attention.py, the tier tests.)"""
  from model.host_tier import HOST_SPAN
  from ops import attention as attn_ops
  from ops.tuning import Tunings
  real, seen = attn_ops.tier_attention, []
  monkeypatch.setattr(attn_ops, "tier_attention",
                      lambda *a, **kw: seen.append((kw["tier_block"], kw["tier_span"])) or real(*a, **kw))
  m = _model()
  prompt = [int(t) for t in np.random.default_rng(5).integers(0, 1024, 1040)]
  big = generate(m, prompt, max_new_tokens=8, stop_at_eos=False, kv="int8", kv_resident=2048)
  for tb, ts, want in ((256, 256, (256, 256)), (4096, None, (512, HOST_SPAN))):  # each its own Options: traced here
    seen.clear()
    small = generate(m, prompt, max_new_tokens=8, stop_at_eos=False, kv="int8", kv_resident=1024, max_context=2048,
                     options=Options(tunings=Tunings(tier_block=tb, tier_span=ts)))
    assert set(seen) == {want}, (tb, ts, seen)
    assert small.ids == big.ids, tb
  with pytest.raises(ValueError, match="tier_block 3000, expected a power of two"):
    Tunings(tier_block=3000)
  with pytest.raises(ValueError, match="tier_span 100, expected a power of two"):
    Tunings(tier_span=100)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_host_tier_beside_the_attention_kernels_equals_full_cache(kernel, monkeypatch, request):
  """With a host tier the ring's part of attention runs on the kernels (interpret mode here, compiled on a GPU)
  and returns its log-sum-exp for the merge with the tier's part: decode steps on the decode kernel, prefill
  chunks on the prefill kernel. The same greedy tokens as one ring holding everything, also on the kernels; every
  kernel call beside the tier asks for the lse, none without it."""
  from ops import attention_pallas, prefill_attention_pallas
  from ops.tuning import Tunings
  module, name = ((attention_pallas, "ring_attention_pallas") if kernel == "decode" else
                  (prefill_attention_pallas, "prefill_attention_pallas"))
  real, calls = getattr(module, name), []

  def counted(*a, **kw):
    calls.append(kw.get("with_lse", False))
    return real(*a, **kw)

  tunings = (Tunings(attention_impl="interpret", prefill_attention_impl="ref") if kernel == "decode" else
             Tunings(attention_impl="interpret", prefill_attention_impl="interpret"))
  monkeypatch.setattr(module, name, counted)
  m = _model()
  n, kw = (300, dict(max_new_tokens=16)) if kernel == "decode" else (400, dict(max_new_tokens=8, prefill_chunk=100))
  kw["options"] = Options(tunings=tunings)
  prompt = [int(t) for t in np.random.default_rng(4).integers(0, 1024, n)]
  big = generate(m, prompt, stop_at_eos=False, kv="int8", kv_resident=1024, **kw)
  assert calls and not any(calls)
  calls.clear()
  small = generate(m, prompt, stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024, **kw)
  # the decode steps all run beside the tier; the prompt's first chunks stay inside the window and run ring-only
  assert calls and (all(calls) if kernel == "decode" else set(calls) == {False, True})
  assert small.ids == big.ids


def test_host_tier_in_host_memory_equals_device_tier(monkeypatch, request):
  """The tier placed in pinned_host memory (as on a GPU; jax's CPU client has the kind) runs the jitted steps
  through host-memory slices and updates only, and gives the same tokens and bitwise the same logits as the
  tier in device memory."""
  from model import host_tier
  from decode.engine import GenConfig, start_request
  m = _model()
  prompt = [int(t) for t in np.random.default_rng(3).integers(0, 1024, 600)]
  gen = GenConfig(max_new_tokens=8, kv="int8", kv_resident=256, max_context=1024)
  dev = start_request(m, prompt, gen)
  base = generate(m, prompt, max_new_tokens=40, stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024)
  place = host_tier.place_on_host
  monkeypatch.setattr(host_tier, "place_on_host", lambda t: place(t, memory_kind="pinned_host"))
  n_prefill = api.prefill._cache_size()
  host = start_request(m, prompt, gen)
  assert {a.sharding.memory_kind for a in host.state.host.k} == {"pinned_host"}
  # chunks of the window (248) and one tail: the first chunk ring-only (the tier held out; the state committed,
  # unlike the device-tier request's), the second and the tail beside the tier: three compiles. The tier's
  # committed arrays make every array of a chunk's output committed, so without engine.commit_for_store the
  # first chunk's inputs differed from the later ones' and compiled again
  assert api.prefill._cache_size() - n_prefill == 3
  np.testing.assert_array_equal(np.asarray(host.logits), np.asarray(dev.logits))
  for a, b in zip(host.state.host.k + host.state.host.v, dev.state.host.k + dev.state.host.v):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  n_loop = engine.decode_loop._cache_size()
  got = generate(m, prompt, max_new_tokens=40, stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024)
  assert got.ids == base.ids
  assert engine.decode_loop._cache_size() - n_loop <= 1


def _ring_copies(hlo: str, ring: KVRing) -> int:
  """Copies of a whole ring array (K/V codes [R, Hkv, Dh] or their scales [R, Hkv]) in an optimized HLO module."""
  R, Hkv, Dh = ring.k[0].shape
  pat = re.compile(rf"= (s8\[{R},{Hkv},{Dh}\]|f32\[{R},{Hkv}\])\S* copy\(")
  return sum(1 for line in hlo.splitlines() if pat.search(line))


@pytest.mark.parametrize("drafter", ["plain", "lookup", "mtp"])
def test_host_tier_steps_never_copy_the_ring(drafter, monkeypatch, request):
  """A step or speculative round with a host tier attached updates the ring in place: the compiled program holds
  no copy of a whole ring array. The tier's evict reads ring rows that the layers then overwrite in place; with
  those reads unordered against the writes, XLA copied every layer's ring in each step (in a lookup round: in
  the loop body and again in each branch of its draftless `lax.cond`), a cost proportional to the capacity R
  at any depth, the seed report's shape (a larger ring slower at 1K). `host_tier.evict_leaving` orders them
  with an optimization barrier. Checked on the XLA CPU compiler."""
  from bench import cells as bench
  from decode import speculative as sp
  from decode.engine import GenConfig, start_request
  opts = Options()
  m = bench._in_memory_model("tiny-glm4moe", "IQ3_S")
  k, prompt = 3, list(range(1, 40))
  gen = GenConfig(kv="int8", kv_resident=1024, max_new_tokens=16, max_context=8192)
  st = start_request(m, prompt, gen, k=0 if drafter == "plain" else k, mtp_window=256 if drafter == "mtp" else None)
  assert st.state.host is not None and st.state.ring.capacity == 1024
  if drafter == "plain":
    lowered = api.decode_step.lower(m.params, jnp.int32(1), st.state, cfg=m.cfg, options=opts)
  else:
    H, z = 128, jnp.zeros((k,), jnp.int32)
    s = sp.SpecState(st.state, jnp.zeros((H,), jnp.int32), jnp.int32(40), jnp.int32(39),
                     jnp.zeros((k + 1, m.cfg.d_model)), jnp.zeros((k + 1,), jnp.int32), jnp.int32(1),
                     jax.random.PRNGKey(0), jnp.asarray(False), z, z, jnp.int32(0))
    lowered = sp.spec_loop.lower(m.params, s, jnp.full((H,), -1, jnp.int32), jnp.int32(-1), jnp.int32(16),
                                 cfg=m.cfg, k=k, drafter=drafter, temperature=0.0, top_p=1.0, options=opts)
  assert _ring_copies(lowered.compile().as_text(), st.state.ring) == 0


def test_idle_tier_held_out_crosses_the_window_exactly(monkeypatch, request):
  """A prompt shorter than the ring's window: the engine holds the host tier out of the calls whose positions stay
  inside the window (model.api.split_idle_tier: ring-only programs) and runs the tier's path from the first step
  that reaches it. Same greedy tokens as one ring holding everything, and the same logits as steps that run the
  tier's path throughout (the tier's partial over an empty tier is empty: merging it changes nothing)."""
  from decode.engine import GenConfig, start_request
  m = _model()
  prompt = [int(t) for t in np.random.default_rng(5).integers(0, 1024, 200)]
  big = generate(m, prompt, max_new_tokens=90, stop_at_eos=False, kv="int8", kv_resident=2048)
  kw = dict(max_new_tokens=90, stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024)
  assert generate(m, prompt, **kw).ids == big.ids
  assert generate(m, prompt, eager=True, **kw).ids == big.ids
  logits = {}
  for hold in (False, True):
    st = start_request(m, prompt, GenConfig(**kw))
    out, state = [], st.state
    for t in big.ids[:70]:                    # positions 200 .. 269 cross the window (248) at step 48
      state, held = api.split_idle_tier(state, int(state.ring.length)) if hold else (state, None)
      l, _, state = api.decode_step(m.params, jnp.int32(t), state, cfg=m.cfg)
      state = api.join_tier(state, held)
      out.append(np.asarray(l))
    logits[hold] = np.stack(out)
  np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=1e-5)


def test_idle_tier_held_out_runs_no_tier_work_while_idle(monkeypatch, request):
  """Counted at run time (a jax.debug.callback inside the tier's path, host_tier.evict_leaving): a request whose
  positions stay inside the ring's window runs the tier's path in no pass, jitted or eager; a request that crosses
  the window runs it exactly in the passes whose last position has left the window, plain or speculative."""
  from model import host_tier
  from decode.engine import GenConfig, start_request
  from decode.speculative import speculative_generate
  runs = []
  real = host_tier.evict_leaving

  def counted(tier, ring, pos):
    jax.debug.callback(lambda p: runs.append(int(p[-1])), pos)
    return real(tier, ring, pos)

  monkeypatch.setattr(host_tier, "evict_leaving", counted)
  request.addfinalizer(jax.clear_caches)
  m = _model()
  kw = dict(stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024)
  window = start_request(m, [1], GenConfig(max_new_tokens=1, **kw)).state.ring.window
  prompt = [int(t) for t in np.random.default_rng(6).integers(0, 1024, 100)]
  for eager in (False, True):
    runs.clear()
    generate(m, prompt, max_new_tokens=20, eager=eager, **kw)
    jax.effects_barrier()
    assert runs == [], (eager, runs)
  long = [int(t) for t in np.random.default_rng(7).integers(0, 1024, window - 10)]   # ends 10 before the edge
  runs.clear()
  generate(m, long, max_new_tokens=30, **kw)              # steps write positions window - 10 .. window + 18
  jax.effects_barrier()
  assert runs == list(range(window, window + 19)), runs
  runs.clear()
  r = speculative_generate(m, long, drafter="lookup", k=3, max_new_tokens=30, **kw)
  jax.effects_barrier()
  # a round at P writes P .. P + 3 (a draftless round P alone): the tier's path from the first round whose last
  # position P + 3 reaches the window (recorded: P + 3, or P for a draftless one), in no round before it
  assert runs and min(runs) >= window - 3 and max(runs) >= window and len(runs) <= r.stats["rounds"], runs


def test_first_interpret_kernel_trace_does_not_recompile_the_prefill():
  """In a fresh process (nothing imported yet): a prompt of two equal chunks through the Pallas kernels in interpret
  mode compiles the prefill once. Pallas' interpreter, imported at the first interpret trace, adds a value to jax's
  tracing context, so the second chunk missed the cache and compiled again; `ops` imports it up front."""
  import subprocess
  import sys
  code = """
import jax
from bench import cells as bench
from decode import engine
from model import api
from ops.qtensor import with_kernels
m = bench._in_memory_model("tiny-qwen3moe", "Q8_0")
m.params = with_kernels(m.params, "interpret")
gen = engine.GenConfig(max_new_tokens=1, kv="int8", kv_resident=256)
state = engine.init_state(m, 256, gen)
engine.prefill_chunked(m.params, list(range(1, 33)), state, m.cfg, 16)
print("compiles", api.prefill._cache_size())
"""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=__file__.rsplit("/tests/", 1)[0])
  assert out.returncode == 0, out.stderr[-2000:]
  assert "compiles 1" in out.stdout, out.stdout
