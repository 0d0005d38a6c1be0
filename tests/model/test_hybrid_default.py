"""The shipped hybrid model, configs/data/hybrid.gguf (a qwen3next + NextN model trained by tools/train_hybrid.py).

Checks the file (size, qwen3next with Gated DeltaNet and attention layers 3:1 and one NextN block, the training
script's shape), its held-out MTP acceptance at k = 1 (on every held-out pydoc chunk in 512-token windows, never
trained on, teacher-forced through model.loader and model.api: the fraction of positions j where argmax(MTP
logits_j) == argmax(main logits_(j+1)), i.e. where the greedy draft would be accepted), that its greedy
continuations equal llama.cpp's on the same file token for token, that speculative greedy with its NextN drafts
equals plain greedy with drafts really accepted, and that `decode.generate --gguf` runs it. Measured values are
printed (pytest -s shows them).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from decode.engine import generate
from decode.speculative import speculative_generate
from model.loader import load_model
from tools import llama_ref
from tools import train_default as td
from tools import train_hybrid as th

PATH = str(td.DATA_DIR / "hybrid.gguf")
ROOT = str(td.REPO)
MAX_BYTES = 20 * 1000 * 1000
SLICE_LEN = 512     # every held-out chunk, cut into windows of 512 tokens (as the card's table)
N_GREEDY = 48


@functools.lru_cache(maxsize=None)
def _model():
  if not os.path.isfile(PATH):
    pytest.fail(f"{PATH} is missing: run `nice -n 10 python -m tools.train_hybrid`")
  return load_model(PATH)


@functools.lru_cache(maxsize=None)
def _plain(prompt: str) -> tuple[int, ...]:
  m = _model()
  return tuple(generate(m, m.tokenizer.encode(prompt), max_new_tokens=N_GREEDY, kv="f32", stop_at_eos=False).ids)


def test_file_is_shipped_and_small():
  assert os.path.isfile(PATH), f"{PATH} is missing: run `nice -n 10 python -m tools.train_hybrid`"
  size = os.path.getsize(PATH)
  print(f"\n{PATH}: {size / 1e6:.2f} MB")
  assert size <= MAX_BYTES


def test_config_is_the_training_scripts_qwen3next_shape():
  cfg = _model().cfg
  print(f"\n{cfg}")
  # GGUF stores the norm epsilon as a float32
  assert dataclasses.replace(cfg, rms_eps=th.HYBRID_CFG.rms_eps) == th.HYBRID_CFG
  assert cfg.rms_eps == float(np.float32(th.HYBRID_CFG.rms_eps))
  assert cfg.arch == "qwen3next" and cfg.n_nextn == 1
  assert cfg.recurrent_layers == (0, 1, 2) and cfg.attention_layers == (3,)
  assert cfg.vocab_size == _model().tokenizer.vocab_size
  types = collections.Counter(t.tensor_type.name for t in __import__("gguf").GGUFReader(PATH).tensors)
  print(f"tensor types: {dict(types)}")
  params = _model().params
  assert "mtp_0" in params and "eh_proj" in params["mtp_0"] and "gdn" in params["blk_0"]


def test_heldout_mtp_acceptance_k1():
  wins = td.heldout_windows(SLICE_LEN)
  assert wins.shape[1] == SLICE_LEN and wins.size >= 4096
  m = td.gguf_metrics(_model(), wins)
  print(f"\nheld-out ({m['positions']} positions): main loss {m['main_loss']:.3f}, MTP loss {m['mtp_loss']:.3f}, "
        f"k=1 MTP acceptance {m['acceptance_k1']:.1%}")
  assert m["acceptance_k1"] >= 0.6
  assert m["main_loss"] < 4.0


@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K_M", "Q6_K", "IQ3_S"])
def test_quantized_mixes_match_llama_cpp(mix, tmp_path):
  """The shipped file quantized by llama.cpp's quantizer, on a 128-token held-out window: our logits against
  llama.cpp's on the same file within issue 25's bound for mixes (rel L2 <= 5e-2, argmax equal at >= 90 % of
  positions). The tiny random hybrid files cannot show it (there the exact float64 forward itself is 3e-2 .. 1e-1
  from llama.cpp: test_hybrid_model.py); on this trained model the recurrent state does not amplify the rounding
  of llama.cpp's 8-bit activations as much (measured 1.3e-2 .. 3.2e-2, argmax 96-99 %)."""
  import jax.numpy as jnp

  from model import api
  path = str(tmp_path / f"hybrid-{mix}.gguf")
  llama_ref.quantize(PATH, path, mix)
  m = load_model(path)
  toks = [int(t) for t in td.heldout_windows(128)[1]]
  got = np.asarray(api.prefill(m.params, jnp.asarray(toks, jnp.int32), api.init_state(m.cfg, 256, "f32"),
                               cfg=m.cfg)[0], np.float64)
  lc = np.asarray(llama_ref.logits(path, toks), np.float64)
  rel = float(np.linalg.norm(got - lc) / np.linalg.norm(lc))
  agree = float(np.mean(got.argmax(-1) == lc.argmax(-1)))
  print(f"\n{mix}: rel L2 {rel:.2e} from llama.cpp, argmax agreement {agree:.1%}")
  assert rel <= 5e-2 and agree >= 0.9


