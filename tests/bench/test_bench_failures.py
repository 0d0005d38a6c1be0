"""`python -m bench.step` and `python -m bench.cells` with a cell or arm that cannot run: the ones that ran are in
the table and the JSONL, the failing one is named on its own line, and the process exits 1 (a sweep that lost a
variant is not a clean run)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(module: str, *args: str):
  """(the process, its stderr lines with progress bars' carriage returns as line breaks), exit 1 asserted."""
  r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, r.stderr[-2000:]
  return r, r.stderr.replace("\r", "\n").splitlines()


def test_a_failing_cell_is_named_and_the_exit_status_is_1(tmp_path):
  out = tmp_path / "step.jsonl"
  r, lines = _bench("bench.step", "--preset", "tiny-qwen3moe", "--kernels", "xla", "--steps", "2", "--repeats", "1",
                    "--cells", "256:16:auto:xla,256:16:auto:xla:10", "--out", str(out))
  assert "cell R=256 depth=16 xla/auto glue on: ValueError: max_context 10 < depth 16 + 3 steps" in lines
  assert lines[-1] == "bench.step: 1 of 2 cells failed (their lines above), the table has the rest"
  recs = [json.loads(x) for x in out.read_text().splitlines()]
  assert [(x["ring"], x["depth"], x["ms_per_step"] > 0) for x in recs] == [(256, 16, True)]
  assert "| 256 | - | 16 | - | xla | auto | on |" in r.stdout


def test_a_refused_arm_is_named_and_the_exit_status_is_1(tmp_path):
  cells = tmp_path / "cells.jsonl"
  r, lines = _bench("bench.cells", "--rings", "16,2048", "--drafts", "none", "--depths", "40", "--max_new_tokens", "2",
                    "--seeds", "1", "--cells", str(cells))
  assert "cell R16-none-int8-D40: prompt: 40 tokens + max_new_tokens 2 = 42 exceeds max_context 16" in lines
  assert lines[-1] == ("bench.cells: 1 of 2 arms failed (R16-none-int8-D40: their lines above), the table has the "
                       "rest")
  assert [json.loads(x)["arm"] for x in cells.read_text().splitlines()] == ["R2048-none-int8-D40"]
  assert "| R2048-none-int8-D40 | 2048 | none |" in r.stdout
