"""Speculative decoding over a hybrid model's recurrent layers (qwen3next, qwen35moe tiny files): a verify pass of
k + 1 tokens moves every Gated DeltaNet layer's state k + 1 steps, and the round must leave exactly the state that
plain decoding of the accepted tokens leaves (a ring masks rejected positions; a recurrent state cannot). Checked
against plain greedy decoding: the same tokens for NextN, lookup and replay drafts, k = 1..4 (and 6: a verify in two
passes, decode.speculative.VERIFY_ROWS), bf16 and int8 KV, two ring capacities and a host tier; replay accepts every
draft; acceptance is the same across ring capacities."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from decode.engine import generate
from decode.speculative import speculative_generate
from model.loader import load_model
from tests.models import model_path

N_NEW = 24


@functools.lru_cache(maxsize=2)
def _model(arch: str):
  return load_model(model_path(arch, "F16"))


def _prompt(n: int = 20, seed: int = 3) -> list[int]:
  # a repeating motif, so lookup drafts find matches and some of them are accepted
  motif = [int(t) for t in np.random.default_rng(seed).integers(0, 1000, 6)]
  return (motif * (n // len(motif) + 1))[:n]


@functools.lru_cache(maxsize=8)
def _plain(arch: str, kv: str, n: int = N_NEW) -> tuple[int, ...]:
  return tuple(generate(_model(arch), _prompt(), max_new_tokens=n, stop_at_eos=False, kv=kv,
                        kv_resident=1024).ids)


def _corrupt(ids: list[int], every: int = 3) -> list[int]:
  """A replay continuation wrong at every `every`-th token: rounds accept a prefix, then reject the rest."""
  return [(t + 1) % 1000 if i % every == every - 1 else t for i, t in enumerate(ids)]


@pytest.mark.parametrize("arch,drafter,k,kv", [
    ("qwen3next", "partial", 3, "int8"), ("qwen3next", "partial", 4, "bf16"), ("qwen35moe", "partial", 2, "bf16"),
    ("qwen3next", "replay", 1, "bf16"), ("qwen35moe", "replay", 4, "int8"), ("qwen3next", "mtp", 3, "bf16"),
    ("qwen35moe", "mtp", 1, "int8"), ("qwen35moe", "lookup", 3, "int8"), ("qwen3next", "partial", 6, "int8"),
    ("qwen35moe", "replay", 6, "bf16")])
def test_greedy_speculative_equals_plain_greedy(arch, drafter, k, kv):
  """"partial": replay drafts that are wrong at every third token, so rounds accept a prefix and reject the rest,
  the case where the recurrent state must be rolled back to the middle of the verify pass."""
  plain = list(_plain(arch, kv))
  replay = {"replay": plain, "partial": _corrupt(plain)}.get(drafter)
  kw = dict(drafter="replay" if replay else drafter, k=k, max_new_tokens=N_NEW, stop_at_eos=False, kv=kv,
            mtp_window=256, replay_ids=replay)
  runs = {cap: speculative_generate(_model(arch), _prompt(), kv_resident=cap, **kw) for cap in (256, 1024)}
  for cap, r in runs.items():
    assert r.ids == plain, (cap, r.ids, plain)
  acc, prop = runs[256].stats["drafts_accepted"], runs[256].stats["drafts_proposed"]
  assert runs[1024].stats["drafts_accepted"] == acc
  if drafter == "replay":
    assert acc == prop and sum(prop) > 0
  if drafter == "partial":
    assert 0 < sum(acc) < sum(prop)
  print(f"\n{arch} {drafter} k={k} {kv}: accepted {acc} of {prop} per draft position")


@pytest.mark.parametrize("drafter", ["partial", "lookup"])
def test_speculative_with_a_host_tier_equals_plain_greedy(drafter):
  """A 256-slot ring under max_context 1024 with a 300-token prompt: the attention layers' old positions live in
  the host tier while the DeltaNet layers' state rolls back each round."""
  m = _model("qwen3next")
  prompt = _prompt(300, seed=5)
  plain = generate(m, prompt, max_new_tokens=16, stop_at_eos=False, kv="int8", kv_resident=1024).ids
  r = speculative_generate(m, prompt, drafter="replay" if drafter == "partial" else drafter, k=3, max_new_tokens=16,
                           stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024,
                           replay_ids=_corrupt(plain) if drafter == "partial" else None)
  assert r.ids == plain


