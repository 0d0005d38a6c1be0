"""decode/: everything around the model's pure step functions.

The KV ring (`kv_ring`), memory plan, expert cache, samplers, drafters (MTP, lookup, replay), verification,
the engine (requests, per-request ring size) and the absl CLIs `generate` and `bench`.
"""
