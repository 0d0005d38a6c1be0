"""Lower every quantized kernel to Triton for an abstract CUDA device (H200) and an abstract ROCm device (MI300,
gfx942) from this CPU-only jaxlib (tools.lowering). Catches Triton-lowering errors (unsupported primitives,
non-power-of-two tensors, multi-axis reductions under a mesh) that interpret mode does not see.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ops import moe_grouped_pallas, moe_pallas, qgemm_pallas, qmatmul_pallas, quant
from tools.lowering import DEVICES
from tools.lowering import abstract_qtensor as _abstract_qtensor
from tools.lowering import lower as _lower


@pytest.mark.parametrize("platform", list(DEVICES))
@pytest.mark.parametrize("qtype", qmatmul_pallas.KERNEL_TYPES)
def test_qmatmul_lowers(qtype, platform):
  w = _abstract_qtensor(qtype, (4096, 2048))
  for B in (1, 5):
    x = jax.ShapeDtypeStruct((B, 2048), jnp.float32)
    txt = _lower(platform, lambda x, w: qmatmul_pallas.qmatmul_pallas(x, w), x, w)
    assert "__gpu$xla.gpu.triton" in txt
  one_row = qmatmul_pallas.Tuning(programs=8192)                        # BN halves to 1: a row per program
  assert qmatmul_pallas.config(qtype, 4096, 2048 // quant.GGML_TYPES[qtype][0], one_row).BN == 1
  x = jax.ShapeDtypeStruct((4, 2048), jnp.float32)
  assert "__gpu$xla.gpu.triton" in _lower(platform, lambda x, w: qmatmul_pallas.qmatmul_pallas(x, w, tuning=one_row),
                                          x, w)


@pytest.mark.parametrize("platform", list(DEVICES))
@pytest.mark.parametrize("qtype", qmatmul_pallas.KERNEL_TYPES)
def test_moe_lowers(qtype, platform):
  g = _abstract_qtensor(qtype, (128, 768, 2048))
  d = _abstract_qtensor(qtype, (128, 2048, 768))                 # F = 768: 3 superblocks, a 2 + 1 K plan
  for T in (3,):
    x = jax.ShapeDtypeStruct((T, 2048), jnp.float32)
    ids = jax.ShapeDtypeStruct((T, 8), jnp.int32)
    w = jax.ShapeDtypeStruct((T, 8), jnp.float32)
    txt = _lower(platform, lambda x, i, w, g, u, d: moe_pallas.moe_pallas(x, i, w, g, u, d), x, ids, w, g, g, d)
    assert txt.count("__gpu$xla.gpu.triton") == 2                 # gate/up kernel, down kernel


@pytest.mark.parametrize("platform", list(DEVICES))
def test_moe_stacked_and_split_k_lower(platform):
  """The stacked-layer entry (layer index an input) and gate/up split over K lower for both GPU platforms."""
  g = _abstract_qtensor("IQ3_S", (4, 128, 768, 2048))
  d = _abstract_qtensor("Q4_K", (4, 128, 2048, 768))
  x = jax.ShapeDtypeStruct((1, 2048), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  w = jax.ShapeDtypeStruct((1, 8), jnp.float32)
  ov = moe_pallas.Tuning(ks=4)
  txt = _lower(platform, lambda x, i, w, g, u, d: moe_pallas.moe_pallas(x, i, w, g, u, d, layer=jnp.int32(2),
                                                                        tuning=ov), x, ids, w, g, g, d)
  assert txt.count("__gpu$xla.gpu.triton") == 2
  lg, b = jax.ShapeDtypeStruct((1, 128), jnp.float32), jax.ShapeDtypeStruct((128,), jnp.float32)
  route = moe_pallas.Route("sigmoid", 8, True, 2.5, True)           # gate/up routes for itself (fuse "topk")
  txt = _lower(platform, lambda x, lg, b, g, u, d: moe_pallas.moe_pallas(x, lg, b, g, u, d, layer=jnp.int32(2),
                                                                         route=route), x, lg, b, g, g, d)
  assert txt.count("__gpu$xla.gpu.triton") == 2
  g, d = _abstract_qtensor("IQ3_S", (64, 768, 2048)), _abstract_qtensor("Q4_K", (64, 2048, 768))
  for ks in (1, 4):                    # expert parallel: pairs with a negative id skipped (a branch per program)
    txt = _lower(platform, lambda x, i, w, g, u, d: moe_pallas.moe_pallas(
        x, i, w, g, u, d, tuning=moe_pallas.Tuning(ks=ks), skip=True), x, ids, w, g, g, d)
    assert txt.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize("platform", list(DEVICES))
@pytest.mark.parametrize("qtype", ["Q8_0", "IQ3_S", "Q4_K"])
def test_x8_tiles_lower(qtype, platform):
  """The 8-bit x tiles (ops/dot8) lower in the MoE's gate/up and the projection kernel: the PTX dp4a on CUDA, its
  int32 form on both platforms."""
  g, d = _abstract_qtensor(qtype, (64, 768, 2048)), _abstract_qtensor("Q4_K", (64, 2048, 768))
  x = jax.ShapeDtypeStruct((1, 2048), jnp.float32)
  ids, w = jax.ShapeDtypeStruct((1, 8), jnp.int32), jax.ShapeDtypeStruct((1, 8), jnp.float32)
  for x8 in ("dp4a", "int") if platform == "cuda" else ("int",):
    t = qmatmul_pallas.Tuning(x8=x8)
    txt = _lower(platform, lambda x, i, w, g, u, d: moe_pallas.moe_pallas(
        x, i, w, g, u, d, tuning=moe_pallas.Tuning(gateup=t)), x, ids, w, g, g, d)
    assert txt.count("__gpu$xla.gpu.triton") == 2
    if qtype != "Q8_0":             # down on 8-bit h too (gate/up's epilogue rounds it: BN 32); Q4_K down
      both = moe_pallas.Tuning(gateup=t._replace(BN=32), down=qmatmul_pallas.Tuning(x8=x8))
      txt = _lower(platform, lambda x, i, w, g, u, d: moe_pallas.moe_pallas(x, i, w, g, u, d, tuning=both),
                   x, ids, w, g, g, d)
      assert txt.count("__gpu$xla.gpu.triton") == 2
    x4 = jax.ShapeDtypeStruct((4, 2048), jnp.float32)
    txt = _lower(platform, lambda x, w: qmatmul_pallas.qmatmul_pallas(x, w, tuning=t), x4,
                 _abstract_qtensor(qtype, (5120, 2048)))
    assert "__gpu$xla.gpu.triton" in txt


@pytest.fixture(params=["f32", "bf16"])
def precision(request):
  """The prefill GEMM's float32-accurate form (the CPU default) and the one-MMA form a GPU takes by default."""
  return request.param