@pytest.mark.parametrize("prompt", th.PROMPTS)
def test_greedy_continuations_equal_llama_cpp(prompt):
  m = _model()
  ids = m.tokenizer.encode(prompt)
  ours = list(_plain(prompt))
  theirs = llama_ref.greedy(PATH, ids, N_GREEDY)
  print(f"\n{prompt!r} -> {m.tokenizer.decode(ours)!r}")
  assert ours == theirs
  assert len(set(ours)) >= 8                     # a trained model's text, not one token repeated


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_nextn_drafts_are_accepted_and_output_is_plain_greedy(k):
  m = _model()
  acc = prop = 0
  for p in th.PROMPTS:
    r = speculative_generate(m, m.tokenizer.encode(p), drafter="mtp", k=k, max_new_tokens=N_GREEDY, kv="f32",
                             stop_at_eos=False)
    assert tuple(r.ids) == _plain(p)
    acc += r.stats["drafts_accepted"][0]
    prop += r.stats["drafts_proposed"][0]
  print(f"\nk={k}: first-draft acceptance through the decode loop {acc}/{prop} = {acc / prop:.1%}")
  assert acc / prop >= 0.5


def test_k1_acceptance_equals_a_replay_over_the_float64_reference():
  """Greedy k = 1 with NextN drafts: a round at position P drafts argmax NextN(h_(P-1), t_P) for t_(P+1), and the
  recurrent state is rolled back whenever that draft is rejected. Given the final sequence, the float64 reference's
  (tests/ref_hybrid.py) NextN predictions decide every round, so the accepted count and the rounds are determined."""
  from tests.ref_hybrid import HybridRefModel
  m = _model()
  ref = HybridRefModel(PATH)
  for p in th.PROMPTS[:2]:
    prompt = m.tokenizer.encode(p)
    r = speculative_generate(m, prompt, drafter="mtp", k=1, max_new_tokens=N_GREEDY, kv="f32", stop_at_eos=False)
    assert tuple(r.ids) == _plain(p)
    seq = prompt + list(r.ids)
    _, hidden = ref.forward(seq)
    logits, _ = ref.mtp_forward(hidden[:-1], seq[1:], start_pos=1)       # entry j predicts token j + 2
    pred = logits.argmax(-1)
    P, gen, accepted, rounds = len(prompt), 1, 0, 0
    while gen < N_GREEDY:
      ok = int(pred[P - 1] == seq[P + 1])
      accepted, rounds, gen, P = accepted + ok, rounds + 1, gen + 1 + ok, P + 1 + ok
    print(f"\n{p!r}: {accepted} of {rounds} k=1 drafts accepted (engine and float64 replay)")
    assert 0 < accepted < rounds
    assert (r.stats["drafts_accepted"][0], r.stats["rounds"]) == (accepted, rounds)


def _chi2(counts, probs, n):
  """(Pearson chi-square, its degrees of freedom) over the bins expected >= 5 times."""
  exp = np.asarray(probs, np.float64) * n
  m = exp >= 5
  return float(np.sum((counts[m] - exp[m]) ** 2 / exp[m])), int(m.sum()) - 1


