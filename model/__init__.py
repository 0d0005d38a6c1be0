"""model/: what a model is, read from a GGUF file, and the state its pure steps carry.

`config.ModelConfig` (what the model is: frozen, hashable) and `options.Options` (how it runs: glue kernels, the
idle-tier skip, prefill precision, kernel tuning), `gguf_io` (reading and validating GGUF files into a params pytree
of dense arrays and packed `QTensor`s), `tokenizer` (GGUF byte-level BPE), `transformer` (Flax Linen modules:
attention, block, decoder, NextN block; a block takes its layer's state and returns it), `ffn` (its FFNs: dense MLP
and MoE), `deltanet` (the hybrid family's Gated DeltaNet mixer), `api` (pure jitted prefill / decode_step /
mtp_step), `state` (`ModelState`: the K/V ring of `kv_ring`, the host tier of `host_tier`, the expert cache of
`expert_cache`), `checkpoint` (orbax cache of the loaded params), `loader`, `writer` (random tiny and full-size
synthetic GGUF files).
"""