@pytest.mark.parametrize("platform", list(DEVICES))
@pytest.mark.parametrize("qtype", qmatmul_pallas.KERNEL_TYPES)
def test_qgemm_lowers(qtype, platform, precision):
  """The tensor-core GEMM for prefill rows (bf16 dots of dequantized pieces) lowers for both GPU platforms."""
  w = _abstract_qtensor(qtype, (5120, 2048))
  x = jax.ShapeDtypeStruct((100, 2048), jnp.float32)
  txt = _lower(platform, lambda x, w: qgemm_pallas.qgemm_pallas(x, w, precision=precision), x, w)
  assert txt.count("__gpu$xla.gpu.triton") == 1


def _triton_ir(txt: str, name: str) -> str:
  """The serialized Triton module of kernel `name` in a lowered module's text (its `ir` attribute)."""
  end = txt.index(f'", name = "{name}"')
  return txt[txt.rindex('ir = "', 0, end) + 6:end]


@pytest.mark.parametrize("platform", list(DEVICES))
def test_qgemm_forms_lower_to_their_own_kernels(platform):
  """The precision reaches the kernel: bf16's Triton module (one bf16 dot per piece) is smaller than f32's (three
  dots accumulating), for a dense and a grouped GEMM."""
  w = _abstract_qtensor("Q8_0", (5120, 2048))
  x = jax.ShapeDtypeStruct((100, 2048), jnp.float32)
  ids = jax.ShapeDtypeStruct((100, 8), jnp.int32)
  wk = jax.ShapeDtypeStruct((100, 8), jnp.float32)
  g = _abstract_qtensor("IQ3_S", (128, 768, 2048))
  d = _abstract_qtensor("IQ3_S", (128, 2048, 768))
  size = {}
  for p in ("f32", "bf16"):
    dense = _lower(platform, lambda x, w: qgemm_pallas.qgemm_pallas(x, w, precision=p), x, w)
    grouped = _lower(platform, lambda x, i, w, g, u, d: moe_grouped_pallas.moe_grouped_pallas(x, i, w, g, u, d,
                                                                                           precision=p),
                     x, ids, wk, g, g, d)
    size[p] = len(_triton_ir(dense, "qgemm_q8_0")), len(_triton_ir(grouped, "qgemm_pair_iq3_s"))
  assert all(a < 0.9 * b for a, b in zip(size["bf16"], size["f32"])), size


@pytest.mark.parametrize("platform", list(DEVICES))
@pytest.mark.parametrize("gq,dq", [("IQ3_S", "IQ3_S"), ("Q4_K", "Q6_K"), ("Q8_0", "IQ4_XS")])
def test_moe_grouped_lowers(gq, dq, platform, precision):
  """The grouped prefill GEMM (row tiles of one expert) lowers for both GPU platforms."""
  g = _abstract_qtensor(gq, (128, 768, 2048))
  d = _abstract_qtensor(dq, (128, 2048, 768))
  x = jax.ShapeDtypeStruct((512, 2048), jnp.float32)
  ids = jax.ShapeDtypeStruct((512, 8), jnp.int32)
  w = jax.ShapeDtypeStruct((512, 8), jnp.float32)
  txt = _lower(platform, lambda x, i, w, g, u, d: moe_grouped_pallas.moe_grouped_pallas(x, i, w, g, u, d,
                                                                                         precision=precision),
               x, ids, w, g, g, d)
  assert txt.count("__gpu$xla.gpu.triton") == 2
