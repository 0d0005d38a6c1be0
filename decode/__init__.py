"""decode/: everything around the model's pure step functions.

The memory plan (`kv_plan`), samplers (`sampling`), drafters (MTP, lookup, replay: `drafters`), verification and
the round loop (`speculative`), the engine (requests, per-request ring size, the plain decode loop: `engine`) and
the absl CLI `generate`. The state the steps carry (ring, host tier, expert cache) is the model's (model/state.py).
"""
