"""examples/quickstart.py runs as a script and opens as a notebook (jupytext); the public entry points it uses
carry runnable docstring examples, which run here too."""
from __future__ import annotations

import doctest
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QS = os.path.join(ROOT, "examples", "quickstart.py")


def test_quickstart_runs_as_a_script(tmp_path):
  png = tmp_path / "acc.png"
  r = subprocess.run([sys.executable, QS], cwd=ROOT, capture_output=True, text=True, timeout=900,
                     env={**os.environ, "QUICKSTART_PNG": str(png), "MPLBACKEND": "Agg"})
  assert r.returncode == 0, r.stderr[-2000:]
  assert "rounds" in r.stdout and "| main ring |" in r.stdout
  assert png.stat().st_size > 1000


def test_quickstart_opens_as_a_notebook():
  jupytext = pytest.importorskip("jupytext")
  nb = jupytext.read(QS)
  kinds = [c.cell_type for c in nb.cells]
  assert kinds.count("markdown") >= 4 and kinds.count("code") >= 5


@pytest.mark.parametrize("module", ["model.api", "model.state", "model.recurrent", "model.options", "decode.engine",
                                    "decode.speculative", "decode.kv_plan", "model.loader", "bench.round_model"])
def test_docstring_examples_run(module):
  import importlib
  mod = importlib.import_module(module)
  res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert res.failed == 0
