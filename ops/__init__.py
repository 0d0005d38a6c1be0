"""ops/: kernels beside their jnp references: quant formats and repacked planes, quantized matmul and MoE (Pallas
Triton, with a stacked-layer entry), decode attention over the KV ring, RoPE, RMSNorm, and the kernel benchmarks
(`bench`, `bench_attention`)."""
