"""Expert cache (issue 6): outputs bitwise equal to every-expert-resident for any N >= top_k, the miss counts of
its LRU policy equal an independent simulation over the routing of the float64 reference, and the store's
placement (a no-op on CPU; pinned host memory, which jax's CPU client also has, read through `ensure`), also as
the engine places it (GenConfig.expert_store forces the kind on CPU)."""
from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import expert_cache as xc
from decode import engine
from decode.engine import GenConfig, generate
from decode.speculative import speculative_generate
from model import api
from model.loader import load_model
from tests.models import model_path
from tests.ref_forward import RefModel, rms_norm

STEPS = 12


@functools.lru_cache(maxsize=None)
def _m(arch, kind):
  return load_model(model_path(arch, kind))


def _decode(m, slots, policy="lru", n_prompt=20, step_params=None, options=api.DEFAULT):
  """Prefill (store read directly: T * top_k > E) then STEPS greedy decode steps with `step_params` (default:
  m.params), whose store may be placed elsewhere, and the model `options`."""
  step_params = m.params if step_params is None else step_params
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 1000, n_prompt), jnp.int32)
  st = api.init_state(m.cfg, 1024, "bf16")
  if slots is not None:
    st = st.replace(experts=xc.create(step_params, m.cfg, slots, policy))
  lg, _, st = api.prefill(m.params, toks, st, cfg=m.cfg)
  out, t, seq = [np.asarray(lg)], jnp.argmax(lg[-1]), list(np.asarray(toks))
  for _ in range(STEPS):
    seq.append(int(t))
    l, _, st = api.decode_step(step_params, t, st, cfg=m.cfg, options=options)
    out.append(np.asarray(l)[None])
    t = jnp.argmax(l)
  return np.concatenate(out), st, seq


@pytest.mark.parametrize("arch,kind,policy", [("glm4moe", "IQ3_S", "lru"), ("qwen3moe", "Q4_K_M", "lfu"),
                                               ("glm4moe", "F16", "lfu"), ("qwen3next", "Q4_K_M", "lru")])
def test_logits_bitwise_equal_to_all_resident(arch, kind, policy):
  m = _m(arch, kind)
  ref, _, _ = _decode(m, None)
  for slots in (m.cfg.top_k, 4 * m.cfg.n_experts):
    got, st, _ = _decode(m, slots, policy)
    np.testing.assert_array_equal(got, ref, err_msg=f"{arch} {kind} {policy} N={slots}")
    s = st.experts.stats()
    moe_blocks = [i for i in range(m.cfg.n_layers) if m.cfg.is_moe_layer(i)]
    slab = xc.slab_bytes(m.params, m.cfg)
    for b in moe_blocks:    # each decode step routes top_k experts per MoE block through the cache
      assert s["hits"][b] + s["misses"][b] == STEPS * m.cfg.top_k and s["steps"][b] == STEPS
      assert s["bytes_moved"][b] == s["misses"][b] * slab[st.experts.pool_of_block[b]]
    assert sum(s["misses"]) > 0 and s["bytes_moved"][moe_blocks[0]] > 0
    assert s["bytes_per_step"] == sum(s["bytes_moved"][b] for b in moe_blocks) / STEPS
    assert s["store_memory_kind"] == "device"


