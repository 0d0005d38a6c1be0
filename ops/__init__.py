"""ops/: kernels beside their jnp references: quant formats, quantized matmul and MoE, attention, RoPE, RMSNorm."""