def test_sampled_rounds_with_rollback_have_the_target_distribution(monkeypatch):
  """Sampled verification over recurrent layers. Two k = 1 rounds from the state after a prompt and its first token
  t1, over 2,000 keys, at temperature 1 and top_p 0.9; the replay drafter proposes the least likely token, outside
  every nucleus on the way, so each round's draft is rejected, the round emits a resampled token and must roll its
  DeltaNet states back from the 2-token verify pass to the state after its first token. The emitted (x, y) must be
  distributed as plain decoding's: x ~ p(. | prompt t1) and, for each frequent x, y ~ p(. | prompt t1 x), from
  plain decode steps (chi-square, p > 1e-3). The control keeps the state after the rejected draft instead (no
  rollback) and must fail the same test for y."""
  import jax
  import jax.numpy as jnp
  from scipy import stats as st

  from decode import speculative as spec
  from decode.engine import GenConfig, start_request
  from decode.sampling import target_probs
  from model import api

  m = _model()
  prompt = m.tokenizer.encode(th.PROMPTS[1])
  gen = GenConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, kv="f32", stop_at_eos=False, seed=0)
  sp = spec.start_speculative(m, prompt, gen, drafter="replay", k=1, replay_ids=[0] * 8)
  T, t1 = len(prompt), int(sp.s.hist[len(prompt)])

  # plain decoding's distributions: decode steps from the prefill's state (copied: the steps donate it)
  state0 = start_request(m, prompt, gen).state

  def step(token, state):
    lg, _, state = api.decode_step(sp.params, jnp.int32(token), jax.tree.map(jnp.copy, state), cfg=m.cfg,
                                   options=gen.options)
    return lg, state

  lg1, state1 = step(t1, state0)
  px1 = np.asarray(target_probs(lg1, gen.temperature, gen.top_p), np.float64)
  rare = 256 + int(np.argmin(np.asarray(lg1)[256:]))       # the least likely token that is not a byte
  replay = jnp.full_like(sp.replay, rare).at[: T + 1].set(sp.replay[: T + 1])

  def sample_xy(n_keys: int):
    @jax.jit
    def two_rounds(key, params, s0, replay):
      s = s0.replace(key=key)
      for _ in range(2):
        s = spec.spec_round(params, s, replay, jnp.int32(-1), **sp.kwargs)
      return s.hist[T + 1: T + 3], s.accepted[0]
    out = [two_rounds(key, sp.params, sp.s, replay) for key in jax.random.split(jax.random.PRNGKey(7), n_keys)]
    return np.stack([np.asarray(o[0]) for o in out]), np.asarray([int(o[1]) for o in out])

  def y_test(xy, px):
    chi = dof = 0
    for x, p in px.items():
      sel = xy[:, 0] == x
      c, d = _chi2(np.bincount(xy[sel, 1], minlength=len(p)), p, int(sel.sum()))
      chi, dof = chi + c, dof + d
    return st.chi2.sf(chi, dof), chi, dof

  N = 2000
  xy, acc = sample_xy(N)
  chi_x, dof_x = _chi2(np.bincount(xy[:, 0], minlength=len(px1)), px1, N)
  p_x = st.chi2.sf(chi_x, dof_x)
  counts = np.bincount(xy[:, 0], minlength=len(px1))
  frequent = [int(x) for x in np.argsort(-counts)[:3] if counts[x] >= 200]
  px = {x: np.asarray(target_probs(step(x, state1)[0], gen.temperature, gen.top_p), np.float64) for x in frequent}
  assert px1[rare] == 0.0 and frequent and all(p[rare] == 0.0 for p in px.values())
  assert not acc[np.isin(xy[:, 0], frequent)].any()        # every draft rejected there: every round rolled back
  p_y, chi_y, dof_y = y_test(xy, px)
  print(f"\nx: chi2 {chi_x:.1f} / {dof_x} dof, p = {p_x:.3f}; y given x in {frequent} ({counts[frequent].tolist()}): "
        f"chi2 {chi_y:.1f} / {dof_y}, p = {p_y:.3f}")
  assert p_x > 1e-3 and p_y > 1e-3

  # the control: no rollback (the state after the rejected draft stays)
  keep = api.select_recurrent
  monkeypatch.setattr(api, "select_recurrent", lambda model, kept, t: keep(model, kept, jnp.ones_like(t)))
  bad_p, bad_chi, bad_dof = y_test(sample_xy(N // 2)[0], px)
  print(f"without the rollback: y chi2 {bad_chi:.1f} / {bad_dof}, p = {bad_p:.2e}")
  assert bad_p < 1e-3


def test_decode_generate_runs_it():
  """The CLI on the file: MTP drafts (its default for a model with a NextN block, k = 3), greedy ids equal to
  llama.cpp's, drafts accepted."""
  r = subprocess.run([sys.executable, "-m", "decode.generate", "--gguf", PATH, "--prompt", th.PROMPTS[0],
                      "--max_new_tokens", "24", "--kv", "f32", "--json"], cwd=ROOT, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  print(f"\n{out['text']!r}: accepted {out['stats']['drafts_accepted']} of {out['stats']['drafts_proposed']}")
  assert out["ids"] == llama_ref.greedy(PATH, out["prompt_ids"], 24)
  assert sum(out["stats"]["drafts_accepted"]) > 0


def test_seed_arms_run_on_it_with_real_drafts(tmp_path):
  """The seed's four arms (rings 32,768 and 49,152; NextN drafts and lookup drafts) through bench.cells on CPU on a
  text prompt: the NextN drafter's drafts are accepted in part (real drafts, not replay), and tokens and acceptance
  are the same under both rings."""
  cells = tmp_path / "cells.jsonl"
  r = subprocess.run([sys.executable, "-m", "bench.cells", "--gguf", PATH, "--arms", "seed4", "--only", "AS,BS,AN,BN",
                      "--depths", "64", "--max_new_tokens", "16", "--seeds", "1", "--prompt_source", "text",
                      "--cells", str(cells)], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  recs = {x["arm"]: x["stats"] for x in map(json.loads, cells.read_text().splitlines())}
  assert sorted(recs) == ["AN", "AS", "BN", "BS"]
  for a, b in (("AS", "BS"), ("AN", "BN")):
    assert recs[a]["tokens"] == recs[b]["tokens"] and recs[a]["drafts_accepted"] == recs[b]["drafts_accepted"]
  acc, prop = sum(recs["AS"]["drafts_accepted"]), sum(recs["AS"]["drafts_proposed"])
  print(f"\nAS: {acc}/{prop} NextN drafts accepted")
  assert 0 < acc < prop


if __name__ == "__main__":
  raise SystemExit(pytest.main([__file__, "-s", "-q"]))
