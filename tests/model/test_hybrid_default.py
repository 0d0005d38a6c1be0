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
