"""Work moved into a neighbouring kernel (ops.tuning.FUSIONS, `Tunings.fuse`) leaves the model's numbers as they
were and takes launches out of a decode step.
- "residual": a block's FFN output goes to the next norm kernel in pieces (the routed experts' X rows unsummed,
  the shared expert's output and its gate's logit), which adds them to the residual stream in the order XLA did; a
  one-token step and a 4-token verify pass give the logits of the unfused model, and the step's jaxpr has X (+ 1
  with a shared expert) fewer [T, D] adds a MoE layer, and no gate product.
- "router": a MoE layer's FFN norm makes the router's logits and a shared expert's gate logit
  (ops.norm_router_pallas): one kernel where the norm and the logits kernels were, the logits those of the unfused
  model to float32 rounding (the norm's reduction is another program's), and with the experts on 8-bit x the
  fused kernel makes the rounding.
- "topk": the routed experts' gate/up routes for itself (ops.moe.moe_routed): no top-k kernel, the logits bitwise
  the unfused model's (the same ops on the same logits).
- "gated_norm": a DeltaNet layer's output norm kernel applies its silu(z) gate.
- "rope": q/k norm, RoPE and the ring write run inside the decode attention kernel (ops.rope_attention_pallas):
  the logits and the whole state after a step and a verify pass bitwise the two kernels' (fused q/k/v weights, the
  Q8_0 files), and neither rope_write's nor the split attention's kernel left.
Every fusion is on by default (`Tunings.fuse` = FUSIONS), where the glue kernels run; the tests compare against
`fuse=()` spelled out."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import api
from model.loader import load_model
from model.options import Options
from ops import dot8, moe_pallas, qmatmul_pallas
from ops.qtensor import with_kernels
from ops.tuning import Tunings
from tests.models import model_path
from tests.ops.test_kernels import _eqn_shapes

UNFUSED = Options(tunings=Tunings(fuse=()))


def _kernel_names(fn, *args) -> list:
  """The name of every Pallas kernel a call of fn traces."""
  names = []

  def walk(jaxpr):
    for eq in jaxpr.eqns:
      if eq.primitive.name == "pallas_call":
        names.append(eq.params["name"])
      else:
        for sub in jax.extend.core.jaxprs_in_params(eq.params):
          walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return names


def _setup(arch, kind="IQ3_S"):
  m = load_model(model_path(arch, kind))
  toks = jnp.asarray(np.random.default_rng(5).integers(0, 1000, 12), jnp.int32)
  _, _, st = api.prefill(m.params, toks[:8], api.init_state(m.cfg, 256, "int8"), cfg=m.cfg)
  step = lambda options: (lambda p, t, s: api.forward(p, t, s, cfg=m.cfg, options=options)[0])
  n_moe = sum(m.cfg.is_moe_layer(i) for i in range(m.cfg.n_layers))
  return m, with_kernels(m.params, "interpret"), toks, st, step, n_moe


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_residual_goes_to_the_next_norm_kernel(arch):
  m, params, toks, st, step, n_moe = _setup(arch)
  fused = Options(tunings=Tunings(fuse=("residual",)))
  for T in (1, 4):
    got, want = (np.asarray(jax.jit(step(o))(params, toks[8:8 + T], st)) for o in (fused, UNFUSED))
    if m.cfg.shared_expert_gate:
      # the same sum; XLA fuses the unfused model's shared-expert gate multiply into its add (one rounding fewer)
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    else:
      np.testing.assert_array_equal(got, want)
    n_fused, n_plain = (_eqn_shapes(step(o), params, toks[8:8 + T], st).count(("add", (T, m.cfg.d_model)))
                        for o in (fused, UNFUSED))
    shared = bool(m.cfg.n_shared_experts or m.cfg.shared_expert_gate)
    assert n_plain - n_fused == n_moe * (m.cfg.top_k + shared), (n_plain, n_fused)   # X - 1 (+ 1) + the stream's
    muls = [_eqn_shapes(step(o), params, toks[8:8 + T], st).count(("mul", (T, m.cfg.d_model)))
            for o in (fused, UNFUSED)]
    assert muls[1] - muls[0] == n_moe * m.cfg.shared_expert_gate, muls   # the gate's product: the norm kernel's


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_ffn_norm_makes_the_router_logits(arch, monkeypatch):
  m, params, toks, st, step, n_moe = _setup(arch)
  x8 = Tunings(moe=moe_pallas.Tuning(gateup=qmatmul_pallas.Tuning(x8="int")), fuse=())
  real, calls = dot8.quantize_x, []
  monkeypatch.setattr(dot8, "quantize_x", lambda x: calls.append(x.shape) or real(x))
  outs = {}
  for tunings, T in ((UNFUSED.tunings, 1), (UNFUSED.tunings, 4), (x8, 1)):
    fused = Options(tunings=tunings.replace(fuse=("router", "residual", "topk")))
    got, want = (np.asarray(jax.jit(step(o))(params, toks[8:8 + T], st)) for o in (fused, Options(tunings=tunings)))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    outs[tunings == x8, T] = got
  names, plain = (_kernel_names(step(o), params, toks[8:9], st)
                  for o in (Options(tunings=Tunings(fuse=("router", "topk"))), UNFUSED))
  assert names.count("norm_router_logits") == n_moe
  assert plain.count("router_logits") - names.count("router_logits") == n_moe * (1 + m.cfg.shared_expert_gate)
  assert plain.count("rms_norm") - names.count("rms_norm") == n_moe
  assert plain.count("router_topk") == n_moe and "router_topk" not in names
  assert not calls                  # with x8 the fused kernel rounded the experts' x: XLA never did
  err = np.linalg.norm(outs[True, 1] - outs[False, 1]) / np.linalg.norm(outs[False, 1])
  assert 1e-6 < err < 0.2, err      # and x8 was on


def test_experts_route_for_themselves_bitwise():
  m, params, toks, st, step, n_moe = _setup("qwen3moe")
  fused = Options(tunings=Tunings(fuse=("topk",)))
  got, want = (np.asarray(jax.jit(step(o))(params, toks[8:12], st)) for o in (fused, UNFUSED))
  np.testing.assert_array_equal(got, want)
  assert "router_topk" not in _kernel_names(step(fused), params, toks[8:12], st)   # gate/up routed itself


def test_gated_deltanet_norm_multiplies_by_its_gate():
  """gated_norm: a DeltaNet layer's output norm kernel multiplies by silu(z) itself (one XLA launch fewer a
  recurrent layer); the step's logits those of the unfused model."""
  m, params, toks, st, step, _ = _setup("qwen3next")
  n_rec = sum(m.cfg.is_recurrent(i) for i in range(m.cfg.n_layers))
  fused = Options(tunings=Tunings(fuse=("gated_norm",)))
  got, want = (np.asarray(jax.jit(step(o))(params, toks[8:10], st)) for o in (fused, UNFUSED))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
  divs = [sum(1 for p, s in _eqn_shapes(step(o), params, toks[8:10], st) if p == "div" and len(s) == 3)
          for o in (fused, UNFUSED)]
  assert divs[1] - divs[0] == n_rec, divs                  # silu's x / (1 + exp(-x)) over [T, Hv, Dv]


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_rope_and_the_ring_write_run_inside_attention(arch):
  m, params, toks, st, _, _ = _setup(arch, "Q8_0")
  n_attn = sum(not m.cfg.is_recurrent(i) for i in range(m.cfg.n_layers))
  step = lambda o: (lambda p, t, s: api.forward(p, t, s, cfg=m.cfg, options=o))    # noqa: E731
  plain = Options(tunings=Tunings(attention_impl="interpret", fuse=()))  # the split kernel, as on a GPU
  fused = Options(tunings=plain.tunings.replace(fuse=("rope",)))
  for T in (1, 4):
    got, want = (jax.tree_util.tree_leaves(jax.jit(step(o))(params, toks[8:8 + T], st)) for o in (fused, plain))
    for a, b in zip(got, want):                                        # logits, hidden, every ring and state
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  names, before = (_kernel_names(step(o), params, toks[8:9], st) for o in (fused, plain))
  assert names.count("rope_ring_attention") == n_attn == before.count("rope_ring_write")
  assert "rope_ring_write" not in names and "ring_decode_attention" not in names


