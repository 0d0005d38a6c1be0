"""What the model's Flax modules share: parameter lookup and initializers, and the dispatch of a layer function
to the caller's stand-in (`Options.layer_ops`) or to the model's own with its kernel tuning."""
from __future__ import annotations

import functools

import jax
from flax import linen as nn

from model.options import Options
from ops import moe as moe_ops
from ops.layers import linear
from ops.qtensor import QTensor
from ops.tuning import DEFAULT as TUNINGS

_init = nn.initializers.normal(0.02)
_ones = nn.initializers.ones
_zeros = nn.initializers.zeros


def _param(m: nn.Module, name: str, init, shape):
  """m.param, but a loaded param (possibly a packed QTensor, whose leaf is its byte array) is taken as is:
  the loader already checked its logical shape against the GGUF file."""
  if m.has_variable("params", name):
    return m.get_variable("params", name)
  return m.param(name, init, shape)


def _op(opts: Options, name: str, own):
  """The model's layer function `own` with opts' kernel tuning and prefill precision, or the caller's stand-in
  for it (opts.layer_ops)."""
  alt = getattr(opts.layer_ops, name) if opts.layer_ops is not None else None
  if alt is not None:
    return alt
  if own is linear or own is moe_ops.moe:
    return functools.partial(own, tunings=opts.tunings, precision=opts.prefill_precision)
  return own


def x8_kw(x8) -> dict:
  """A layer function's x8 argument (x rounded to 8 bits by the norm before: ops.dot8.X8) where the norm made one:
  only the model's own layer functions are given one (a stand-in, opts.layer_ops, never is)."""
  return {} if x8 is None else {"x8": x8}


def fuses(opts: Options, name: str) -> bool:
  """Whether opts' tunings (None: ops.tuning.DEFAULT, every fusion) ask for launch fusion `name`
  (ops.tuning.FUSIONS, `Tunings.fuse`)."""
  return name in (opts.tunings or TUNINGS).fuse


def kernel_mode(tree) -> str:
  """"pallas" | "interpret" when the first QTensor in `tree` runs that kernel mode, else "ref" (dense weights, or
  the XLA reference: `--kernels xla`)."""
  for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda v: isinstance(v, QTensor)):
    if isinstance(leaf, QTensor):
      return leaf.kernel if leaf.kernel in ("pallas", "interpret") else "ref"
  return "ref"
