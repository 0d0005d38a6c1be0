"""GPU probe of the decode step's small-kernel choices: the glue kernels' tilings (ops/router_pallas,
ops/rope_write_pallas) and the quantized kernels' x layout (ops/qmatmul_pallas.Tuning.natural_b: natural order
against the permuted view), each passed to the kernels as a tuning value. Each variant is checked against the reference, then timed as a decode step runs it: 48
dependent calls (one per layer) in one jitted call, T tokens, the 30B shape by default (D 2048, 128 experts top-8,
Hq 32 / Hkv 4 x 128, an int8 ring of 4,096; q/k/v Q8_0 5,120 x 2,048, o 2,048 x 4,096, experts --xtypes). One
process, so the variants compare as ratios.

  python scripts/gpu/glue_bench.py [--T 1,4] [--iters 30]
  python scripts/gpu/glue_bench.py --small          # CPU dry run (interpret mode, 4 layers)
Prints `check ...` (max |difference| against the reference) and `time ...` (us per call) lines."""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ops import rope_write_pallas as rw
from ops import router_pallas as rp
from timing import median_ms

ap = argparse.ArgumentParser()
ap.add_argument("--T", default="1,4")
ap.add_argument("--iters", type=int, default=30)
ap.add_argument("--layers", type=int, default=48)
ap.add_argument("--router", default="32:256:4:4,64:2048:4:1,128:2048:4:1,32:2048:4:1,64:1024:2:1,64:2048:8:1",
                help="variants programs:dc:warps:route_warps (ops.router_pallas.Tuning)")
ap.add_argument("--rope", default="1,2,4,8", help="q programs per token (ops.rope_write_pallas.Tuning.q_programs)")
ap.add_argument("--xnat", default="0,16", help="B values to compare: every type natural up to B tokens (0: the "
                "permuted view everywhere)")
ap.add_argument("--xtypes", default="IQ3_S,Q4_K", help="expert types of the x-layout cells")
ap.add_argument("--only", default="router,rope,x", help="sections to run")
ap.add_argument("--small", action="store_true")
args = ap.parse_args()
INTERP = args.small
L = 4 if args.small else args.layers
D, E, K = 2048, 128, 8
Hq, Hkv, Dh, R = 32, 4, 128, 4096
rng = np.random.default_rng(0)


def timeit(f, *a):
  return 1e3 * median_ms(f, *a, iters=args.iters) / L


router = jnp.asarray(rng.standard_normal((E, D)) * 0.02, jnp.float32)
rkw = dict(routing="softmax", top_k=K, norm_topk=True, routed_scale=1.0)
qn = jnp.asarray(1 + 0.1 * rng.standard_normal(Dh), jnp.float32)
kn = jnp.asarray(1 + 0.1 * rng.standard_normal(Dh), jnp.float32)
okw = dict(n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, rope_dim=Dh, theta=1e6, offset=0, eps=1e-6)

for T in (int(t) for t in args.T.split(",")):
  if "router" not in args.only:
    break
  x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
  ids_r, w_r = rp.route_ref(x @ router.T, None, **rkw)
  for v in args.router.split(","):
    p, dc, wp, rw_ = (int(a) for a in v.split(":"))
    tk = rp.Tuning(programs=p, dc=dc, warps=wp, route_warps=rw_)
    ids, w = rp.route_pallas(x, router, None, interpret=INTERP, tuning=tk, **rkw)
    print(f"check router T={T} {v}: ids equal {bool(jnp.all(ids == ids_r))}, weights max diff "
          f"{float(jnp.max(jnp.abs(w - w_r))):.1e}", flush=True)

    @jax.jit
    def chain(x, tk=tk):
      for _ in range(L):
        ids, w = rp.route_pallas(x, router, None, interpret=INTERP, tuning=tk, **rkw)
        x = x + 1e-6 * (w[:, :1] + ids[:, :1].astype(jnp.float32))
      return x
    print(f"time router T={T} {v}: {timeit(chain, x):.2f} us per layer (logits + top-k)", flush=True)

  if "rope" not in args.only:
    continue
  qkv = jnp.asarray(rng.standard_normal((T, (Hq + 2 * Hkv) * Dh)), jnp.float32)
  pos = jnp.arange(100, 100 + T, dtype=jnp.int32)

  def ring():
    return (jnp.zeros((R, Hkv, Dh), jnp.int8), jnp.zeros((R, Hkv, Dh), jnp.int8), jnp.zeros((R, Hkv), jnp.float32),
            jnp.zeros((R, Hkv), jnp.float32))
  q_r, ring_r = rw.rope_write_ref(qkv, qn, kn, pos, ring(), **okw)
  for qp in (int(a) for a in args.rope.split(",")):
    q, ring_k = rw.rope_write_pallas(qkv, qn, kn, pos, ring(), interpret=INTERP, tuning=rw.Tuning(q_programs=qp),
                                     **okw)
    codes = max(int(jnp.max(jnp.abs(a.astype(jnp.int32) - b.astype(jnp.int32)))) for a, b in
                zip(ring_k[:2], ring_r[:2]))
    print(f"check rope T={T} q_programs={qp}: q max diff {float(jnp.max(jnp.abs(q - q_r))):.1e}, ring codes max "
          f"diff {codes}, scales max diff {float(jnp.max(jnp.abs(ring_k[2] - ring_r[2]))):.1e}", flush=True)

    def chain(qkv, rings, qp=qp):
      out = []
      for layer in range(L):
        q, r = rw.rope_write_pallas(qkv, qn, kn, pos, rings[layer], interpret=INTERP,
                                    tuning=rw.Tuning(q_programs=qp), **okw)
        qkv = qkv.at[:, :Dh].add(1e-6 * q[:, 0, :])
        out.append(r)
      return qkv, out
    f = jax.jit(chain, donate_argnums=(1,))
    rings = [ring() for _ in range(L)]
    qkv2, rings = f(qkv, rings)
    jax.block_until_ready(rings)
    ts = []
    for _ in range(args.iters):
      t = time.perf_counter()
      qkv2, rings = f(qkv, rings)
      jax.block_until_ready(rings)
      ts.append(time.perf_counter() - t)
    print(f"time rope T={T} q_programs={qp}: {1e6 * float(np.median(ts)) / L:.2f} us per layer", flush=True)


