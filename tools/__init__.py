"""tools/: what the tests and the training script share, outside the product packages: llama.cpp as the reference
engine (`llama_ref`: logits, greedy tokens, its quantizer), the default models' training scripts
(`train_default`, `train_hybrid`) and lowering for an abstract GPU (`lowering`: the lowering tests and
scripts/kernel_sass.py). No product module imports it."""
