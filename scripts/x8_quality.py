"""What x8 (ops/dot8: the decode kernels on x rounded to 8 bits per 32 values) does to a trained model's
predictions, measured on CPU in interpret mode: held-out windows of the training text (tools/train_default's split)
run teacher-forced through the decode path in passes of 16 tokens (T <= 16: the kernels x8 applies to), once per
variant, and each variant's logits are compared with the float tiles' and with llama.cpp's (llama-cpp-python, CPU,
the same file, which rounds activations to 8 bits as well: q8_0 / q8_K):

  python scripts/x8_quality.py [--gguf configs/data/default.gguf] [--windows 4] [--length 128]
      [--variants float,x8,x8+dx8,x8+px8]

Prints per variant: held-out loss (nats/token), its difference to the float tiles', the share of positions whose
argmax equals the float tiles', and the relative L2 distance of the logits to the float tiles' and to llama.cpp's.
A dev tool for the x8 default's quality question (docs/PERF.md "Integer dots on 8-bit x on the GPU"); not run by
the tests. x8 variants: `x8` the routed experts' gate/up (the norm kernel rounds x), `x8+dx8` their down too (on h
rounded by gate/up), `x8+px8` gate/up and the projections.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tools/ is not an installed package

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model import api  # noqa: E402
from model.loader import load_model  # noqa: E402
from model.options import Options  # noqa: E402
from ops import dot8, moe_pallas, qmatmul_pallas  # noqa: E402
from ops.qtensor import with_kernels  # noqa: E402
from ops.tuning import ByType, Tunings  # noqa: E402
from tools import llama_ref  # noqa: E402
from tools.train_default import heldout_windows  # noqa: E402

PASS = 16


def options(variant: str) -> Options:
  x8 = qmatmul_pallas.Tuning(x8="int")                 # interpret mode runs the int32 form whatever the name
  if variant == "float":
    return Options()
  if variant == "x8":
    return Options(tunings=Tunings(moe=ByType(**{q: moe_pallas.Tuning(gateup=x8) for q in dot8.TILES})))
  if variant == "x8+dx8":
    down = qmatmul_pallas.Tuning(x8="int")
    gate = x8._replace(BN=32, programs=0)
    return Options(tunings=Tunings(moe=ByType(**{q: moe_pallas.Tuning(gateup=gate, down=down) for q in dot8.TILES})))
  if variant == "x8+px8":
    return Options(tunings=Tunings(moe=ByType(**{q: moe_pallas.Tuning(gateup=x8) for q in dot8.TILES}),
                                   qmatmul=ByType(**{q: x8 for q in dot8.TILES})))
  raise SystemExit(f"x8_quality: variant {variant!r}, expected float, x8, x8+dx8 or x8+px8")


def teacher_forced(m, params, win, opts) -> np.ndarray:
  """Logits [L, V] of window `win` through passes of PASS tokens (the decode kernels), float64."""
  st = api.init_state(m.cfg, 1 << max(8, (len(win) - 1).bit_length()), "f32")
  f = jax.jit(lambda p, t, s: api.forward(p, t, s, cfg=m.cfg, options=opts)[::2])
  out = []
  for i in range(0, len(win), PASS):
    lg, st = f(params, jnp.asarray(win[i:i + PASS], jnp.int32), st)
    out.append(np.asarray(lg, np.float64))
  return np.concatenate(out)


def nll(logits, win) -> np.ndarray:
  lp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) - \
      logits.max(-1, keepdims=True)
  return -lp[np.arange(len(win) - 1), win[1:]]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--gguf", default="configs/data/default.gguf")
  ap.add_argument("--windows", type=int, default=4)
  ap.add_argument("--length", type=int, default=128)
  ap.add_argument("--variants", default="float,x8,x8+dx8,x8+px8")
  a = ap.parse_args()
  if a.length % PASS:
    raise SystemExit(f"x8_quality: --length {a.length}, expected a multiple of {PASS}")
  m = load_model(a.gguf)
  params = with_kernels(m.params, "interpret")
  wins = heldout_windows(a.length, m.cfg.vocab_size)[:a.windows]
  theirs = [llama_ref.logits(a.gguf, [int(t) for t in w], n_ctx=a.length).astype(np.float64) for w in wins]
  variants = a.variants.split(",")
  got = {v: [teacher_forced(m, params, w, options(v)) for w in wins] for v in variants}
  base = got.get("float")
  print(f"{a.gguf}: {len(wins)} held-out windows x {a.length} tokens, passes of {PASS} (interpret mode)")
  print("| variant | held-out loss | vs float | argmax = float's | rel L2 to float | rel L2 to llama.cpp |")
  print("| --- | ---: | ---: | ---: | ---: | ---: |")
  loss0 = None
  for v in variants:
    loss = float(np.mean(np.concatenate([nll(lg, w) for lg, w in zip(got[v], wins)])))
    loss0 = loss if v == "float" else loss0
    same = (float(np.mean(np.concatenate([g.argmax(-1) == b.argmax(-1) for g, b in zip(got[v], base)])))
            if base is not None else float("nan"))
    to_f = (np.mean([llama_ref.rel_l2(g, b) for g, b in zip(got[v], base)]) if base is not None else float("nan"))
    to_l = np.mean([llama_ref.rel_l2(g, t) for g, t in zip(got[v], theirs)])
    d = f"{loss - loss0:+.4f}" if loss0 is not None else "-"
    print(f"| {v} | {loss:.4f} | {d} | {same:.4f} | {to_f:.2e} | {to_l:.2e} |", flush=True)
  ll = float(np.mean(np.concatenate([nll(t, w) for t, w in zip(theirs, wins)])))
  print(f"| llama.cpp (CPU) | {ll:.4f} | {ll - loss0:+.4f} | | | |" if loss0 is not None else f"llama.cpp {ll:.4f}")


if __name__ == "__main__":
  main()
