"""Expert cache (issue 6): outputs bitwise equal to every-expert-resident for any N >= top_k, and the miss
counts of its LRU policy equal an independent simulation over the routing of the float64 reference."""
from __future__ import annotations

import functools
from collections import OrderedDict

import jax.numpy as jnp
import numpy as np
import pytest

from decode import expert_cache as xc
from decode.engine import generate
from decode.speculative import speculative_generate
from model import api
from model.loader import load_model
from tests.models import model_path
from tests.ref_forward import RefModel, rms_norm

STEPS = 12


@functools.lru_cache(maxsize=None)
def _m(arch, kind):
  return load_model(model_path(arch, kind))


def _decode(m, slots, policy="lru", n_prompt=20):
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 1000, n_prompt), jnp.int32)
  st = api.init_state(m.cfg, 1024, "bf16")
  if slots is not None:
    st = st.replace(experts=xc.create(m.params, m.cfg, slots, policy))
  lg, _, st = api.prefill(m.params, toks, st, cfg=m.cfg)
  out, t, seq = [np.asarray(lg)], jnp.argmax(lg[-1]), list(np.asarray(toks))
  for _ in range(STEPS):
    seq.append(int(t))
    l, _, st = api.decode_step(m.params, t, st, cfg=m.cfg)
    out.append(np.asarray(l)[None])
    t = jnp.argmax(l)
  return np.concatenate(out), st, seq


@pytest.mark.parametrize("arch,kind,policy", [("glm4moe", "IQ3_S", "lru"), ("qwen3moe", "Q4_K_M", "lfu"),
                                               ("glm4moe", "F16", "lfu")])
def test_logits_bitwise_equal_to_all_resident(arch, kind, policy):
  m = _m(arch, kind)
  ref, _, _ = _decode(m, None)
  for slots in (m.cfg.top_k, 4 * m.cfg.n_experts):
    got, st, _ = _decode(m, slots, policy)
    np.testing.assert_array_equal(got, ref, err_msg=f"{arch} {kind} {policy} N={slots}")
    s = st.experts.stats()
    moe_blocks = [i for i in range(m.cfg.n_layers) if m.cfg.is_moe_layer(i)]
    for b in moe_blocks:    # each decode step routes top_k experts per MoE block through the cache
      assert s["hits"][b] + s["misses"][b] == STEPS * m.cfg.top_k
    assert sum(s["misses"]) > 0 and s["bytes_moved"][moe_blocks[0]] > 0


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
