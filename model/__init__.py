"""model/: what a model is, read from a GGUF file.

`config.ModelConfig` (frozen, hashable), `gguf_io` (reading and validating GGUF files into a params pytree of
dense arrays and packed `QTensor`s), `tokenizer` (GGUF byte-level BPE), `transformer` (Flax Linen modules:
attention, MoE, dense MLP, block, decoder, NextN block), `api` (pure jitted prefill / decode_step / mtp_step),
`checkpoint` (orbax cache of the loaded params), `writer` (random tiny and full-size synthetic GGUF files).
"""
