"""The hybrid family's model (qwen3next, qwen35moe: Gated DeltaNet layers beside gated attention) on the tiny files
our writer makes, against its references:
- the float64 numpy forward (tests/ref_hybrid.py, itself checked against llama.cpp in test_hybrid_files.py):
  prefill and token-by-token decode, trunk and NextN block, rel L2 <= 1e-3 (measured ~1e-6);
- llama.cpp's logits (llama-cpp-python): F16 file at llama.cpp's defaults <= 5e-3 with argmax equal outside
  near-ties; 32 greedy tokens equal llama.cpp's; llama.cpp-quantized mixes: equal to the float64 forward of
  the same file, and at its distance from llama.cpp (see test_quantized_mixes_match_llama_cpp);
- a prompt of 3 chunks + 5 tokens in one prefill call equals it decoded token by token;
- capacity invariance: rings of 256 and 1024 slots give bitwise equal logits (only attention layers are in it);
- the Pallas kernels (interpret mode) equal the jnp references inside the model.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from decode.engine import generate
from model import api
from model.deltanet import CHUNK
from model.loader import load_model
from ops import gated_delta as gd
from ops.qtensor import with_kernels
from tests.model.test_ref_forward import TOL_F16, _compare
from tests.models import MIXES, model_path
from tests.ref_hybrid import HybridRefModel
from tools import llama_ref

ARCHS = ("qwen3next", "qwen35moe")


def _tokens(n: int = 24, seed: int = 1) -> list[int]:
  return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, size=n)]


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _prefill(m, toks, cap=256, kv="f32"):
  st = api.init_state(m.cfg, cap, kv)
  return api.prefill(m.params, jnp.asarray(toks, jnp.int32), st, cfg=m.cfg)


def _steps(m, toks, cap=256, kv="f32", state=None):
  st = api.init_state(m.cfg, cap, kv) if state is None else state
  out = []
  for t in toks:
    lg, _, st = api.decode_step(m.params, jnp.int32(t), st, cfg=m.cfg)
    out.append(np.asarray(lg))
  return np.stack(out), st


@pytest.mark.parametrize("arch", ARCHS)
def test_trunk_and_nextn_match_the_float64_forward(arch):
  path = model_path(arch, "F32")
  m, ref = load_model(path), HybridRefModel(path)
  toks = _tokens()
  want, want_h = ref.forward(toks)
  lg, h, st = _prefill(m, toks)
  assert st.recurrent is not None and len(st.recurrent.conv) == len(m.cfg.recurrent_layers)
  assert st.ring.n_layers == len(m.cfg.attention_layers) < m.cfg.n_layers
  rel_p, rel_s = _rel(lg, want), _rel(_steps(m, toks)[0], want)
  print(f"\n{arch}: prefill rel L2 {rel_p:.2e}, steps {rel_s:.2e}")
  assert rel_p <= 1e-3 and rel_s <= 1e-3
  np.testing.assert_array_equal(np.argmax(np.asarray(lg), -1), np.argmax(want, -1))
  # NextN block: entry j pairs the hidden state at j with token j + 1, at position j + 1
  ring = api.init_state(m.cfg, 256, "f32", mtp_window=256).mtp_ring
  mlg, mh, _ = api.mtp_step(m.params, h[:-1], jnp.asarray(toks[1:], jnp.int32), ring, cfg=m.cfg)
  mwant, mhwant = ref.mtp_forward(want_h[:-1], toks[1:], start_pos=1)
  print(f"{arch}: NextN rel L2 {_rel(mlg, mwant):.2e}")
  assert _rel(mlg, mwant) <= 1e-3 and _rel(mh, mhwant) <= 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_tokens_match_llama_cpp_f16(arch):
  path = model_path(arch, "F16")
  m = load_model(path)
  toks = _tokens()
  lg, _, _ = _prefill(m, toks)
  _compare(f"{arch} F16, ours vs llama.cpp", np.asarray(lg), llama_ref.logits(path, toks), TOL_F16,
           strict_argmax=False)
  prompt = toks[:8]
  ours = generate(m, prompt, max_new_tokens=32, stop_at_eos=False, kv="f32").ids
  assert ours == llama_ref.greedy(path, prompt, 32)


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_mixes_match_llama_cpp(arch, mix):
  """llama.cpp-quantized files: ours equals the float64 forward of the same dequantized weights (rel L2 <= 1e-3,
  measured ~1.5e-6; argmax equal at every position), and sits at that forward's own distance from llama.cpp,
  whose CPU matmuls quantize the activations to 8 bits. On these tiny random hybrid files that distance is
  3e-2 .. 1e-1 (Q4_K_M of qwen35moe the largest: the recurrent state carries the rounding along the sequence),
  above the 5e-2 the attention-only archs meet; the bound here is the exact forward's distance, not a loosened
  one of ours."""
  path = model_path(arch, mix)
  m, ref = load_model(path), HybridRefModel(path)
  toks = _tokens(32, seed=2)
  got, want, lc = np.asarray(_prefill(m, toks)[0]), ref.forward(toks)[0], llama_ref.logits(path, toks)
  agree = float(np.mean(np.argmax(got, -1) == np.argmax(lc, -1)))
  print(f"\n{arch} {mix}: ours vs float64 {_rel(got, want):.1e}; vs llama.cpp {_rel(got, lc):.2e} (float64 forward "
        f"{_rel(want, lc):.2e}), argmax agreement {agree:.0%}")
  assert _rel(got, want) <= 1e-3
  np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))
  assert abs(_rel(got, lc) - _rel(want, lc)) <= 1e-3
  assert _rel(got, lc) <= 0.15 and agree >= 0.75       # a gross-error floor against the other engine


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_token_by_token(arch):
  """3 chunks of the chunked delta rule and a ragged 5-token tail in one call, against the same prompt decoded one
  token at a time (the fused step form), and the states both leave."""
  m = load_model(model_path(arch, "F32"))
  toks = _tokens(3 * CHUNK + 5, seed=3)
  lg, _, st = _prefill(m, toks)
  steps, st1 = _steps(m, toks)
  print(f"\n{arch}: chunked prefill vs steps rel L2 {_rel(lg, steps):.2e}")
  assert _rel(lg, steps) <= 1e-5
  np.testing.assert_array_equal(np.argmax(np.asarray(lg), -1), np.argmax(steps, -1))
  for a, b in zip(st.recurrent.delta + st.recurrent.conv, st1.recurrent.delta + st1.recurrent.conv):
    assert _rel(a, b) <= 1e-5


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_ring_capacity_changes_no_bit(kv):
  m = load_model(model_path("qwen3next", "F16"))
  toks = _tokens(40, seed=4)
  out = []
  for cap in (256, 1024):
    lg, _, st = _prefill(m, toks[:30], cap, kv)
    steps, _ = _steps(m, toks[30:], cap, kv, state=st)
    out.append(np.concatenate([np.asarray(lg), steps]))
  np.testing.assert_array_equal(out[0], out[1])


def test_kernels_in_interpret_mode_equal_the_references(monkeypatch):
  """The model with every kernel in Pallas interpret mode (the DeltaNet chunk and step kernels among them) against
  the same model on the jnp references: a 20-token prefill (chunk kernel) and 4 steps (step kernel)."""
  m = load_model(model_path("qwen3next", "Q8_0"))           # packed weights: what selects the kernels
  toks = _tokens(24, seed=5)
  ref_p, _, st = _prefill(m, toks[:20])
  ref_s, _ = _steps(m, toks[20:], state=st)
  m.params = with_kernels(m.params, "interpret")
  calls = []
  for name in ("gated_delta_chunk_pallas", "gated_delta_step_pallas"):
    mod = getattr(gd, name)
    real = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **kw: calls.append(_n) or _real(*a, **kw))
  got_p, _, st = _prefill(m, toks[:20])
  got_s, _ = _steps(m, toks[20:], state=st)
  print(f"\ninterpret vs reference: prefill {_rel(got_p, ref_p):.2e}, steps {_rel(got_s, ref_s):.2e}")
  assert set(calls) == {"gated_delta_chunk_pallas", "gated_delta_step_pallas"}
  assert _rel(got_p, ref_p) <= 1e-4 and _rel(got_s, ref_s) <= 1e-4     # every kernel of the model sums in its own order
