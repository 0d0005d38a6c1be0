"""Speculative decoding with the trained default model, whose NextN head really predicts: drafts are accepted
often, the output is still exactly plain greedy, and the k = 1 acceptance count equals an independent replay
of the rounds over the float64 reference's NextN predictions."""
from __future__ import annotations

import functools

import pytest

from decode.engine import generate
from decode.speculative import speculative_generate
from configs.default import default_model_path
from model.loader import load_model
from tests.ref_forward import RefModel

N = 64
PROMPTS = ["The built-in function", "A class definition", "Exceptions can be"]


@functools.lru_cache(maxsize=None)
def _m():
  path = default_model_path()
  if not path.endswith("configs/data/default.gguf"):
    pytest.skip("the trained default model is not shipped")
  return load_model(path)


@functools.lru_cache(maxsize=None)
def _plain(prompt: str):
  m = _m()
  return generate(m, m.tokenizer.encode(prompt), max_new_tokens=N, stop_at_eos=False)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_mtp_drafts_are_accepted_and_output_is_plain_greedy(k):
  m = _m()
  acc = prop = 0
  for p in PROMPTS:
    r = speculative_generate(m, m.tokenizer.encode(p), drafter="mtp", k=k, max_new_tokens=N, stop_at_eos=False)
    assert r.ids == _plain(p).ids
    acc += r.stats["drafts_accepted"][0]
    prop += r.stats["drafts_proposed"][0]
  print(f"\nk={k}: first-draft acceptance through the decode loop {acc}/{prop} = {acc / prop:.1%}")
  assert acc / prop >= 0.5


def test_k1_acceptance_equals_a_replay_over_the_float64_reference():
  """Greedy k = 1: a round at position P drafts argmax NextN(h_{P-1}, t_P) for t_{P+1}. Given the final
  sequence, the reference's NextN predictions decide every round, so the accepted count is determined."""
  m = _m()
  ref = RefModel(default_model_path())
  for p in PROMPTS[:2]:
    prompt = m.tokenizer.encode(p)
    r = speculative_generate(m, prompt, drafter="mtp", k=1, max_new_tokens=N, stop_at_eos=False)
    seq = prompt + r.ids
    _, hidden = ref.forward(seq)
    logits, _ = ref.mtp_forward(hidden[:-1], seq[1:], start_pos=1)       # entry j predicts token j + 2
    pred = logits.argmax(-1)
    P, gen, accepted, rounds = len(prompt), 1, 0, 0
    while gen < N:
      ok = int(pred[P - 1] == seq[P + 1])
      accepted, rounds, gen, P = accepted + ok, rounds + 1, gen + 1 + ok, P + 1 + ok
    assert (r.stats["drafts_accepted"][0], r.stats["rounds"]) == (accepted, rounds)
