"""ops/tuning: tunings are static values (hashable, equal by value), a Tuning sets only its fields over the kernel's
table, and the dispatchers pick each kernel's piece; the docstring examples of the modules that carry them run."""
from __future__ import annotations

import doctest
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops import attention_pallas, moe_pallas, qgemm_pallas, qmatmul_pallas
from ops.tuning import ByType, Tunings, fill, pick


def test_fill_sets_only_the_given_fields():
  table = qmatmul_pallas.TUNING["Q4_K"]
  assert fill(None, table) == table
  got = fill(qmatmul_pallas.Tuning(S=4, natural_b=0), table)
  assert (got.S, got.natural_b) == (4, 0)
  assert got._replace(S=table.S, natural_b=table.natural_b) == table


def test_tunings_are_hashable_values_and_pick_by_type():
  a = Tunings(qmatmul=ByType(Q4_K=qmatmul_pallas.Tuning(S=4)), attention=attention_pallas.Tuning(bk=32))
  b = Tunings(qmatmul=ByType(Q4_K=qmatmul_pallas.Tuning(S=4)), attention=attention_pallas.Tuning(bk=32))
  assert a == b and hash(a) == hash(b) and a != Tunings()
  assert a.pick("qmatmul", "Q4_K") == qmatmul_pallas.Tuning(S=4) and a.pick("qmatmul", "Q8_0") is None
  every = Tunings(qgemm=qgemm_pallas.Tuning(BN=32))              # one value: every type
  assert every.pick("qgemm", "IQ3_S") == every.pick("qgemm", "Q8_0") == qgemm_pallas.Tuning(BN=32)
  assert pick(None, "moe", "Q4_K") is None and pick(a, "attention") == attention_pallas.Tuning(bk=32)
  assert a.replace(attention=None) == Tunings(qmatmul=a.qmatmul)
  with pytest.raises(ValueError, match="prefill_attention_impl"):
    Tunings(prefill_attention_impl="cuda")


def test_a_tuning_is_a_jit_static_argument():
  """Two tunings trace twice, the same tuning once: the jit cache keys on the value (nothing to clear)."""
  traces = []

  @functools.partial(jax.jit, static_argnames=("tuning",))
  def g(x, *, tuning):
    traces.append(tuning)
    return x * tuning.S

  x = jnp.ones(3)
  for t in (qmatmul_pallas.Tuning(S=2), qmatmul_pallas.Tuning(S=2), qmatmul_pallas.Tuning(S=3)):
    g(x, tuning=t)
  assert traces == [qmatmul_pallas.Tuning(S=2), qmatmul_pallas.Tuning(S=3)]
  np.testing.assert_array_equal(np.asarray(g(x, tuning=qmatmul_pallas.Tuning(S=3))), 3 * np.ones(3))
  assert moe_pallas.Tuning(ks=2) == moe_pallas.Tuning(ks=2) and hash(moe_pallas.Tuning(ks=2)) is not None


@pytest.mark.parametrize("module", ["ops.tuning", "ops.qgemm_pallas", "ops.prefill_attention_pallas", "model.host_tier",
                                    "ops.attention"])
def test_docstring_examples_run(module):
  res = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert res.failed == 0 and res.attempted > 0
