"""The embedded default model, configs/data/default.gguf (trained by tools/train_default.py).

Checks the file (size, glm4moe with one NextN block, IQ3_S routed experts), that greedy text from it is
readable, and its held-out MTP acceptance at k = 1: on a fixed slice of the held-out pydoc chunks (never
trained on), teacher-forced through model.loader and model.api (`prefill`, then `mtp_step` over the hidden
states), the fraction of positions j where argmax(MTP logits_j) == argmax(main logits_(j+1)), i.e. where the
greedy draft would be accepted. Measured values are printed (pytest -s shows them).
"""
from __future__ import annotations

import collections
import functools
import os

import pytest

from tools import train_default as td
from configs.default import default_model_path
from model.loader import load_model

PATH = str(td.DATA_DIR / "default.gguf")
MAX_BYTES = 20 * 1000 * 1000
SLICE_LEN = 512     # the fixed held-out slice: every held-out chunk, cut into windows of 512 tokens


@functools.lru_cache(maxsize=None)
def _model():
  return load_model(PATH)


def test_file_is_shipped_and_small():
  assert os.path.isfile(PATH), f"{PATH} is missing: run `nice -n 10 python -m tools.train_default`"
  size = os.path.getsize(PATH)
  print(f"\n{PATH}: {size / 1e6:.2f} MB")
  assert size <= MAX_BYTES
  assert os.path.samefile(default_model_path(), PATH)


def test_config_glm4moe_with_nextn():
  cfg = _model().cfg
  print(f"\n{cfg}")
  assert cfg.arch == "glm4moe"
  assert cfg.n_nextn == 1
  assert cfg.n_experts > 1 and cfg.top_k >= 2 and cfg.routing == "sigmoid"
  assert cfg.n_dense_lead >= 1 and cfg.n_layers > cfg.n_dense_lead
  assert cfg.vocab_size == _model().tokenizer.vocab_size
  params = _model().params
  assert "mtp_0" in params and "eh_proj" in params["mtp_0"]


def test_routed_experts_are_iq3_s():
  import gguf
  cfg = _model().cfg
  types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(PATH).tensors}
  exps = {n: t for n, t in types.items() if "_exps." in n}
  n_moe = cfg.n_layers - cfg.n_dense_lead + cfg.n_nextn
  print(f"\ntensor types: {dict(collections.Counter(types.values()))}")
  assert len(exps) == 3 * n_moe
  assert set(exps.values()) == {"IQ3_S"}
  assert f"blk.{cfg.n_layers}.nextn.eh_proj.weight" in types


def test_greedy_text_is_readable():
  from decode.engine import generate
  m = _model()
  prompt = "The for statement"
  r = generate(m, m.tokenizer.encode(prompt), max_new_tokens=48, kv="f32", stop_at_eos=False)
  text = r.text
  print(f"\n{prompt!r} -> {text!r}")
  assert len(r.ids) == 48
  assert sum(ch.isprintable() or ch in "\n\t" for ch in text) >= 0.95 * len(text)
  top_share = collections.Counter(r.ids).most_common(1)[0][1] / len(r.ids)
  assert top_share < 0.35, f"one token is {top_share:.0%} of the output"
  assert len(set(r.ids)) >= 12
  words = [w for w in text.split() if w.isalpha()]
  assert len(set(words)) >= 4, f"too few distinct words in {text!r}"


def test_heldout_mtp_acceptance_k1():
  wins = td.heldout_windows(SLICE_LEN)
  assert wins.shape[1] == SLICE_LEN and wins.size >= 4096
  m = td.gguf_metrics(_model(), wins)
  print(f"\nheld-out slice ({m['positions']} positions): main loss {m['main_loss']:.3f}, MTP loss "
        f"{m['mtp_loss']:.3f}, k=1 MTP acceptance {m['acceptance_k1']:.1%}")
  assert m["acceptance_k1"] >= 0.6
  assert m["main_loss"] < 4.0


if __name__ == "__main__":
  raise SystemExit(pytest.main([__file__, "-s", "-q"]))
