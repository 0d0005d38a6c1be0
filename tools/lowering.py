"""Lowering a jitted function for an abstract GPU from this CPU-only jaxlib: the Triton IR Pallas emits for an
abstract CUDA device (H200) or ROCm device (MI300, gfx942), as the lowering tests (tests/ops/test_lowering.py) and
scripts/kernel_sass.py take it. `AbstractDevice` in an `AbstractMesh` under `use_abstract_mesh`, then
`jit(...).trace(...).lower(lowering_platforms=(...))`."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh

from ops import quant, repack
from ops.qtensor import QTensor

DEVICES = {"cuda": "NVIDIA H200", "rocm": "gfx942"}


def abstract_qtensor(qtype: str, shape) -> QTensor:
  """A QTensor of `qtype` and logical `shape` whose planes are ShapeDtypeStructs (nothing allocated)."""
  nb = shape[-1] // quant.GGML_TYPES[qtype][0]
  planes = tuple(jax.ShapeDtypeStruct((*shape[:-1], nb, *f.shape), jnp.dtype(f.dtype)) for f in repack.LAYOUTS[qtype])
  return QTensor(planes, qtype, shape[-1], "pallas")


def lower(platform: str, fn, *args) -> str:
  """The StableHLO text of jit(fn) lowered for `platform` ("cuda" | "rocm"), Pallas kernels as Triton custom calls."""
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(DEVICES[platform], None, platform))
  with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
    warnings.simplefilter("ignore", DeprecationWarning)       # the Pallas Triton backend warns it is deprecated
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
