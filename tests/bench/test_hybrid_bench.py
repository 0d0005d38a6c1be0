"""bench.cells on a hybrid model (tiny qwen3next, random valid blocks in memory): a plain arm and a replay arm with
expert slots, two rings; every record's tokens equal across rings, and replay accepts every draft (the rollback of
the recurrent state inside the round leaves what plain decoding leaves)."""
from __future__ import annotations

import json
import subprocess
import sys


def test_bench_cells_on_a_hybrid_model(tmp_path):
  cells = tmp_path / "cells.jsonl"
  r = subprocess.run(
      [sys.executable, "-m", "bench.cells", "--preset", "tiny-qwen3next", "--in_memory", "--rings", "256,1024",
       "--drafts", "none,replay@3", "--expert_cache", "6", "--depths", "40", "--max_new_tokens", "10", "--seeds", "1",
       "--cells", str(cells)], capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  recs = {x["arm"]: x for x in map(json.loads, cells.read_text().splitlines())}
  assert len(recs) == 4 and all(x["config"]["arch"] == "qwen3next" for x in recs.values())
  toks = {arm: x["stats"]["tokens"] for arm, x in recs.items()}
  assert len({tuple(t) for t in toks.values()}) == 1                  # plain = replay, both rings
  for arm, x in recs.items():
    st = x["stats"]
    assert st["generated_tokens"] == 10 and st["expert_cache"]["slots"] == 6
    items = {i["name"] for i in st["plan"]["items"]}
    assert "recurrent state" in items and (("verify states" in items) == ("replay" in arm))
    if "replay" in arm:
      assert st["acceptance"] == 1.0