# ------------------------------------------------------------------ the quantized kernels' x layout
from ops import moe, moe_pallas, qmatmul, qmatmul_pallas as qp, quant  # noqa: E402
from ops.qtensor import QTensor  # noqa: E402

if "x" in args.only:
  F, NE = (768, 128) if not args.small else (256, 16)
  DX = D if not args.small else 512

  def qt(qtype, shape):
    return QTensor.from_gguf(quant.random_blocks(qtype, shape, rng), qtype, shape[-1]).replace(
        kernel="interpret" if INTERP else "pallas")
  wqkv, wo = qt("Q8_0", (5120 if not args.small else 640, DX)), qt("Q8_0", (DX, 4096 if not args.small else 1024))
  experts = {q: (qt(q, (NE, F, DX)), qt(q, (NE, F, DX)), qt(q, (NE, DX, F))) for q in args.xtypes.split(",")}
  for T in (int(t) for t in args.T.split(",")):
    x = jnp.asarray(rng.standard_normal((T, DX)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(NE)[:K] for _ in range(T)]), jnp.int32)
    wk = jnp.full((T, K), 1.0 / K, jnp.float32)
    a = jnp.asarray(rng.standard_normal((T, wo.shape[1])), jnp.float32)
    refs = {"qkv": qmatmul.qmatmul_ref(x, wqkv), "o": qmatmul.qmatmul_ref(a, wo)}
    refs.update({q: moe.moe_ref(x, ids, wk, *e) for q, e in experts.items()})
    for xn in (int(v) for v in args.xnat.split(",")):
      nat = qp.Tuning(natural_b=xn)                    # every type natural up to xn tokens
      mt = moe_pallas.Tuning(gateup=nat, down=nat)
      got = {"qkv": qp.qmatmul_pallas(x, wqkv, interpret=INTERP, tuning=nat),
             "o": qp.qmatmul_pallas(a, wo, interpret=INTERP, tuning=nat)}
      got.update({q: moe_pallas.moe_pallas(x, ids, wk, *e, interpret=INTERP, tuning=mt) for q, e in experts.items()})
      for k in got:
        err = float(jnp.linalg.norm(got[k] - refs[k]) / jnp.linalg.norm(refs[k]))
        print(f"check x layout T={T} xnat={xn} {k}: rel L2 {err:.1e}", flush=True)

      @jax.jit
      def proj_chain(x, a, nat=nat):
        for _ in range(L):
          y = qp.qmatmul_pallas(x, wqkv, interpret=INTERP, tuning=nat)
          z = qp.qmatmul_pallas(a, wo, interpret=INTERP, tuning=nat)
          x = x + 1e-6 * y[:, :DX] + 1e-6 * z
        return x
      print(f"time x layout T={T} xnat={xn} q/k/v + o (Q8_0): {timeit(proj_chain, x, a):.2f} us per layer", flush=True)
      for q, e in experts.items():
        @jax.jit
        def moe_chain(x, e=e, mt=mt):
          for _ in range(L):
            x = x + 1e-6 * moe_pallas.moe_pallas(x, ids, wk, *e, interpret=INTERP, tuning=mt)
          return x
        print(f"time x layout T={T} xnat={xn} experts {q}: {timeit(moe_chain, x):.2f} us per layer", flush=True)
