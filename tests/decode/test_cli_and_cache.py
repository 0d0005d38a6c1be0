"""The generate CLI (--json), the eager and jitted decode loops, and the orbax params cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from decode.engine import generate
from model import api, loader
from configs.default import default_model_path
from model.loader import load_model
from tools import llama_ref
from tests.models import model_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generate_cli_json_matches_llama_cpp_greedy():
  path = model_path("qwen3moe", "F16")
  r = subprocess.run([sys.executable, "-m", "decode.generate", "--gguf", path, "--prompt", "def main():",
                      "--max_new_tokens", "12", "--temperature", "0", "--kv", "f32", "--json"],
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert set(out) >= {"prompt_ids", "ids", "text", "stats"}
  assert out["stats"]["decode_tok_s"] > 0
  m = load_model(path)
  assert out["prompt_ids"] == m.tokenizer.encode("def main():")
  assert out["ids"] == llama_ref.greedy(path, out["prompt_ids"], 12)
  assert out["text"] == m.tokenizer.decode(out["ids"])


def test_eager_loop_equals_jitted_loop():
  m = load_model(model_path("glm4moe", "IQ3_S"))
  prompt = m.tokenizer.encode("import os")
  a = generate(m, prompt, max_new_tokens=10, stop_at_eos=False, eager=True).ids
  b = generate(m, prompt, max_new_tokens=10, stop_at_eos=False).ids
  assert a == b and len(a) == 10


def test_orbax_cache_skips_gguf_and_gives_identical_logits(tmp_path, monkeypatch):
  path = model_path("glm4moe", "Q4_K_M")
  first = load_model(path, str(tmp_path))
  assert not first.from_cache
  def no_gguf(*a, **k):
    raise AssertionError("GGUF parsed on a cached load")
  monkeypatch.setattr(loader, "load_gguf", no_gguf)
  second = load_model(path, str(tmp_path))
  assert second.from_cache and second.cfg == first.cfg
  toks = jnp.asarray(second.tokenizer.encode("class Foo(object):"), jnp.int32)
  outs = []
  for m in (first, second):
    logits, _, _ = api.prefill(m.params, toks, api.init_state(m.cfg, 256, "f32"), cfg=m.cfg)
    outs.append(np.asarray(logits))
  np.testing.assert_array_equal(outs[0], outs[1])
  assert second.tokenizer.encode("hello world") == first.tokenizer.encode("hello world")


def test_plan_line_says_what_a_bigger_ring_or_window_moves():
  """`generate --plan --expert_cache auto --device_budget B` prints free GiB and slots and what ring +16K and a
  doubled MTP window move (the seed's "18.09 -> 17.92 GiB free, 7,957 -> 7,862 slots"). On the default model
  (5.4 MB of experts, 2 KB of bf16 K/V per token) 41 MiB holds everything at ring 1,024 but not at 17,408: the
  line gives the slots that budget leaves there, counted here from the plan's own byte items. At 20 MiB the
  bigger ring does not fit at all; the line says so and the request still runs."""
  from model import expert_cache as xc
  from decode.kv_plan import make_plan, param_bytes
  MiB = 1 << 20
  m = load_model(default_model_path())

  def plan(budget):
    r = subprocess.run([sys.executable, "-m", "decode.generate", "--plan", "--expert_cache", "auto",
                        "--device_budget", budget, "--max_new_tokens", "4", "--prompt", "hello"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return next(line for line in r.stdout.splitlines() if line.startswith("plan: ")), r.stdout

  line, _ = plan("41MiB")
  total, experts = param_bytes(m.params)
  slab = max(xc.slab_bytes(m.params, m.cfg).values())
  big = make_plan(m.cfg, weight_bytes=total, expert_bytes=experts, ring=1024 + 16384, kv="bf16", mtp_window=4096,
                  k=3, expert_cache_bytes=0, prefill_chunk=len(m.tokenizer.encode("hello")))
  want = (41 * MiB - big.device_bytes) // slab
  assert 2 <= want < len(xc.expert_blocks(m.cfg)) * m.cfg.n_experts
  assert "all experts; ring +16K (1024 -> 17408): " in line and f"all experts -> {want} expert slots" in line, line
  assert "MTP window x2 (4096 -> 8192): " in line
  line, out = plan("20MiB")
  assert "ring +16K (1024 -> 17408): does not fit (memory plan:" in line, line
  assert "[4 tokens" in out
