"""GPU probe of the tensor-core GEMMs (ops/qgemm_pallas, ops/moe_grouped_pallas): compiled kernel against the
reference (float32 at HIGHEST), then timings against the paths they replace, one process (ratios within it).

  python scripts/gpu/qgemm_check.py [--types Q8_0,IQ3_S,...] [--iters 20]
Prints `check ...` lines (relative L2 error) and `time ...` lines (ms per call, median of iters)."""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ops import moe as moe_ops
from ops import moe_grouped_pallas, moe_pallas, qgemm_pallas, qmatmul, quant
from ops.qtensor import QTensor
from timing import median_ms, rel_l2 as rel

ap = argparse.ArgumentParser()
ap.add_argument("--types", default=",".join(qgemm_pallas.PIECES))
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--tiles", default="", help="extra qgemm tunings to time (ops.qgemm_pallas.Tuning fields), e.g. "
                "'BN=128,S=4;BN=32'")
ap.add_argument("--precisions", default="auto", help="prefill precisions to check and time, interleaved per type "
                "('f32,bf16,f32,bf16': the A/B in one process; auto: bf16 on a GPU)")
ap.add_argument("--sweep", default=None, help="tile sweep at the GPU's default precision, interleaved with the default "
                "(timed first and last): ';'-separated specs for the expert layer of each of --types that has experts "
                "(IQ3_S, Q4_K) and the dense projection of the others: 'BN=128,S=8' (both expert GEMMs / the dense "
                "one), 'g.S=8' or 'd.BN=32' (gate/up or down only), 'rows=64' (rows per expert tile), 'M=128' (dense)")
ap.add_argument("--small", action="store_true", help="CPU dry run: interpret mode, small shapes")
args = ap.parse_args()
INTERP = jax.default_backend() == "cpu"
SZ = 8 if args.small else 1
rng = np.random.default_rng(0)


def timeit(f, *a):
  return median_ms(f, *a, iters=args.iters)


def qt(qtype, shape):
  return QTensor.from_gguf(quant.random_blocks(qtype, shape, rng), qtype, shape[-1]).replace(
      kernel="interpret" if INTERP else "pallas")


ref_mm = jax.jit(lambda x, w: jnp.einsum("tk,nk->tn", x, w.dense(jnp.float32), precision="highest"))

precisions = args.precisions.split(",")
if not set(precisions) <= {"auto", "f32", "bf16"}:
  ap.error(f"--precisions {args.precisions}: expected a list of auto, f32, bf16")


def _spec(spec):
  """'BN=128,g.S=8,rows=64,M=128' -> (ops.moe_grouped_pallas.Tuning, ops.qgemm_pallas.Tuning of the dense GEMM)."""
  ov, extra = {"gateup": {}, "down": {}}, {}
  for kv in filter(None, spec.split(",")):
    k, v = kv.split("=")
    if k in ("rows", "M"):
      extra[k] = int(v)
    else:
      for part, pre in (("gateup", "g."), ("down", "d.")):
        if "." not in k or k.startswith(pre):
          ov[part][k.split(".")[-1]] = int(v)
  grouped = moe_grouped_pallas.Tuning(gateup=qgemm_pallas.Tuning(**ov["gateup"]),
                                      down=qgemm_pallas.Tuning(**ov["down"]), rows=extra.get("rows"))
  return grouped, qgemm_pallas.Tuning(**ov["gateup"], rows=extra.get("M"))


