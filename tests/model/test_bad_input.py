"""Bad input gives one clear line naming the file and the key or tensor, and the CLI exits 1 without a traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import pytest

from model.gguf_io import GGUFError, load_gguf
from tests.gguf_edit import rewrite
from tests.models import model_path, quantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bad_files(tmp):
  good = model_path("qwen3moe", "F16")
  files = {}
  p = os.path.join(tmp, "not.gguf")
  with open(p, "wb") as f:
    f.write(b"this is not a model\n" * 10)
  files["not_gguf"] = (p, "not a GGUF file")
  p = os.path.join(tmp, "trunc.gguf")
  with open(good, "rb") as f:
    blob = f.read()
  with open(p, "wb") as f:
    f.write(blob[: len(blob) * 2 // 3])
  files["truncated"] = (p, "truncated")
  files["arch"] = (rewrite(good, os.path.join(tmp, "arch.gguf"), arch="llama"), "unsupported arch 'llama'")
  q = os.path.join(tmp, "q4_0.gguf")
  quantize(good, q, "Q4_0")
  files["qtype"] = (q, "unsupported type Q4_0")
  files["missing_tensor"] = (rewrite(good, os.path.join(tmp, "mt.gguf"), drop_tensors=("blk.1.ffn_up_exps.weight",)),
                             "missing tensor 'blk.1.ffn_up_exps.weight'")
  files["shape"] = (rewrite(good, os.path.join(tmp, "shape.gguf"), reshape={"blk.0.attn_q.weight": (128, 512)}),
                    "tensor 'blk.0.attn_q.weight' has shape [128, 512], expected [256, 256]")
  files["missing_key"] = (rewrite(good, os.path.join(tmp, "mk.gguf"), drop_keys=("qwen3moe.expert_count",)),
                          "missing required key 'qwen3moe.expert_count'")
  files["bad_key"] = (rewrite(good, os.path.join(tmp, "bk.gguf"),
                              set_keys={"qwen3moe.expert_count": ("eight", gguf.GGUFValueType.STRING)}),
                      "key 'qwen3moe.expert_count' is 'eight', expected int")
  return files


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
  return _bad_files(str(tmp_path_factory.mktemp("bad")))


CASES = ["not_gguf", "truncated", "arch", "qtype", "missing_tensor", "shape", "missing_key", "bad_key"]


@pytest.mark.parametrize("case", CASES)
def test_loader_error_is_one_clear_line(bad_files, case):
  path, expected = bad_files[case]
  with pytest.raises(GGUFError) as e:
    load_gguf(path)
  msg = str(e.value)
  assert "\n" not in msg
  assert msg.startswith(path)
  assert expected in msg, msg


@pytest.mark.parametrize("case", ["not_gguf", "truncated", "missing_tensor", "shape"])
def test_cli_exits_1_without_traceback(bad_files, case):
  path, expected = bad_files[case]
  r = subprocess.run([sys.executable, "-m", "decode.generate", "--gguf", path, "--prompt", "hi"], cwd=ROOT,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1
  assert "Traceback" not in r.stderr
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert lines[-1].startswith("error: ") and expected in lines[-1], r.stderr


def test_prompt_over_max_context_is_refused():
  r = subprocess.run([sys.executable, "-m", "decode.generate", "--gguf", model_path("qwen3moe", "F16"),
                      "--prompt_tokens", "300", "--max_new_tokens", "10", "--max_context", "256",
                      "--kv_resident", "256"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1 and "Traceback" not in r.stderr
  assert "exceeds max_context 256" in r.stderr.strip().splitlines()[-1]


def test_ring_too_small_beside_a_host_tier_is_refused():
  """A 16-slot ring beside a host tier keeps 8 scratch slots (engine.TIER_SCRATCH): refused in one line."""
  from decode import engine
  from model.loader import load_model
  m = load_model(model_path("qwen3moe", "F16"))
  gen = engine.GenConfig(max_new_tokens=4, kv_resident=16, max_context=256, stop_at_eos=False)
  with pytest.raises(engine.RequestError, match=r"^kv_resident 16 is too small beside a host tier: expected more "
                                                r"than 16 slots$"):
    engine.start_request(m, [1, 2, 3], gen)


def test_plan_over_the_device_budget_is_refused():
  """A 256K bf16 ring does not fit a 64 MiB budget: one line naming the budget and the largest items."""
  r = subprocess.run([sys.executable, "-m", "decode.generate", "--gguf", model_path("qwen3moe", "F16"),
                      "--prompt_tokens", "16", "--max_new_tokens", "4", "--kv_resident", "262144",
                      "--device_budget", "64MiB"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1 and "Traceback" not in r.stderr
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: memory plan:") and "exceeds the budget 0.06 GiB" in last
  assert "largest: main ring" in last, last


def test_prefill_chunk_below_one_is_refused():
  r = subprocess.run([sys.executable, "-m", "decode.generate", "--gguf", model_path("qwen3moe", "F16"),
                      "--prompt_tokens", "16", "--max_new_tokens", "4", "--prefill_chunk", "0"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1 and "Traceback" not in r.stderr
  assert r.stderr.strip().splitlines()[-1] == "error: --prefill_chunk: 0, expected at least 1 token per call"