def test_rope_fold_runs_in_the_steps_and_the_verify_passes_alike():
  """A request's one-token steps and its verify passes (T up to attention_pallas.MAX_T) all fold or all do not:
  their rows agree bitwise within the folded kernel, not between it and rope_write + the split kernel."""
  from ops import attention_pallas as ap
  m, params, toks, st, _, _ = _setup("qwen3next", "Q8_0")
  step = lambda o: (lambda p, t, s: api.forward(p, t, s, cfg=m.cfg, options=o))    # noqa: E731
  fused = Options(tunings=Tunings(attention_impl="interpret", fuse=("rope",)))
  for T in (1, 3, ap.MAX_T):
    names = _kernel_names(step(fused), params, toks[8:8 + T], st)
    assert "rope_ring_attention" in names and "rope_ring_write" not in names, T


def test_every_fusion_is_the_default_where_the_glue_kernels_run():
  """Options() fuses what FUSIONS names wherever the glue kernels run (here interpret mode with the attention
  kernel, as on a GPU), and off them (the XLA ops, CPU's default) no fusion applies: the default step is the
  unfused one, op for op and bitwise."""
  from ops.tuning import FUSIONS
  m, params, toks, st, step, _ = _setup("qwen3next", "Q8_0")
  dflt, every = (Options(tunings=Tunings(attention_impl="interpret", **kw)) for kw in ({}, {"fuse": FUSIONS}))
  names = _kernel_names(step(dflt), params, toks[8:9], st)
  assert names == _kernel_names(step(every), params, toks[8:9], st)
  assert "rope_ring_attention" in names and "norm_router_logits" in names and "router_topk" not in names
  xla = m.params
  got, want = (np.asarray(jax.jit(step(o))(xla, toks[8:12], st)) for o in (Options(), UNFUSED))
  np.testing.assert_array_equal(got, want)
  assert _eqn_shapes(step(Options()), xla, toks[8:12], st) == _eqn_shapes(step(UNFUSED), xla, toks[8:12], st)