if args.sweep is not None:   # tiles against the default, one process: dense N=5120 K=2048 / one 30B expert layer
  E, F, D, K, T = 128 // SZ, 768, 2048, 8, 1024 // SZ
  x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
  wt = jnp.asarray(rng.random((T, K)), jnp.float32)
  specs = ["default", *filter(None, args.sweep.split(";")), "default"]
  for qtype in args.types.split(","):
    expert = qtype in ("IQ3_S", "Q4_K")
    if expert:
      g, u, d = qt(qtype, (E, F, D)), qt(qtype, (E, F, D)), qt(qtype, (E, D, F))
      with jax.default_matmul_precision("highest"):
        r = jax.jit(moe_ops.moe_ref)(x, ids, wt, g, u, d)
    else:
      w = qt(qtype, (5120 // SZ, D))
      r = ref_mm(x, w)
    for spec in specs:
      gt, dt = _spec("" if spec == "default" else spec)
      try:
        if expert:
          f = jax.jit(functools.partial(moe_grouped_pallas.moe_grouped_pallas, interpret=INTERP, tuning=gt))
          a = (x, ids, wt, g, u, d)
        else:
          f = jax.jit(functools.partial(qgemm_pallas.qgemm_pallas, tuning=dt, interpret=INTERP))
          a = (x, w)
        e = rel(f(*a), r)
        print(f"sweep {qgemm_pallas.form()} {qtype} {'expert layer' if expert else 'dense N=5120 K=2048'} T={T} "
              f"{spec}: {timeit(f, *a):.3f} ms (rel L2 {e:.2e})", flush=True)
      except Exception as ex:  # a tile the compiler refuses (registers, shared memory): say so, go on
        print(f"sweep {qtype} {spec}: failed: {str(ex).splitlines()[0][:200]}", flush=True)
  raise SystemExit(0)
if len(precisions) > 1:    # the precisions A/B alone: dense projection and one 30B expert layer at T = 1,024, interleaved
  E, F, D, K, T = 128 // SZ, 768, 2048, 8, 1024 // SZ
  for qtype in args.types.split(","):
    w = qt(qtype, (5120 // SZ, 2048))
    x = jnp.asarray(rng.standard_normal((T, 2048)), jnp.float32)
    g, u, d = qt(qtype, (E, F, D)), qt(qtype, (E, F, D)), qt(qtype, (E, D, F))
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    wt = jnp.asarray(rng.random((T, K)), jnp.float32)
    with jax.default_matmul_precision("highest"):
      r = jax.jit(moe_ops.moe_ref)(x, ids, wt, g, u, d)
    for p in precisions:
      f = jax.jit(functools.partial(qgemm_pallas.qgemm_pallas, interpret=INTERP, precision=p))
      fm = jax.jit(functools.partial(moe_grouped_pallas.moe_grouped_pallas, interpret=INTERP, precision=p))
      e1, e2 = rel(f(x, w), ref_mm(x, w)), rel(fm(x, ids, wt, g, u, d), r)
      print(f"precision {p} ({qgemm_pallas.form(p)}) {qtype}: dense N=5120 K=2048 T={T} {timeit(f, x, w):.3f} ms (rel L2 {e1:.2e}); "
            f"expert layer {timeit(fm, x, ids, wt, g, u, d):.3f} ms (rel L2 {e2:.2e})", flush=True)
  raise SystemExit(0)
for qtype in args.types.split(","):
  w = qt(qtype, (5120 // SZ, 2048))
  for T in (100, 1024 // SZ):
    x = jnp.asarray(rng.standard_normal((T, 2048)), jnp.float32)
    y = jax.jit(lambda x, w: qgemm_pallas.qgemm_pallas(x, w, interpret=INTERP))(x, w)
    print(f"check qgemm {qtype} T={T} N=5120 K=2048: rel L2 {rel(y, ref_mm(x, w)):.2e}", flush=True)
  x = jnp.asarray(rng.standard_normal((1024 // SZ, 2048)), jnp.float32)
  t_k = timeit(jax.jit(lambda x, w: qgemm_pallas.qgemm_pallas(x, w, interpret=INTERP)), x, w)
  t_r = timeit(ref_mm, x, w)
  t_d = timeit(jax.jit(lambda x, w: qmatmul.qmatmul_ref(x, w)), x, w)
  print(f"time qgemm {qtype} T=1024 N=5120 K=2048: pallas {t_k:.3f} ms, xla dequant+dot highest {t_r:.3f} ms, "
        f"xla default {t_d:.3f} ms ({2 * 1024 * 5120 * 2048 / t_k / 1e9:.0f} TFLOP/s)", flush=True)
  for M in (128, 256):
    t = timeit(jax.jit(functools.partial(qgemm_pallas.qgemm_pallas, tuning=qgemm_pallas.Tuning(rows=M),
                                         interpret=INTERP)), x, w)
    print(f"time qgemm {qtype} T=1024 M={M}: {t:.3f} ms", flush=True)
  for spec in filter(None, args.tiles.split(";")):
    ov = qgemm_pallas.Tuning(**{k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))})
    t = timeit(jax.jit(functools.partial(qgemm_pallas.qgemm_pallas, tuning=ov, interpret=INTERP)), x, w)
    print(f"time qgemm {qtype} T=1024 tiles {ov}: {t:.3f} ms", flush=True)

# one Qwen3-30B-A3B expert layer (E 128, top-8, D 2048, F 768), T = 1024 tokens
E, F, D, K = 128 // SZ, 768, 2048, 8
for gq in [q for q in ("IQ3_S", "Q4_K") if q in args.types.split(",")]:
  g, u, d = qt(gq, (E, F, D)), qt(gq, (E, F, D)), qt(gq, (E, D, F))
  for T in (256 // SZ, 1024 // SZ):
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    wt = jnp.asarray(rng.random((T, K)), jnp.float32)
    y = jax.jit(functools.partial(moe_grouped_pallas.moe_grouped_pallas, interpret=INTERP))(x, ids, wt, g, u, d)
    with jax.default_matmul_precision("highest"):
      r = jax.jit(moe_ops.moe_ref)(x, ids, wt, g, u, d)
    print(f"check moe_grouped {gq} T={T}: rel L2 {rel(y, r):.2e}", flush=True)
    t_g = timeit(jax.jit(functools.partial(moe_grouped_pallas.moe_grouped_pallas, interpret=INTERP)), x, ids, wt, g, u, d)
    for rows in (64, 128):
      t = timeit(jax.jit(functools.partial(moe_grouped_pallas.moe_grouped_pallas, interpret=INTERP,
                                           tuning=moe_grouped_pallas.Tuning(rows=rows))), x, ids, wt, g, u, d)
      print(f"time moe {gq} T={T}: grouped rows={rows} {t:.3f} ms", flush=True)
    x8, i8, w8 = x[:8], ids[:8], wt[:8]
    t_8 = timeit(jax.jit(functools.partial(moe_pallas.moe_pallas, interpret=INTERP)), x8, i8, w8, g, u, d)
    print(f"time moe {gq} T={T}: grouped tensor-core {t_g:.3f} ms ({T / t_g * 1e3:.0f} tok/s per layer); decode "
          f"kernels 8 tokens {t_8:.3f} ms ({8 / t_8 * 1e3:.0f} tok/s per layer)", flush=True)
