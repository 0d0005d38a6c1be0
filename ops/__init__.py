"""ops/: kernels beside their jnp references: quant formats and repacked planes, quantized matmul and MoE for
decode (Pallas Triton FMA kernels, with a stacked-layer entry; `dot8`: tiles on 8-bit x with integer dots, an A/B
of the routed experts' gate/up, whose x the RMSNorm kernel before them rounds) and for prefill (tensor-core GEMMs over
dequantized pieces: `qgemm_pallas`, `moe_grouped_pallas`), attention over the KV ring (decode: `attention_pallas`;
prefill: `prefill_attention_pallas`, the GPU default since it was measured), RoPE, RMSNorm, the per-token glue
kernels of decode and verify passes (`rmsnorm_pallas`, `router_pallas`, `rope_write_pallas`: batch-invariant
norms, routing and ring writes; `norm_router_pallas`: the FFN norm and the router logits in one launch, and
`rope_attention_pallas`: RoPE and the ring write inside the decode attention kernel, two of the launch fusions
`Tunings.fuse` names). Each kernel's tuning is a static argument over its table (`ops/tuning.py`); the
kernel benchmarks live in the top-level `bench/` package. ops/ imports nothing above it."""
import jax


def on_gpu() -> bool:
  """Whether jax runs on a GPU backend (CUDA or ROCm): where the Pallas kernels compile rather than interpret."""
  return jax.default_backend() in ("gpu", "cuda", "rocm")


def _preload_pallas_interpreter() -> None:
  """Import Pallas' interpreter now rather than at the first `pallas_call(interpret=True)` trace: importing it adds a
  value to jax's tracing context, so a function traced before it (a prefill chunk) misses the cache once after it
  and compiles again (seen on CPU: 21 s for a tiny model's second chunk). A private module: skipped if it moves."""
  try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # noqa: F401
  except ImportError:
    pass


_preload_pallas_interpreter()
