"""Model-shape presets: tiny test models and the full-size shapes the benchmarks use."""
from __future__ import annotations

from model.config import ModelConfig

# Tiny models: hidden 256 so every row holds whole 256-value quant blocks; head_dim a multiple of 32.
TINY_QWEN3MOE = ModelConfig(
    arch="qwen3moe", vocab_size=1024, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, rope_dim=64,
    rope_theta=10000.0, rms_eps=1e-6, n_experts=8, top_k=2, d_ff_expert=256, routing="softmax", norm_topk=True,
    qk_norm=True, context_length=4096)

TINY_QWEN2MOE = ModelConfig(
    arch="qwen2moe", vocab_size=1024, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, rope_dim=64,
    rope_theta=10000.0, rms_eps=1e-6, n_experts=8, top_k=2, d_ff_expert=256, routing="softmax", norm_topk=False,
    n_shared_experts=1, d_ff_shared=512, shared_expert_gate=True, qkv_bias=True, context_length=4096)

TINY_GLM4MOE = ModelConfig(
    arch="glm4moe", vocab_size=1024, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, rope_dim=32,
    rope_theta=10000.0, rms_eps=1e-5, n_experts=8, top_k=2, d_ff_expert=256, d_ff=512, n_dense_lead=1,
    n_shared_experts=1, d_ff_shared=256, routing="sigmoid", norm_topk=True, routed_scale=2.5, qkv_bias=True,
    n_nextn=1, context_length=4096)

# Hybrid family (Gated DeltaNet + gated attention; llama.cpp 0.3.36 qwen3next.cpp / qwen35moe.cpp). Two key heads
# and four value heads, so the value -> key head mapping matters (grouped for qwen3next, tiled for qwen35moe);
# hidden 256 and Hv Dv = H Dh = 256 so every row holds whole 256-value quant blocks.
_TINY_HYBRID = dict(
    vocab_size=1024, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, rope_dim=16, rope_theta=10000.0, rms_eps=1e-6,
    n_experts=8, top_k=2, d_ff_expert=256, n_shared_experts=1, d_ff_shared=256, shared_expert_gate=True,
    routing="softmax", norm_topk=True, qk_norm=True, attn_output_gate=True, n_nextn=1, ssm_conv_kernel=4,
    ssm_inner=256, ssm_state=64, ssm_dt_rank=4, ssm_groups=2, context_length=4096)

# full_attention_interval 4: layers 0-2 Gated DeltaNet, layer 3 attention; rotary 16 of 64 (0.25, as the real model).
TINY_QWEN3NEXT = ModelConfig(arch="qwen3next", n_layers=4, recurrent=(True, True, True, False), **_TINY_HYBRID)

# A layout no interval gives (the file carries attention.recurrent_layers), two attention layers, and M-RoPE
# sections (sum 6 over 8 rotary pairs) for which llama.cpp's IMROPE leaves pairs 4 and 5 unrotated on text
# positions (ModelConfig.rope_text_pairs): treating the file as NEOX moves its logits visibly.
TINY_QWEN35MOE = ModelConfig(arch="qwen35moe", n_layers=5, recurrent=(True, True, False, True, False),
                             rope_mode="imrope", rope_sections=(4, 1, 1, 0), **_TINY_HYBRID)

# Full-size shapes (synthetic files: configs/synth.py).
QWEN3MOE_30B_A3B = ModelConfig(
    arch="qwen3moe", vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    rope_dim=128, rope_theta=1e6, rms_eps=1e-6, n_experts=128, top_k=8, d_ff_expert=768, routing="softmax",
    norm_topk=True, qk_norm=True, context_length=262144)

# The glm4moe stand-in of the seed report's model (every layer full attention; the seed experiment's tables in
# docs/PERF.md before the hybrid family loaded were measured on it): 48 layers, 512 experts top-10 plus a shared
# expert, one NextN block. `seed-mtp` is now the model itself, QWEN3NEXT_80B_A3B.
SEED_MTP_GLM4MOE = ModelConfig(
    arch="glm4moe", vocab_size=151552, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    rope_dim=64, rope_theta=1e6, rms_eps=1e-6, n_experts=512, top_k=10, d_ff_expert=512, n_shared_experts=1,
    d_ff_shared=512, routing="sigmoid", norm_topk=True, routed_scale=2.5, qk_norm=True, n_nextn=1,
    context_length=262144)

