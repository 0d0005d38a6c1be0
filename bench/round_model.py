"""Bytes-per-round model of speculative decoding: what a verify round reads against a plain step.

Decoding one token at batch 1 is memory-bound: a plain step reads every weight of the main model once (the token
embedding only one row), the routed experts of that token (top_k per MoE layer) and the K/V of the live
positions. A verify round of k drafts runs the main model on k + 1 tokens, reading the same weights once but the
*union* of the k + 1 tokens' experts: up to (k + 1) * top_k per layer (for k >= 4 once per pass: the engine
verifies at most decode.speculative.VERIFY_ROWS tokens a pass). With routing spread uniformly over E
experts, a layer's expected number of distinct experts is E * (1 - (1 - top_k / E) ** (k + 1)); real routers are
more concentrated, so this is an upper estimate of the union. An MTP drafter adds k steps of the NextN block (its
attention, its routed experts and the output head); lookup and replay drafts cost no weights.

If time were proportional to bytes, the speed-up over plain decoding at an acceptance giving `tokens` per round
would be tokens * step_bytes / round_bytes: `bytes_model` gives those numbers for a loaded model's params, so a
benchmark can print measured speed-ups beside them (bench/cells.py). A measured speed-up above the model means
the step is not bandwidth-bound (launch latency, which a round amortises over k + 1 tokens); below it means the
verify pass or the drafter costs more than its bytes.

>>> round(expected_distinct(128, 8, 4), 2)     # 4 tokens x top-8 of 128 experts: 29.1 distinct, not 32
29.12
"""
from __future__ import annotations

import jax

from model.config import ModelConfig


def expected_distinct(n_experts: int, top_k: int, tokens: int) -> float:
  """Expected number of distinct experts picked by `tokens` independent uniform top-k draws from n_experts."""
  return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def _nbytes(x) -> int:
  from ops.qtensor import QTensor
  return x.nbytes if isinstance(x, QTensor) else int(x.size * x.dtype.itemsize)


def weight_groups(params, cfg: ModelConfig) -> dict[str, int]:
  """Bytes of the params by how a step reads them: main non-expert weights (embedding table excluded), one
  expert's gate+up+down summed over the main MoE layers (`expert_per_layer_sum`: the bytes of picking one expert
  in every MoE layer), one embedding row, the NextN block (non-expert) and one NextN expert, the output head."""
  from ops.qtensor import QTensor
  g = dict(main=0, expert_per_layer_sum=0, embed_row=0, nextn=0, nextn_expert=0, head=0)
  for path, x in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda v: isinstance(v, QTensor)):
    key = jax.tree_util.keystr(path)
    b = _nbytes(x)
    if "token_embd" in key:
      g["embed_row"] += b // cfg.vocab_size
    elif key.startswith("['mtp_") and "_exps" in key:
      g["nextn_expert"] += b // cfg.n_experts
    elif key.startswith("['mtp_"):
      g["nextn"] += b
    elif "_exps" in key:
      g["expert_per_layer_sum"] += b // cfg.n_experts
    else:
      g["main"] += b
      if key.startswith("['output']"):
        g["head"] += b
  return g


def bytes_model(params, cfg: ModelConfig, k: int, drafter: str, kv_bytes: int = 0) -> dict:
  """Bytes of a plain step and of a verify round with k drafts from `drafter` (mtp | lookup | replay), plus the
  speed-up the byte ratio predicts for 1 .. k + 1 tokens per round. kv_bytes: K/V bytes read per token position
  step (added to both; a round reads the cache once per verify pass)."""
  from decode.speculative import verify_chunks
  g = weight_groups(params, cfg)
  E, K = cfg.n_experts, cfg.top_k
  step = g["main"] + K * g["expert_per_layer_sum"] + g["embed_row"] + kv_bytes
  verify = sum(g["main"] + expected_distinct(E, K, n) * g["expert_per_layer_sum"] + n * g["embed_row"] + kv_bytes
               for _, n in verify_chunks(k + 1))
  draft = 0.0
  if drafter == "mtp":   # each draft: the NextN block with its own routed experts, then the output head
    draft = k * (g["nextn"] + K * g["nextn_expert"] + g["head"] + g["embed_row"])
  rnd = verify + draft
  return {"step_bytes": step, "verify_bytes": verify, "draft_bytes": draft, "round_bytes": rnd,
          "round_over_step": rnd / step,
          "predicted_speedup": {n: n * step / rnd for n in range(1, k + 2)}}
