# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # moejax quickstart
#
# Load the embedded default model (a tiny glm4moe + NextN model), generate with and without MTP drafts,
# look at the memory plan, and plot how often each draft position is accepted. Opens as a notebook through
# jupytext (`jupytext --to notebook examples/quickstart.py`) and runs as a plain script.

# %%
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))) if "__file__" in globals() else ".")

from decode.engine import generate
from decode.kv_plan import plan_request
from decode.speculative import speculative_generate
from configs.default import default_model_path
from model.loader import load_model

model = load_model(default_model_path())
print(model.cfg)

# %% [markdown]
# ## Plain greedy decoding

# %%
prompt = model.tokenizer.encode("The module")
plain = generate(model, prompt, max_new_tokens=48)
print(repr(plain.text))
print({k: plain.stats[k] for k in ("generated_tokens", "decode_tok_s", "kv_resident")})

# %% [markdown]
# ## MTP speculative decoding: same tokens, fewer rounds

# %%
mtp = speculative_generate(model, prompt, drafter="mtp", k=3, max_new_tokens=48)
assert mtp.ids == plain.ids, "greedy speculative decoding must emit the plain greedy tokens"
print(f"rounds {mtp.stats['rounds']} for {len(mtp.ids)} tokens, acceptance {mtp.stats['acceptance']:.0%}")
print("accepted per draft position:", mtp.stats["drafts_accepted"], "of", mtp.stats["drafts_proposed"])

# %% [markdown]
# ## The memory plan

# %%
plan, slots = plan_request(model, ring=1024, kv="int8", max_context=None, mtp_window=4096, k=3)
print(plan.table())

# %% [markdown]
# ## Acceptance per draft position

# %%
import matplotlib

if "ipykernel" not in sys.modules:
  matplotlib.use("Agg")
import matplotlib.pyplot as plt

acc = [a / p if p else 0.0 for a, p in zip(mtp.stats["drafts_accepted"], mtp.stats["drafts_proposed"])]
fig, ax = plt.subplots(figsize=(4, 3))
ax.bar([f"d{i + 1}" for i in range(len(acc))], acc)
ax.set_ylim(0, 1)
ax.set_ylabel("accepted / proposed")
ax.set_title("MTP drafts accepted per position")
fig.tight_layout()
out = os.environ.get("QUICKSTART_PNG", "/tmp/quickstart_acceptance.png")
fig.savefig(out)
print("plot:", out)
