"""decode/: everything around the model's pure step functions.

The KV ring (`kv_ring`) and its host tier (`host_tier`), the memory plan (`kv_plan`), the expert cache
(`expert_cache`), samplers, drafters (MTP, lookup, replay), verification and the round loop (`speculative`), the
bytes-per-round model (`round_model`), the engine (requests, per-request ring size) and the absl CLIs `generate`,
`bench` (arms x seeds cells) and `bench_step` (decode step time against ring capacity and depth).
"""