def test_lru_misses_equal_an_independent_simulation():
  """Routing from the float64 reference (teacher-forced on the same tokens) drives a plain-Python LRU over one
  pool of N slots, where a step's own experts are never evicted; per-block misses must match."""
  m = _m("qwen3moe", "IQ3_S")
  N = 5
  _, st, seq = _decode(m, N)
  ref = RefModel(model_path("qwen3moe", "IQ3_S"))
  pos = np.arange(len(seq))
  x = ref.t["token_embd.weight"][np.asarray(seq)]
  ids = {}
  for il in range(ref.n_layers):
    p = f"blk.{il}."
    h = x + ref._attention(il, rms_norm(x, ref.t[p + "attn_norm.weight"], ref.eps), pos)
    ids[il] = ref.route(il, rms_norm(h, ref.t[p + "ffn_norm.weight"], ref.eps))[0]   # the router's choice
    x = ref.block(il, x, pos)
  lru, misses = OrderedDict(), {il: 0 for il in ids}
  for p in range(20, 20 + STEPS):           # decode steps feed positions 20 .. 20 + STEPS - 1
    for il in sorted(ids):
      need = [int(e) for e in ids[il][p]]
      for e in need:
        key = (il, e)
        if key in lru:
          lru.move_to_end(key)
          continue
        misses[il] += 1
        if len(lru) >= N:
          for victim in lru:
            if victim[0] != il or victim[1] not in need:
              del lru[victim]
              break
        lru[key] = True
  got = st.experts.stats()["misses"]
  assert [got[il] for il in sorted(ids)] == [misses[il] for il in sorted(ids)]


# (policy, lanes, eager): the miss copies one a loop iteration (the default), in groups of 2 or 4 with the first
# group outside the loop, and in groups that cover M = 6 without a loop (4 x 2, 8 x 1)
COPIES = [("lru", 1, 0), ("lfu", 1, 0), ("lru", 2, 0), ("lfu", 4, 1), ("lru", 4, 2), ("lfu", 8, 1)]


