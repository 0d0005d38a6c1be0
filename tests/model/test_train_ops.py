"""The training script's stand-in layer functions (model.options.LayerOps through Options, tools/train_default.py)
run the model's own modules: with a capacity that drops no token and one sequence on the token axis, the training
forward equals the inference forward (float32 operands), trunk and NextN block."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from configs.presets import TINY_GLM4MOE as CFG
from model.transformer import Decoder, MTPBlock
from tools import train_default as td


def test_training_stand_ins_equal_the_model_when_nothing_is_dropped():
  params = td.init_params(CFG, seed=0)
  trunk = {k: v for k, v in params.items() if not k.startswith("mtp_")}
  T = 12
  toks = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, T), jnp.int32)
  pos = jnp.arange(T, dtype=jnp.int32)
  want, hidden = Decoder(CFG).apply({"params": trunk}, toks, pos)[:2]
  mwant = MTPBlock(CFG, 0).apply({"params": params["mtp_0"]}, hidden, toks, pos, None, params["token_embd"],
                                 params["output"])[0]
  with td.training_context(capacity=float(CFG.n_experts), bf16=False) as ctx:   # capacity: every token kept
    ctx.seq_len = T
    got, h = Decoder(CFG, ctx.options).apply({"params": trunk}, toks, pos)[:2]
    mgot = MTPBlock(CFG, 0, ctx.options).apply({"params": params["mtp_0"]}, h, toks, pos, None,
                                               params["token_embd"], params["output"])[0]
    assert len(ctx.moe_stats) == sum(CFG.is_moe_layer(i) for i in range(CFG.n_blocks))
    assert all(float(drop) == 0.0 for _, drop in ctx.moe_stats)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(mgot), np.asarray(mwant), rtol=1e-4, atol=1e-4)
  # the stand-ins are really used: bf16 operands move the logits
  with td.training_context(capacity=float(CFG.n_experts), bf16=True) as ctx:
    ctx.seq_len = T
    b16 = Decoder(CFG, ctx.options).apply({"params": trunk}, toks, pos)[0]
  assert float(jnp.max(jnp.abs(b16 - want))) > 1e-5
