"""The routed experts on 8-bit x (ops/dot8) inside the model: with the gate/up tile's x8 set, the norm before the
experts rounds its output in its own program (ops.rmsnorm_pallas, x8) and the gate/up kernel reads that rounding;
the step's logits are bitwise those of the experts rounding x themselves (XLA's ops, dot8.quantize_x), and the
rounding is visible against the float tiles; for the hybrid family too. (A verify pass's rows against one-token
steps are a GPU check, scripts/gpu/batch_invariance.py --x8: on CPU the XLA parts of a step are not batch
invariant.)"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import api, transformer
from model.loader import load_model
from model.options import Options
from ops import dot8, moe_pallas, qmatmul_pallas
from ops import qmatmul as ops_qmatmul
from ops.qtensor import with_kernels
from ops.tuning import ByType, Tunings
from tests.models import model_path

X8 = Options(tunings=Tunings(moe=moe_pallas.Tuning(gateup=qmatmul_pallas.Tuning(x8="int"))))
PX8 = Options(tunings=Tunings(qmatmul=ByType(**{q: qmatmul_pallas.Tuning(x8="int") for q in dot8.TILES})))


def _step_logits(m, params, options):
  """Logits of a one-token step after an 8-token prompt (prefilled on the XLA reference), traced afresh (no
  kernel's trace cached from another variant or test)."""
  jax.clear_caches()
  toks = jnp.asarray(np.random.default_rng(5).integers(0, 1000, 9), jnp.int32)
  _, _, st = api.prefill(m.params, toks[:8], api.init_state(m.cfg, 256, "int8"), cfg=m.cfg)
  f = jax.jit(lambda p, t, s: api.forward(p, t, s, cfg=m.cfg, options=options)[0])
  return np.asarray(f(params, toks[8:], st))


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_norm_rounds_x_for_the_experts(arch, monkeypatch):
  m = load_model(model_path(arch, "IQ3_S"))
  params = with_kernels(m.params, "interpret")
  real, calls = dot8.quantize_x, []

  def counted(x):
    calls.append(x.shape)
    return real(x)

  monkeypatch.setattr(dot8, "quantize_x", counted)
  fused = _step_logits(m, params, X8)
  assert not calls                                            # the norm kernel rounded: no XLA rounding traced
  monkeypatch.setattr(transformer, "_moe_wants_x8", lambda block, T: False)
  own = _step_logits(m, params, X8)
  assert calls                                                # the experts rounded x in XLA 
  np.testing.assert_array_equal(fused, own)
  float_tiles = _step_logits(m, params, Options())
  err = np.linalg.norm(fused - float_tiles) / np.linalg.norm(float_tiles)
  assert 1e-6 < err < 0.2, err                                # x8 is on, and only rounds


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_norm_rounds_x_for_the_mixer_projection(arch, monkeypatch):
  """The projections on 8-bit x: the norm before the mixer rounds for its fused input projection (attention's
  wqkv, a DeltaNet layer's win); bitwise the step whose projections round x themselves, with fewer roundings in
  XLA (the others' inputs, o and the head, are not a norm's)."""
  m = load_model(model_path(arch, "Q8_0"))          # every projection Q8_0: q/k/v and the DeltaNet inputs fused
  params = with_kernels(m.params, "interpret")
  mixer = params["blk_0"]["gdn" if m.cfg.is_recurrent(0) else "attn"]
  assert ops_qmatmul.wants_x8(1, mixer["win" if m.cfg.is_recurrent(0) else "wqkv"], PX8.tunings)
  real, calls = dot8.quantize_x, []
  monkeypatch.setattr(dot8, "quantize_x", lambda x: calls.append(x.shape) or real(x))
  fused = _step_logits(m, params, PX8)
  n_fused, calls[:] = len(calls), []
  monkeypatch.setattr(transformer, "_proj_wants_x8", lambda block, T, recurrent: False)
  own = _step_logits(m, params, PX8)
  assert n_fused < len(calls), (n_fused, len(calls))
  np.testing.assert_array_equal(fused, own)

