"""What the decode loop's per-step host sync costs (issue 27: the step's gaps), on a full-size shape.

`decode.engine.decode_loop` is a `lax.while_loop` whose predicate (n < n_max and not done) is data dependent, so
XLA's GPU runtime copies it to the host after every step before it launches the next one: the device drains once a
step. A loop of a static trip count needs no such copy. This times, in one process on the same params and ring,
plain greedy steps (the engine's body: forward, finite check, sample) in

  while    decode_loop itself (the dynamic bound), and
  fixed    a `lax.fori_loop` of the same body with a static count (no EOS or bound test),

and prints ms per step of each, median of `--repeats`. The difference is what a loop that tests its bound every
N > 1 steps could win at most (such a loop must then make the steps past EOS leave the state untouched).

  python3 scripts/gpu/loop_sync_probe.py --preset seed-mtp --depth 1024 --steps 64
"""
import argparse
import time


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="seed-mtp")
  ap.add_argument("--depth", type=int, default=1024)
  ap.add_argument("--ring", type=int, default=4096)
  ap.add_argument("--steps", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--kernels", default="pallas")
  a = ap.parse_args()
  import functools

  import jax
  import jax.numpy as jnp

  from bench.step import fill_ring
  from configs.presets import preset
  from decode.engine import LoopState, decode_loop
  from decode.sampling import sample
  from model import api
  from model.api import fuse_qkv
  from model.kv_ring import KVRing
  from model.options import DEFAULT
  from model.recurrent import RecurrentState
  from model.writer import quant_policy, random_params
  from ops.qtensor import with_kernels

  cfg = preset(a.preset)
  params = with_kernels(fuse_qkv(random_params(cfg, types=quant_policy("IQ3_S", "Q8_0"))), a.kernels)

  @functools.partial(jax.jit, static_argnames=("steps",), donate_argnames=("ls",))
  def fixed_loop(params, ls, *, steps):
    def body(_, s):
      logits, _, model = api.forward(params, s.token[None], s.model, cfg=cfg, options=DEFAULT)
      ok = jnp.all(jnp.isfinite(logits[0]))
      key, sub = jax.random.split(s.key)
      nxt = sample(logits[0], sub, 0.0, 1.0)
      return LoopState(model, s.out.at[s.n].set(nxt), s.n + ok.astype(jnp.int32), nxt, key, s.done | ~ok,
                       jnp.where(ok, s.bad, s.n))
    return jax.lax.fori_loop(0, steps, body, ls)

  def fresh():
    ring = KVRing.create(len(cfg.attention_layers), a.ring, cfg.n_kv_heads, cfg.head_dim, "int8", block=256)
    st = api.ModelState(fill_ring(ring, a.depth), recurrent=RecurrentState.create(cfg) if cfg.recurrent_layers else None)
    ls = LoopState(st, jnp.zeros((a.steps + 1,), jnp.int32), jnp.ones((), jnp.int32), jnp.int32(1),
                   jax.random.PRNGKey(0), jnp.zeros((), bool), jnp.int32(-1))
    return jax.block_until_ready(jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), ls))

  runs = {"while": lambda ls: decode_loop(params, ls, jnp.int32(a.steps + 1), jnp.int32(-1), cfg=cfg,
                                          temperature=0.0, top_p=1.0),
          "fixed": lambda ls: fixed_loop(params, ls, steps=a.steps)}
  times = {k: [] for k in runs}
  outs = {}
  for r in range(a.repeats + 1):
    for name, run in runs.items():             # alternating, so drift hits both alike
      ls = fresh()
      t0 = time.perf_counter()
      ls = jax.block_until_ready(run(ls))
      if r:
        times[name].append((time.perf_counter() - t0) / a.steps)
      outs[name] = [int(t) for t in ls.out[1:a.steps + 1]]
  assert outs["while"] == outs["fixed"], "the two loops gave different tokens"
  med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
  print(f"{a.preset} depth {a.depth}, {a.steps} steps x {a.repeats}: while {med['while']:.3f} ms/step, fixed "
        f"{med['fixed']:.3f} ms/step ({(med['while'] / med['fixed'] - 1) * 100:+.1f} % for the per-step test); "
        f"tokens equal")


if __name__ == "__main__":
  main()