@pytest.mark.parametrize("policy,lanes,eager", COPIES)
def test_ensure_against_a_python_cache_with_repeated_ids(policy, lanes, eager):
  """`ensure` on calls of M = 6 ids with repeats (as a verify pass or a prefill chunk routes), over 8 slots of
  two blocks' experts, against a plain-Python cache with the documented rule: a call's distinct missing experts,
  in entry order, take the slots of lowest stamp among those no hit of the call holds (lowest slot on ties);
  LRU stamps every used slot with the call's clock, LFU adds one per call to each used slot (a load starts at
  0). Slots returned, owners, stamps and the hit/miss counters must agree after every call, and each slot must
  hold its owner's rows of the store, whatever groups the copies go in (lanes, eager)."""
  m = _m("glm4moe", "IQ3_S")
  blocks = xc.expert_blocks(m.cfg)[:2]
  S, E, M = 8, m.cfg.n_experts, 6
  cache = xc.create(m.params, m.cfg, S, policy)
  assert len(cache.pools) == 1 and cache.pools[0].n_slots >= S
  S = cache.pools[0].n_slots
  owner, stamp, clock = [-1] * S, [0] * S, 0
  hits = {b: 0 for b in blocks}
  misses = dict(hits)
  rng = np.random.default_rng(7)
  for call in range(40):
    b = blocks[call % 2]
    ids = [int(i) for i in rng.integers(0, min(E, 10), M)]              # few distinct ids: repeats and hits
    ffn = xc._block_ffn(m.params, m.cfg, b)
    got, cache = xc.ensure(cache, b, jnp.asarray(ids, jnp.int32), ffn["gate_exps"], ffn["up_exps"],
                           ffn["down_exps"], E, lanes=lanes, eager=eager)
    clock += 1
    where = {o: s for s, o in enumerate(owner) if o >= 0}
    held = {where[b * E + e] for e in ids if b * E + e in where}
    new = [e for i, e in enumerate(ids) if e not in ids[:i] and b * E + e not in where]
    free = sorted((s for s in range(S) if s not in held), key=lambda s: (stamp[s], s))
    for e, v in zip(new, free):
      owner[v], stamp[v] = b * E + e, 0
      where[b * E + e] = v
    want = [where[b * E + e] for e in ids]
    for v in set(want):
      stamp[v] = clock if policy == "lru" else stamp[v] + 1
    hits[b] += M - len(new)
    misses[b] += len(new)
    assert np.asarray(got).tolist() == want, call
    assert np.asarray(cache.pools[0].owner).tolist() == owner, call
    assert np.asarray(cache.pools[0].stamp).tolist() == stamp, call
    assert {(int(b_), int(e_)): int(v) for (b_, e_), v in np.ndenumerate(np.asarray(cache.slot_of)) if v >= 0} == \
        {(o // E, o % E): v for v, o in enumerate(owner) if o >= 0}, call
  for v, o in ((v, o) for v, o in enumerate(owner) if o >= 0):    # the slots' bytes: their owners' store rows
    ffn = xc._block_ffn(m.params, m.cfg, o // E)
    for pool_t, n in zip((cache.pools[0].gate, cache.pools[0].up, cache.pools[0].down),
                         ("gate_exps", "up_exps", "down_exps")):
      for got_p, want_p in zip(pool_t, xc._planes(ffn[n])):
        np.testing.assert_array_equal(np.asarray(got_p[v]), np.asarray(want_p[o % E]), err_msg=f"slot {v} {n}")
  st = cache.stats()
  assert [st["hits"][b] for b in blocks] == [hits[b] for b in blocks]
  assert [st["misses"][b] for b in blocks] == [misses[b] for b in blocks] and sum(misses.values()) > 10


def test_auto_slots_from_the_plan():
  """--expert_cache auto: no budget (CPU) or a budget that holds every expert -> all resident (None, no cache to
  run); a tighter budget -> the slots that fit what is left after everything else, fewer than all."""
  from decode.kv_plan import GiB, plan_request
  m = _m("glm4moe", "IQ3_S")
  kw = dict(ring=1024, kv="int8", max_context=None, mtp_window=None, k=0, expert_cache="auto",
            prefill_chunk=m.cfg.n_experts // m.cfg.top_k)          # chunks through the slots (no streamed block)
  total = len(xc.expert_blocks(m.cfg)) * m.cfg.n_experts
  slab = max(xc.slab_bytes(m.params, m.cfg).values())
  assert plan_request(m, **kw, budget=None)[1] is None
  assert plan_request(m, **kw, budget=64 * GiB)[1] is None
  everything = plan_request(m, **kw, budget=None)[0].device_bytes
  budget = everything - (total // 2) * slab
  plan, slots = plan_request(m, **kw, budget=budget)
  assert m.cfg.top_k <= slots < total and plan.free < slab <= plan.free + slab
  assert plan.get("expert cache slots") == slots * slab


def test_speculative_and_plain_with_cache_equal_without():
  m = _m("glm4moe", "IQ3_S")
  prompt = [int(t) for t in np.random.default_rng(4).integers(0, 1000, 16)]
  base = generate(m, prompt, max_new_tokens=20, stop_at_eos=False)
  cached = generate(m, prompt, max_new_tokens=20, stop_at_eos=False, expert_slots=m.cfg.top_k)
  assert cached.ids == base.ids and cached.stats["expert_cache"]["misses"][-1] == 0   # NextN row untouched
  spec = speculative_generate(m, prompt, drafter="mtp", k=2, max_new_tokens=20, stop_at_eos=False,
                              expert_slots=64, mtp_window=256)
  assert spec.ids == base.ids
  assert spec.stats["expert_cache"]["misses"][-1] > 0          # the NextN block's experts: their own class


def test_stats_split_prefill_and_decode():
  """The prefill phase's counters equal a request that stops after its prompt; decode routes top_k experts per
  trunk MoE block per generated token after the first; the phases add up to the per-block totals."""
  m = _m("glm4moe", "IQ3_S")
  prompt = [int(t) for t in np.random.default_rng(5).integers(0, 1000, 16)]
  kw = dict(stop_at_eos=False, expert_slots=m.cfg.top_k + 2)
  full = generate(m, prompt, max_new_tokens=12, **kw).stats["expert_cache"]
  prompt_only = generate(m, prompt, max_new_tokens=1, **kw).stats["expert_cache"]
  trunk_moe = [b for b in xc.expert_blocks(m.cfg) if b < m.cfg.n_layers]
  for k in ("hits", "misses", "bytes_moved"):
    assert full["prefill"][k] == sum(prompt_only[k]), k
    assert full["prefill"][k] + full["decode"][k] == sum(full[k]), k
  assert full["decode"]["hits"] + full["decode"]["misses"] == 11 * m.cfg.top_k * len(trunk_moe)
  assert full["decode"]["misses"] > 0 and full["per_token"]["misses"] == full["decode"]["misses"] / 12
  assert full["decode"]["hit_rate"] == full["decode"]["hits"] / (11 * m.cfg.top_k * len(trunk_moe))


def test_store_placement_is_a_noop_on_cpu():
  """On CPU the store stays where it is: one function decides, and the cache records the store's kind."""
  if jax.devices()[0].platform != "cpu":
    pytest.skip("CPU placement")
  m = _m("qwen3moe", "IQ3_S")
  assert xc.store_memory_kind() == "device"
  assert xc.place_store(m.params, m.cfg) is m.params
  assert {k for ks in xc.store_kinds(m.params, m.cfg).values() for k in ks} == {"device"}
  assert xc.create(m.params, m.cfg, m.cfg.top_k).store_memory_kind == "device"


@pytest.mark.skipif("pinned_host" not in {mem.kind for mem in jax.devices()[0].addressable_memories()},
                    reason="no pinned_host memory kind on this backend")
def test_store_in_pinned_host_memory_bitwise_equal():
  """The store placed in pinned host memory (jax's CPU client has the kind): decode steps read it only through
  `ensure` (a dynamic slice of the missed expert, moved to the device), with logits bitwise equal to every expert
  resident and the same counters as a device store; the prefill reads the device copy (T * top_k > E)."""
  m = _m("qwen3moe", "IQ3_S")
  host = xc.place_store(m.params, m.cfg, "pinned_host")
  assert {k for ks in xc.store_kinds(host, m.cfg).values() for k in ks} == {"pinned_host"}
  assert host["token_embd"] is m.params["token_embd"]           # only the experts move
  ref, _, _ = _decode(m, None)
  _, dev_st, _ = _decode(m, m.cfg.top_k)
  got, st, _ = _decode(m, m.cfg.top_k, step_params=host)
  np.testing.assert_array_equal(got, ref)
  s, d = st.experts.stats(), dev_st.experts.stats()
  assert s.pop("store_memory_kind") == "pinned_host" and d.pop("store_memory_kind") == "device"
  assert s == d and sum(s["misses"]) > 0
  # the engine's jitted loop (a while_loop over decode steps) with a prompt short enough (T * top_k <= E) that
  # the prefill also goes through the cache: the same tokens as every expert resident
  prompt = [int(t) for t in np.random.default_rng(5).integers(0, 1000, m.cfg.n_experts // m.cfg.top_k)]
  base = generate(m, prompt, max_new_tokens=8, stop_at_eos=False)
  on_host = generate(dataclasses.replace(m, params=host), prompt, max_new_tokens=8, stop_at_eos=False,
                     expert_slots=m.cfg.top_k)
  assert on_host.ids == base.ids and on_host.stats["expert_cache"]["store_memory_kind"] == "pinned_host"


@pytest.mark.skipif("pinned_host" not in {mem.kind for mem in jax.devices()[0].addressable_memories()},
                    reason="no pinned_host memory kind on this backend")
def test_miss_copy_groups_leave_the_same_steps_and_state():
  """Tunings.miss_lanes / miss_eager regroup the misses' copies from a pinned-host store (groups of 4 with the
  first outside the loop; groups covering a step's top_k experts, no loop): the hybrid's logits bitwise every
  expert resident's, and the whole cache (slots' bytes, owners, stamps, counters) the default grouping's."""
  from ops.tuning import Tunings
  m = _m("qwen3next", "Q4_K_M")
  host = xc.place_store(m.params, m.cfg, "pinned_host")
  ref, _, _ = _decode(m, None)
  _, base, _ = _decode(m, 2 * m.cfg.top_k, step_params=host)
  for lanes, eager in ((4, 1), (m.cfg.top_k, 1)):
    opts = api.DEFAULT.replace(tunings=Tunings(miss_lanes=lanes, miss_eager=eager))
    got, st, _ = _decode(m, 2 * m.cfg.top_k, step_params=host, options=opts)
    np.testing.assert_array_equal(got, ref, err_msg=f"lanes {lanes} eager {eager}")
    jax.tree.map(np.testing.assert_array_equal, st.experts, base.experts)
    assert sum(st.experts.stats()["misses"]) > STEPS


@pytest.mark.skipif("pinned_host" not in {mem.kind for mem in jax.devices()[0].addressable_memories()},
                    reason="no pinned_host memory kind on this backend")
@pytest.mark.parametrize("arch,kind", [("qwen3moe", "IQ3_S"), ("glm4moe", "F16")])
def test_engine_places_store_in_pinned_host(arch, kind, monkeypatch):
  """`generate` with N slots and expert_store="pinned_host" (on CPU the override stands in for what
  store_memory_kind() picks on a GPU): the engine places the store once per model (request_params); a prompt longer
  than n_experts / top_k tokens, in chunks of T * top_k > E, is prefilled through the direct path (the host store
  moved to the device inside the step), decode misses go through `ensure`. Tokens equal every expert resident,
  jitted and eager, and neither the prefill chunks nor the compile-then-timed decode loop compile twice."""
  m = _m(arch, kind)
  E, K = m.cfg.n_experts, m.cfg.top_k
  chunk = E // K + 2                                            # T * K > E in every prefill chunk
  monkeypatch.setattr(engine, "PREFILL_CHUNK", chunk)
  prompt = [int(t) for t in np.random.default_rng(6).integers(0, 1000, 3 * chunk)]
  base = generate(m, prompt, max_new_tokens=12, stop_at_eos=False)
  kw = dict(max_new_tokens=12, stop_at_eos=False, expert_slots=K, expert_store="pinned_host")
  n_prefill, n_loop = api.prefill._cache_size(), engine.decode_loop._cache_size()
  got = generate(m, prompt, **kw)
  # committed inputs (the placed store) vs uncommitted ones would key a second compile (engine._commit)
  assert api.prefill._cache_size() - n_prefill <= 1 and engine.decode_loop._cache_size() - n_loop <= 1
  assert got.ids == base.ids
  st = got.stats["expert_cache"]
  assert st["store_memory_kind"] == "pinned_host" and sum(st["misses"]) > 0
  gen = GenConfig(expert_slots=K, expert_store="pinned_host")
  placed = engine.request_params(m, gen)
  assert placed is engine.request_params(m, gen) and placed is not m.params      # placed once, kept on the model
  assert {k for ks in xc.store_kinds(placed, m.cfg).values() for k in ks} == {"pinned_host"}
  assert {k for ks in xc.store_kinds(m.params, m.cfg).values() for k in ks} == {"device"}   # m.params untouched
  assert generate(m, prompt, eager=True, **kw).ids == base.ids
  if jax.devices()[0].platform == "cpu":                       # default kind on CPU: no placement
    assert engine.request_params(m, GenConfig(expert_slots=K)) is m.params
  # the speculative path runs on the same placed store and emits the plain greedy tokens
  from decode import speculative
  n_spec = speculative.spec_loop._cache_size()
  r = speculative.speculative_generate(m, prompt, drafter="replay", k=3, replay_ids=base.ids, **kw)
  assert r.ids == base.ids and r.stats["acceptance"] == 1.0
  assert r.stats["expert_cache"]["store_memory_kind"] == "pinned_host"
  assert speculative.spec_loop._cache_size() - n_spec <= 1


@pytest.mark.skipif("pinned_host" not in {mem.kind for mem in jax.devices()[0].addressable_memories()},
                    reason="no pinned_host memory kind on this backend")
def test_loader_puts_the_store_in_host_memory_as_it_loads():
  """load_model(expert_store="pinned_host") places each routed-expert tensor as it is built: every store array
  is in pinned host memory, nothing else moved, no device-memory copy of the store stays alive, and decoding
  with N slots gives the tokens of every expert resident. place_store(..., "device") brings the store back."""
  import gc
  path = model_path("qwen3moe", "IQ3_S")
  base = _m("qwen3moe", "IQ3_S")
  gc.collect()
  dev_bytes = lambda: sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind in (None, "device"))  # noqa: E731
  before = dev_bytes()
  m = load_model(path, expert_store="pinned_host")
  assert {k for ks in xc.store_kinds(m.params, m.cfg).values() for k in ks} == {"pinned_host"}
  store = sum(p.nbytes for i in xc.expert_blocks(m.cfg) for n in ("gate_exps", "up_exps", "down_exps")
              for p in xc._planes(xc._block_ffn(m.params, m.cfg, i)[n]))
  total = sum(x.nbytes for x in jax.tree.leaves(m.params))
  gc.collect()
  assert dev_bytes() - before == total - store                   # the device holds the model minus its store
  prompt = [int(t) for t in np.random.default_rng(5).integers(0, 1000, 30)]
  want = generate(base, prompt, max_new_tokens=8, stop_at_eos=False).ids
  got = generate(m, prompt, max_new_tokens=8, stop_at_eos=False, expert_slots=m.cfg.top_k)
  assert got.ids == want and got.stats["expert_cache"]["store_memory_kind"] == "pinned_host"
  back = xc.place_store(m.params, m.cfg, "device")
  assert {k for ks in xc.store_kinds(back, m.cfg).values() for k in ks} == {"device"}
  assert generate(dataclasses.replace(m, params=back), prompt, max_new_tokens=8, stop_at_eos=False).ids == want


def test_plan_workspace_covers_the_grouped_gemm_buffers():
  """A 1,024-token prefill call's plan holds the grouped expert GEMM's buffers at their static bound (the NT*M
  rows of ops.moe.tile_layout for ops.moe_grouped_pallas.tile_rows): gathered x and its output, the pair
  outputs; a cached plan's 8-token chunk needs none of it."""
  import jax.numpy as jnp
  from configs.presets import QWEN3MOE_30B_A3B as cfg
  from decode.kv_plan import make_plan
  from ops import moe_grouped_pallas
  from ops.moe import tile_layout
  T = 1024
  M = moe_grouped_pallas.tile_rows(T * cfg.top_k, cfg.n_experts)
  NT = tile_layout(jnp.zeros((T, cfg.top_k), jnp.int32), cfg.n_experts, M)[0]
  grouped = NT * M * 4 * (3 * cfg.d_model + cfg.d_ff_expert) + T * cfg.top_k * 4 * cfg.d_model
  ws = lambda chunk: make_plan(cfg, weight_bytes=1 << 30, ring=4096, prefill_chunk=chunk).get("workspace")  # noqa: E731
  assert ws(T) - ws(8) >= grouped


def test_cached_plan_counts_the_streamed_blocks_before_the_slots():
  """With slots, a prefill chunk routing more (token, expert) pairs than a block has experts runs the direct path,
  which moves each MoE block's experts from the store whole: the plan holds two blocks' experts ("streamed
  experts", phase "prefill"). The engine runs those chunks before it allocates the slots, so the device holds the
  larger of the two, not both, and `auto` sizes the slots from what the other items leave. A chunk within the
  experts (chunk x top-k <= E) streams nothing, and an all-resident plan never does. On the seed-mtp shape: 2 of
  49 blocks (48 trunk, 1 NextN)."""
  from configs.presets import QWEN3NEXT_80B_A3B as cfg
  from decode.kv_plan import GiB, make_plan
  kw = dict(weight_bytes=36 * GiB, expert_bytes=34 * GiB, ring=32768, kv="int8", budget=24 * GiB)
  fits = cfg.n_experts // cfg.top_k                                  # 51 x 10 <= 512
  block2 = 2 * -(-34 * GiB // len(xc.expert_blocks(cfg)))
  big = make_plan(cfg, **kw, expert_cache_bytes=20 * GiB, prefill_chunk=1024)
  assert big.get("streamed experts") == block2 and len(xc.expert_blocks(cfg)) == 49
  assert big.device_bytes == big.steady_bytes and big.steady_bytes == sum(
      i.bytes for i in big.items if i.where == "device" and i.name != "streamed experts")
  few = make_plan(cfg, **kw, expert_cache_bytes=block2 // 3, prefill_chunk=1024)   # slots smaller than the blocks
  assert few.device_bytes == few.steady_bytes - block2 // 3 + block2
  assert "| streamed experts |  | device (prefill) |" in big.table()
  assert make_plan(cfg, **kw, expert_cache_bytes=20 * GiB, prefill_chunk=fits).get("streamed experts") == 0
  assert make_plan(cfg, **kw, prefill_chunk=1024).get("streamed experts") == 0             # all resident
  assert make_plan(cfg, **kw, expert_cache_bytes=20 * GiB, prefill_chunk=fits + 1).get("streamed experts") > 0


def test_auto_slots_take_the_streamed_blocks_memory():
  """--expert_cache auto with streaming prefill chunks: the slots fill what the steady items leave of the budget
  (the streamed blocks live before them and take none of it)."""
  from decode.kv_plan import plan_request
  m = _m("qwen3next", "IQ3_S")                 # 5 MoE blocks: two streamed blocks are 2 / 5 of the experts
  E, K = m.cfg.n_experts, m.cfg.top_k
  kw = dict(ring=1024, kv="int8", max_context=None, mtp_window=None, k=0, expert_cache="auto")
  slab = max(xc.slab_bytes(m.params, m.cfg).values())
  total = len(xc.expert_blocks(m.cfg)) * E
  everything = plan_request(m, **kw, prefill_chunk=E // K + 1, budget=None)[0].device_bytes    # all resident
  budget = everything - (total // 2) * slab
  plan, slots = plan_request(m, **kw, prefill_chunk=E // K + 1, budget=budget)
  assert plan.get("streamed experts") > 0 and m.cfg.top_k <= slots < total
  assert slots * slab >= plan.get("streamed experts")              # the streamed blocks fit inside the slots' memory
  assert slots == (budget - (plan.steady_bytes - slots * slab)) // slab
  assert plan.device_bytes == plan.steady_bytes <= budget and plan.free < slab


@pytest.mark.skipif("pinned_host" not in {mem.kind for mem in jax.devices()[0].addressable_memories()},
                    reason="no pinned_host memory kind on this backend")
def test_a_host_store_moves_after_its_blocks_input():
  """to_device(w, after=x) on a store in pinned host memory: the planes come back bitwise, moved as two slices whose
  offset passes through an optimization barrier with x (what keeps XLA from hoisting every block's copy to the
  program's start: on the H200 a chain of 8 blocks held 1,025 MiB of copies without it, 129 MiB, one block, with
  it: docs/PERF.md); without `after`, or on the device, a plain move."""
  m = _m("qwen3moe", "IQ3_S")
  host = xc.place_store(m.params, m.cfg, "pinned_host")
  w = host["blk_0"]["ffn"]["gate_exps"]
  x = jnp.ones((4, m.cfg.d_model), jnp.float32)
  got = jax.jit(lambda w, x: xc.to_device(w, after=x))(w, x)
  for a, b in zip(got.planes, m.params["blk_0"]["ffn"]["gate_exps"].planes):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  text = str(jax.make_jaxpr(lambda w, x: xc.to_device(w, after=x))(w, x))
  n = len(w.planes)
  assert text.count("optimization_barrier") == n and text.count("dynamic_slice") == 2 * n
  plain = str(jax.make_jaxpr(lambda w: xc.to_device(w))(w))
  assert "optimization_barrier" not in plain and "dynamic_slice" not in plain
  dev = m.params["blk_0"]["ffn"]["gate_exps"]
  assert "optimization_barrier" not in str(jax.make_jaxpr(lambda w, x: xc.to_device(w, after=x))(dev, x))


def test_streamed_prefill_runs_before_the_slots_exist(monkeypatch):
  """A prompt of two streaming chunks (T * top_k > E) and a 3-token tail: the chunks run with no expert cache in
  the state (it is allocated after them), the tail through the slots; tokens equal every expert resident, and the
  cache's prefill counters are the tail's (3 tokens x top_k per trunk MoE block)."""
  m = _m("qwen3moe", "IQ3_S")
  E, K = m.cfg.n_experts, m.cfg.top_k
  chunk = E // K + 2
  monkeypatch.setattr(engine, "PREFILL_CHUNK", chunk)
  prompt = [int(t) for t in np.random.default_rng(7).integers(0, 1000, 2 * chunk + 3)]
  base = generate(m, prompt, max_new_tokens=8, stop_at_eos=False)
  seen, prefill = [], api.prefill

  def spy(params, tokens, state, **kw):
    seen.append((int(tokens.shape[0]), state.experts is None))
    return prefill(params, tokens, state, **kw)
  monkeypatch.setattr(api, "prefill", spy)
  got = generate(m, prompt, max_new_tokens=8, stop_at_eos=False, expert_slots=K + 1)
  assert got.ids == base.ids
  assert seen == [(chunk, True), (chunk, True), (3, False)]
  trunk_moe = [b for b in xc.expert_blocks(m.cfg) if b < m.cfg.n_layers]
  pre = got.stats["expert_cache"]["prefill"]
  assert pre["hits"] + pre["misses"] == 3 * K * len(trunk_moe) and pre["misses"] > 0


def test_a_prompt_that_streams_whole_shares_its_prefill_under_slots(monkeypatch):
  """With expert slots the prefill cache keeps a prompt whose every chunk streams the experts (no tail through the
  slots): a second request, plain or speculative, reuses it with empty slots, and its tokens are every expert
  resident's; a prompt with a tail through the slots (which would leave them warm) is never cached."""
  from bench.prefill_cache import PrefillCache
  m = _m("qwen3moe", "IQ3_S")
  E, K = m.cfg.n_experts, m.cfg.top_k
  chunk = E // K + 2
  monkeypatch.setattr(engine, "PREFILL_CHUNK", chunk)
  rng = np.random.default_rng(9)
  whole = [int(t) for t in rng.integers(0, 1000, 2 * chunk)]
  tailed = whole + [5, 6, 7]
  for prompt, cached in ((whole, True), (tailed, False)):
    base = generate(m, prompt, max_new_tokens=8, stop_at_eos=False)
    cache = PrefillCache()
    gen = GenConfig(max_new_tokens=8, stop_at_eos=False, expert_slots=K + 1, kv_resident=256)
    first = generate(m, prompt, gen, prefill_cache=cache)
    again = generate(m, prompt, gen, prefill_cache=cache)
    spec = speculative_generate(m, prompt, gen, drafter="replay", k=2, replay_ids=base.ids, prefill_cache=cache)
    assert first.ids == again.ids == spec.ids == base.ids and spec.stats["acceptance"] == 1.0
    assert not first.stats["prefill_reused"] and again.stats["prefill_reused"] == cached
    assert len(cache) == (2 if cached else 0)       # without a tier the plain and k = 2 rings keep other scratch
    if cached:                         # the reused request starts with empty slots: its decode misses as the first's
      assert again.stats["expert_cache"]["decode"] == first.stats["expert_cache"]["decode"]