def test_sampled_verification_with_rollback_equals_greedy_under_a_one_token_nucleus():
  """The sampled path (drafts and targets as distributions, rejection-sampling verification, the rollback of the
  recurrent state by the accepted length): with a nucleus that keeps only the top token both distributions are
  one-hot, so the emitted tokens must be plain greedy decoding's, with partial acceptance on the way."""
  m = _model("qwen35moe")
  plain = list(_plain("qwen35moe", "bf16"))
  r = speculative_generate(m, _prompt(), drafter="replay", k=3, max_new_tokens=N_NEW, stop_at_eos=False, kv="bf16",
                           kv_resident=1024, temperature=0.7, top_p=1e-6, seed=3, replay_ids=_corrupt(plain))
  assert r.ids == plain
  assert 0 < sum(r.stats["drafts_accepted"]) < sum(r.stats["drafts_proposed"])


def test_rounds_beside_a_tier_read_in_spans_on_the_kernels_equal_plain_greedy(monkeypatch):
  """Attention on the decode kernel (interpret mode) beside a host tier read in spans of 512 positions and blocks
  of 256 (Tunings.tier_span, tier_block): the verify passes' rows cross the tier's first span boundary (positions
  ~760 of a 740-token prompt on a 256-slot ring), where rows of one pass take the tier in different pieces. Replay
  drafts wrong at every third token (the DeltaNet state rolls back to the middle of passes) emit plain greedy
  decoding's tokens on the same kernels and tier."""
  from model.options import Options
  from ops import attention_pallas
  from ops.tuning import Tunings
  real, pieces = attention_pallas.ring_attention_pallas, set()
  monkeypatch.setattr(attention_pallas, "ring_attention_pallas",
                      lambda *a, **kw: pieces.add(a[1].shape[0]) or real(*a, **kw))
  m = _model("qwen3next")
  prompt = _prompt(740, seed=6)
  kw = dict(max_new_tokens=32, stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024,
            options=Options(tunings=Tunings(attention_impl="interpret", tier_block=256, tier_span=512)))
  plain = generate(m, prompt, **kw).ids
  r = speculative_generate(m, prompt, drafter="replay", k=3, replay_ids=_corrupt(plain), **kw)
  assert r.ids == plain
  assert 0 < sum(r.stats["drafts_accepted"]) < sum(r.stats["drafts_proposed"])
  assert 512 in pieces, pieces                  # the tier's spans ran through the kernel


def test_rounds_with_the_launch_fusions_equal_plain_greedy():
  """Every launch fusion on (Tunings.fuse: the residual stream in pieces, the norm making the router's and the
  shared expert's gate logits, gate/up routing for itself, the DeltaNet norm's gate) over the kernels in interpret
  mode: replay drafts wrong at every third token emit plain greedy decoding's tokens under the same options."""
  import dataclasses
  from model.options import Options
  from ops.qtensor import with_kernels
  from ops.tuning import FUSIONS, Tunings
  m = load_model(model_path("qwen3next", "IQ3_S"))
  m = dataclasses.replace(m, params=with_kernels(m.params, "interpret"))
  kw = dict(max_new_tokens=10, stop_at_eos=False, kv="int8", kv_resident=256,
            options=Options(tunings=Tunings(fuse=FUSIONS, attention_impl="interpret")))
  plain = generate(m, _prompt(), **kw).ids
  r = speculative_generate(m, _prompt(), drafter="replay", k=3, replay_ids=_corrupt(plain), **kw)
  assert r.ids == plain
  assert 0 < sum(r.stats["drafts_accepted"]) < sum(r.stats["drafts_proposed"])


