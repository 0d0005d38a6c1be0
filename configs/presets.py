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

# Full-size shapes (synthetic files: configs/synth.py).
QWEN3MOE_30B_A3B = ModelConfig(
    arch="qwen3moe", vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    rope_dim=128, rope_theta=1e6, rms_eps=1e-6, n_experts=128, top_k=8, d_ff_expert=768, routing="softmax",
    norm_topk=True, qk_norm=True, context_length=262144)

# The seed report's model: 48 layers, 512 experts top-10 plus a shared expert, one NextN block (glm4moe).
SEED_MTP = ModelConfig(
    arch="glm4moe", vocab_size=151552, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    rope_dim=64, rope_theta=1e6, rms_eps=1e-6, n_experts=512, top_k=10, d_ff_expert=512, n_shared_experts=1,
    d_ff_shared=512, routing="sigmoid", norm_topk=True, routed_scale=2.5, qk_norm=True, n_nextn=1,
    context_length=262144)

GLM45_AIR = ModelConfig(
    arch="glm4moe", vocab_size=151552, d_model=4096, n_layers=46, n_heads=96, n_kv_heads=8, head_dim=128,
    rope_dim=64, rope_theta=1e6, rms_eps=1e-5, n_experts=128, top_k=8, d_ff_expert=1408, d_ff=10944,
    n_dense_lead=1, n_shared_experts=1, d_ff_shared=1408, routing="sigmoid", norm_topk=True, routed_scale=1.0,
    qkv_bias=True, n_nextn=1, context_length=131072)

PRESETS: dict[str, ModelConfig] = {
    "tiny-qwen3moe": TINY_QWEN3MOE, "tiny-qwen2moe": TINY_QWEN2MOE, "tiny-glm4moe": TINY_GLM4MOE,
    "qwen3moe-30b-a3b": QWEN3MOE_30B_A3B, "seed-mtp": SEED_MTP, "glm45-air": GLM45_AIR,
}


def preset(name: str) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
  return PRESETS[name]