# The seed report's model as it is (HF Qwen/Qwen3-Next-80B-A3B config): 48 layers, one full-attention layer in four,
# 16 q / 2 kv heads of 256 with gated output, rotary 64 of 256 (partial_rotary_factor 0.25), theta 1e7; Gated
# DeltaNet 16 key / 32 value heads of 128, conv kernel 4; 512 experts top-10 of FFN 512 plus a gated shared expert
# of 512; one MTP block.
QWEN3NEXT_80B_A3B = ModelConfig(
    arch="qwen3next", vocab_size=151936, d_model=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256,
    rope_dim=64, rope_theta=1e7, rms_eps=1e-6, n_experts=512, top_k=10, d_ff_expert=512, n_shared_experts=1,
    d_ff_shared=512, shared_expert_gate=True, routing="softmax", norm_topk=True, qk_norm=True, attn_output_gate=True,
    n_nextn=1, recurrent=tuple((i + 1) % 4 != 0 for i in range(48)), ssm_conv_kernel=4, ssm_inner=4096,
    ssm_state=128, ssm_dt_rank=32, ssm_groups=16, context_length=262144)

GLM45_AIR = ModelConfig(
    arch="glm4moe", vocab_size=151552, d_model=4096, n_layers=46, n_heads=96, n_kv_heads=8, head_dim=128,
    rope_dim=64, rope_theta=1e6, rms_eps=1e-5, n_experts=128, top_k=8, d_ff_expert=1408, d_ff=10944,
    n_dense_lead=1, n_shared_experts=1, d_ff_shared=1408, routing="sigmoid", norm_topk=True, routed_scale=1.0,
    qkv_bias=True, n_nextn=1, context_length=131072)

# GLM-4.5 (355B-A32B), the shape of zai-org/GLM-4.5's published config, as found (search corpora, 2026-12-03):
# - 92 layers of which the first 3 dense (first_k_dense_replace 3), hidden 5120, dense FFN 12288, 96 query / 8 KV heads
#   of 128 with q/k/v bias and per-head q/k RMSNorm, rotary over half of each head (0.5: 64 of 128), theta 1e6, vocab
#   151552, untied head; 160 routed experts of FFN 1536, top-8, sigmoid scores with a selection bias (noaux_tc),
#   routed_scaling 2.5, one shared expert of 1536: the slime RL framework's scripts/models/glm4.5-355B-A32B.sh
#   (its Megatron args, as stored in zyzshishui/slime), agreeing with transcriptions of the config.json in tests of
#   other projects;
# - RMSNorm eps 1e-5, top-k renormalised, head_dim 128, 1 shared expert: llama.cpp PR #15026's notes on both GLM-4.5
#   models (one test mock elsewhere says 1e-6; 1e-5 is what the Air preset above and llama.cpp's notes give);
# - one NextN (MTP) layer (num_nextn_predict_layers 1, block_count 93 in GGUF) and context 131072
#   (max_position_embeddings): config transcriptions of this 355B shape (found for GLM-4.5 and GLM-4.7 alike).
# Counted from these shapes (tests/model/test_mesh.py): 356.8B params with the NextN block, 352.8B without, 32.9B
# active per token (the published 355B-A32B); IQ3_S routed experts alone are 146 GB, more than one H200 holds.
GLM45_355B_A32B = ModelConfig(
    arch="glm4moe", vocab_size=151552, d_model=5120, n_layers=92, n_heads=96, n_kv_heads=8, head_dim=128,
    rope_dim=64, rope_theta=1e6, rms_eps=1e-5, n_experts=160, top_k=8, d_ff_expert=1536, d_ff=12288,
    n_dense_lead=3, n_shared_experts=1, d_ff_shared=1536, routing="sigmoid", norm_topk=True, routed_scale=2.5,
    qk_norm=True, qkv_bias=True, n_nextn=1, context_length=131072)

PRESETS: dict[str, ModelConfig] = {
    "tiny-qwen3moe": TINY_QWEN3MOE, "tiny-qwen2moe": TINY_QWEN2MOE, "tiny-glm4moe": TINY_GLM4MOE,
    "tiny-qwen3next": TINY_QWEN3NEXT, "tiny-qwen35moe": TINY_QWEN35MOE,
    "qwen3moe-30b-a3b": QWEN3MOE_30B_A3B, "qwen3next-80b-a3b": QWEN3NEXT_80B_A3B,
    "seed-mtp": QWEN3NEXT_80B_A3B, "seed-mtp-glm4moe": SEED_MTP_GLM4MOE,
    "glm45-air": GLM45_AIR, "glm45-355b-a32b": GLM45_355B_A32B,
}


def preset(name: str) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
  return PRESETS[name]
