"""`decode.generate` on a hybrid file (tiny qwen3next): the greedy ids equal llama.cpp's on the same file, the memory
plan has the recurrent state as its own row (and the ring only the attention layers), and drafted requests through
the CLI emit the same ids."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.models import model_path
from tools import llama_ref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args) -> tuple[dict, str]:
  r = subprocess.run([sys.executable, "-m", "decode.generate", *args, "--json"], cwd=ROOT, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  return json.loads(r.stdout.strip().splitlines()[-1]), r.stdout + r.stderr


@pytest.mark.parametrize("draft", ["none", "lookup"])
def test_generate_json_on_a_hybrid_file(draft):
  path = model_path("qwen3next", "F16")
  out, text = _run("--gguf", path, "--prompt", "def main():", "--max_new_tokens", "12", "--kv", "f32", "--plan",
                   "--draft", draft, "--mtp_draft", "3")
  assert out["ids"] == llama_ref.greedy(path, out["prompt_ids"], 12)
  items = {i["name"]: i["bytes"] for i in out["stats"]["plan"]["items"]}
  assert items["recurrent state"] > 0 and "recurrent state" in text          # the --plan table
  assert (draft == "lookup") == ("verify states" in items)
