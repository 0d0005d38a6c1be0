"""Every dot of a traced decode step and verify pass asks for full float32 precision (on GPUs XLA's default is
TF32, whose batch-dependent error broke greedy exactness on the 512-expert shape: docs/PERF.md)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from model import api
from model.loader import load_model
from tests.models import model_path


def _dots(jaxpr):
  for eq in jaxpr.eqns:
    if eq.primitive.name == "dot_general":
      yield eq
    for sub in jax.core.subjaxprs(eq) if hasattr(jax.core, "subjaxprs") else ():
      yield from _dots(sub)
    for v in eq.params.values():
      inner = getattr(v, "jaxpr", None)
      if inner is not None:
        yield from _dots(getattr(inner, "jaxpr", inner))


def test_all_dots_are_highest_precision():
  m = load_model(model_path("glm4moe", "IQ3_S"))
  st = api.init_state(m.cfg, 1024, "int8", mtp_window=256, scratch=4)
  for T in (1, 4):
    jx = jax.make_jaxpr(lambda p, t, s: api.forward(p, t, s, cfg=m.cfg))(m.params, jnp.zeros(T, jnp.int32), st)
    dots = list(_dots(jx.jaxpr))
    assert len(dots) > 10
    bad = [d for d in dots if d.params.get("precision") not in ((jax.lax.Precision.HIGHEST,) * 2,)]
    assert not bad, f"{len(bad)} of {len(dots)} dots without HIGHEST precision, e.g. {bad[0].params.get('precision')}"
