"""tools/: what the tests and the training script share, outside the product packages: llama.cpp as the reference
engine (`llama_ref`: logits, greedy tokens, its quantizer) and the default model's training script
(`train_default`). No product module imports it."""