def test_rounds_with_the_rope_fold_beside_a_tier_equal_plain_greedy(monkeypatch):
  """Tunings.fuse "rope" (RoPE and the ring write inside the attention kernel, ops.rope_attention_pallas) on the
  Q8_0 file (fused q/k/v) in interpret mode, a 256-slot ring with a host tier behind it (the kernel also hands q
  to the tier's attention): replay drafts wrong at every third token emit plain greedy decoding's tokens."""
  import dataclasses
  from model.options import Options
  from ops import rope_attention_pallas
  from ops.qtensor import with_kernels
  from ops.tuning import Tunings
  real, seen = rope_attention_pallas.rope_attention_pallas, set()
  monkeypatch.setattr(rope_attention_pallas, "rope_attention_pallas",
                      lambda *a, **kw: seen.add((a[0].shape[0], kw["with_q"])) or real(*a, **kw))
  m = load_model(model_path("qwen3next", "Q8_0"))
  m = dataclasses.replace(m, params=with_kernels(m.params, "interpret"))
  prompt = _prompt(300, seed=5)
  kw = dict(max_new_tokens=8, stop_at_eos=False, kv="int8", kv_resident=256, max_context=1024,
            options=Options(tunings=Tunings(fuse=("rope",), attention_impl="interpret")))
  plain = generate(m, prompt, **kw).ids
  r = speculative_generate(m, prompt, drafter="replay", k=3, replay_ids=_corrupt(plain), **kw)
  assert r.ids == plain
  assert 0 < sum(r.stats["drafts_accepted"]) < sum(r.stats["drafts_proposed"])
  assert {(1, True), (4, True)} <= seen, seen            # steps and verify passes, beside the tier


def test_a_long_verify_runs_in_passes_of_verify_rows(monkeypatch):
  """k = 6: the 7 verify tokens go through the trunk as passes of 4 and 3 (decode.speculative.VERIFY_ROWS, the
  rows the GPU kernels keep batch invariant), and the joined outputs are one 7-token pass's: logits and hidden
  within float32 summation order, the per-token recurrent states after each token alike, and the state after token
  5 the state a 6-token pass leaves."""
  import jax
  import jax.numpy as jnp
  from decode import speculative as sp
  from model import api
  m = _model("qwen3next")
  toks = jnp.asarray(_prompt(27), jnp.int32)
  _, _, st = api.prefill(m.params, toks[:20], api.init_state(m.cfg, 256, "bf16", scratch=8), cfg=m.cfg)
  seen, real = [], api.forward
  monkeypatch.setattr(api, "forward", lambda p, t, *a, **kw: seen.append(t.shape[0]) or real(p, t, *a, **kw))
  lg, h, _, kept = sp.verify_pass(m.params, toks[20:], jax.tree.map(jnp.copy, st), cfg=m.cfg)
  monkeypatch.setattr(api, "forward", real)
  assert seen == [4, 3]
  lg1, h1, _, kept1 = api.forward(m.params, toks[20:], jax.tree.map(jnp.copy, st), cfg=m.cfg, keep_states=True)
  scale = float(jnp.abs(lg1).max())
  np.testing.assert_allclose(np.asarray(lg), np.asarray(lg1), rtol=0, atol=1e-4 * scale)
  np.testing.assert_allclose(np.asarray(h), np.asarray(h1), rtol=0, atol=1e-4 * float(jnp.abs(h1).max()))
  assert len(kept) == len(kept1) == len(m.cfg.recurrent_layers)
  for a, b in zip(kept, kept1):
    assert a.delta_T.shape == b.delta_T.shape and a.delta_T.shape[0] == 7
    np.testing.assert_allclose(np.asarray(a.delta_T), np.asarray(b.delta_T), rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(a.conv_T, np.float32), np.asarray(b.conv_T, np.float32), rtol=0, atol=1e-4)
  _, _, six = api.forward(m.params, toks[20:26], jax.tree.map(jnp.copy, st), cfg=m.cfg)
  sel = api.select_recurrent(st, kept, 5).recurrent
  for a, b in zip(sel.delta, six.recurrent.delta):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)
