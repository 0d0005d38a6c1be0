"""GPU probe: is a T = k + 1 verify pass bitwise the T = 1 steps it replaces? Greedy speculative decoding is exact
only if every op computes a token's row the same way whatever the batch (DESIGN invariant 3). Checks each op of the
decode step at its model shape (row i of a T-row call against the same row alone), then the whole trunk: 4 decode
steps against one 4-token forward from the same state.

  python scripts/gpu/batch_invariance.py [--preset seed-mtp] [--layers 4] [--T 4] [--x8 dp4a] [--only trunk]

Prints one line per check: bitwise equal or the largest difference. Runs on CPU too (interpret kernels: slow).
"""
import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from configs.presets import preset
from model import api
from model.writer import quant_policy, random_params
from ops import dot8, moe_pallas, qmatmul_pallas, quant
from ops.layers import rms_norm
from ops.qtensor import QTensor, with_kernels

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="seed-mtp")
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--T", type=int, default=4)
ap.add_argument("--glue", default="on,off", help="the trunk check's glue specs (bench.glue: on, off, on/fuse=...)")
ap.add_argument("--proj_types", default="Q8_0", help="projection types of the qmatmul rows (Q4_K, IQ3_S, Q6_K: "
                "their tiles shrink with the batch above ops.qmatmul_pallas.INVARIANT_B)")
ap.add_argument("--moe_types", default="IQ3_S", help="routed-expert types of the moe_pallas rows (Q4_K: its word-shaped tile)")
ap.add_argument("--x8", default="", help="also the qmatmul and moe rows with their tiles' x8 (ops/dot8): dp4a or int")
ap.add_argument("--only", default="rows,attention,trunk", help="the parts to run: rows (the glue, matmul and MoE "
                "kernels), attention (ring, fold, wrapped ring, tier), trunk (steps against a pass)")
a = ap.parse_args()
ONLY = set(a.only.split(","))
if not ONLY <= {"rows", "attention", "trunk"}:
  ap.error(f"--only {a.only!r}: expected a comma list of rows, attention, trunk")
cpu = jax.default_backend() == "cpu"
kern = "interpret" if cpu else "pallas"
cfg = preset(a.preset)
T, D, E = a.T, cfg.d_model, cfg.n_experts
rng = np.random.default_rng(0)


def report(name, f, *args_T):
  """f on all T rows against f on each row alone (each its own jit, as the step and the verify pass are)."""
  full = np.asarray(jax.jit(f)(*args_T))
  rows = np.concatenate([np.asarray(jax.jit(f)(*(x[i:i + 1] for x in args_T))) for i in range(T)])
  d = float(np.max(np.abs(full - rows)))
  print(f"{name:52s} {'bitwise' if d == 0 else f'DIFFERS: max |diff| {d:.3e} (scale {np.max(np.abs(rows)):.2e})'}",
        flush=True)


if "rows" in ONLY:
  x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
  wr = jnp.asarray(rng.standard_normal((E, D)) * 0.02, jnp.float32)
  with jax.default_matmul_precision(api.MATMUL_PRECISION):
    report(f"router dot [T,{D}] x [{E},{D}] (XLA, {api.MATMUL_PRECISION})",
           lambda x: jnp.einsum("td,ed->te", x, wr), x)
    report("rms_norm (XLA)", lambda x: rms_norm(x, jnp.ones((D,)), 1e-6), x)
    report("softmax (XLA)", lambda x: jax.nn.softmax(jnp.einsum("td,ed->te", x, wr), axis=-1), x)
    from ops import rmsnorm_pallas, router_pallas
    report("rms_norm_pallas (+ residual)", lambda x: rmsnorm_pallas.rms_norm_pallas(x, jnp.ones((D,)), 1e-6, x * 0.5,
                                                                                    interpret=cpu)[1], x)
    if a.x8:
      for i, part in enumerate(("words", "dx", "xsum")):
        report(f"rms_norm_pallas x8: {part}", lambda x, i=i: rmsnorm_pallas.rms_norm_pallas(
            x, jnp.ones((D,)), 1e-6, x * 0.5, interpret=cpu, x8=True)[2][i], x)
    parts = jnp.asarray(rng.standard_normal((T, cfg.top_k, D)), jnp.float32)
    report("rms_norm_pallas (+ residual in pieces: Tunings.fuse residual)", lambda x, p: rmsnorm_pallas.rms_norm_pallas(
        x, jnp.ones((D,)), 1e-6, (p, x * 0.5), interpret=cpu)[1], x, parts)
    report("rms_norm_pallas with a silu gate (Tunings.fuse gated_norm)", lambda x: rmsnorm_pallas.rms_norm_pallas(
        x, jnp.ones((D,)), 1e-6, interpret=cpu, gate_TD=x * 0.5), x)
    from ops import norm_router_pallas
    for i, part in enumerate(("sum", "norm", "logits")):
      report(f"norm_router_pallas: {part} (Tunings.fuse router)", lambda x, i=i: norm_router_pallas.norm_logits_pallas(
          x, x * 0.5, jnp.ones((D,)), wr, 1e-6, interpret=cpu)[i], x)
    bias = jnp.asarray(rng.standard_normal(E) * 0.01, jnp.float32)
    rkw = dict(routing=cfg.routing, top_k=cfg.top_k, norm_topk=cfg.norm_topk, routed_scale=cfg.routed_scale)
    report("route_pallas: weights", lambda x: router_pallas.route_pallas(x, wr, bias, interpret=cpu, **rkw)[1], x)
    report("route_pallas: ids", lambda x: router_pallas.route_pallas(x, wr, bias, interpret=cpu, **rkw)[0], x)
    for pq in a.proj_types.split(","):
      qkv_rows = cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim
      for N, K in ((qkv_rows, D), (D, cfg.n_heads * cfg.head_dim)):
        w = QTensor.from_gguf(quant.random_blocks(pq, (N, K), rng, scale=1e-2), pq, K).replace(kernel=kern)
        xx = jnp.asarray(rng.standard_normal((T, K)), jnp.float32)
        report(f"qmatmul_pallas {pq} N {N} K {K}", lambda x: qmatmul_pallas.qmatmul_pallas(x, w, interpret=cpu), xx)
        if a.x8 and pq in dot8.TILES:
          t8 = qmatmul_pallas.Tuning(x8=a.x8)
          report(f"qmatmul_pallas {pq} N {N} K {K} x8 {a.x8}",
                 lambda x: qmatmul_pallas.qmatmul_pallas(x, w, interpret=cpu, tuning=t8), xx)
    F = cfg.d_ff_expert
    ids = jnp.asarray(np.stack([rng.choice(E, cfg.top_k, replace=False) for _ in range(T)]), jnp.int32)
    wts = jnp.asarray(rng.random((T, cfg.top_k)), jnp.float32)
    for mq in a.moe_types.split(","):
      g = QTensor.from_gguf(quant.random_blocks(mq, (E, F, D), rng, scale=1e-2), mq, D).replace(kernel=kern)
      dn = QTensor.from_gguf(quant.random_blocks(mq, (E, D, F), rng, scale=1e-2), mq, F).replace(kernel=kern)
      report(f"moe_pallas {mq} E {E} F {F} top {cfg.top_k}",
             lambda x, i, w: moe_pallas.moe_pallas(x, i, w, g, g, dn, interpret=cpu), x, ids, wts)
      lg = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
      route = moe_pallas.Route(cfg.routing, cfg.top_k, cfg.norm_topk, cfg.routed_scale, False)
      report(f"moe_pallas {mq} routing for itself (Tunings.fuse topk)",
             lambda x, lg: moe_pallas.moe_pallas(x, lg, None, g, g, dn, interpret=cpu, route=route), x, lg)
      if a.x8 and mq in dot8.TILES:
        t8 = moe_pallas.Tuning(gateup=qmatmul_pallas.Tuning(x8=a.x8))
        report(f"moe_pallas {mq} E {E} F {F} top {cfg.top_k} x8 {a.x8}",
               lambda x, i, w: moe_pallas.moe_pallas(x, i, w, g, g, dn, interpret=cpu, tuning=t8), x, ids, wts)
        t8 = moe_pallas.Tuning(gateup=qmatmul_pallas.Tuning(x8=a.x8, BN=32, programs=0),
                               down=qmatmul_pallas.Tuning(x8=a.x8))
        report(f"moe_pallas {mq} E {E} F {F} top {cfg.top_k} x8 {a.x8} + down",
               lambda x, i, w: moe_pallas.moe_pallas(x, i, w, g, g, dn, interpret=cpu, tuning=t8), x, ids, wts)

if "attention" in ONLY:
  # decode attention: the T rows of a verify pass against each query alone at its own causal length
  from model.kv_ring import KVRing  # noqa: E402
  from ops import attention  # noqa: E402
  Hq, Hkv, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  for depth in (1000, 1025):            # 1025: the pass's last query opens a key tile its first query does not see
    ring = KVRing.create(1, 4096, Hkv, Dh, "int8", block=256)
    ring = ring.write(0, jnp.arange(depth + T), jnp.asarray(rng.standard_normal((depth + T, Hkv, Dh)), jnp.float32),
                      jnp.asarray(rng.standard_normal((depth + T, Hkv, Dh)), jnp.float32))
    q = jnp.asarray(rng.standard_normal((T, Hq, Dh)), jnp.float32)
    att = jax.jit(lambda q, p, n: attention.ring_attention(q, *ring.layer(0), p, n, block=256, scale=Dh ** -0.5,
                                                           impl=kern))
    full = np.asarray(att(q, depth + jnp.arange(T), depth + T))
    rows = np.concatenate([np.asarray(att(q[i:i + 1], depth + i + jnp.arange(1), depth + i + 1)) for i in range(T)])
    dd = float(np.max(np.abs(full - rows)))
    print(f"{f'attention kernel, int8 ring, depth {depth}':52s} "
          f"{'bitwise' if dd == 0 else f'DIFFERS: max |diff| {dd:.3e}'}",
          flush=True)

  # the same with RoPE and the ring write inside the kernel (Tunings.fuse rope): the pass against its steps, each step
  # writing its own row first, the ring after them too
  from ops import rope_attention_pallas  # noqa: E402
  Wq = (Hq + 2 * Hkv) * Dh
  rkw = dict(n_heads=Hq, n_kv_heads=Hkv, head_dim=Dh, rope_dim=cfg.rope_dim, theta=cfg.rope_theta, offset=0,
             eps=cfg.rms_eps, block=256, scale=Dh ** -0.5, interpret=cpu)
  wn = jnp.asarray(1.0 + 0.1 * rng.standard_normal(Dh), jnp.float32) if cfg.qk_norm else None
  if rope_attention_pallas.supported(T, Hq, Hkv, Dh, cfg.rope_dim, 256, ring.k[0]) is None:
    for depth in (1000, 1025):
      ring = KVRing.create(1, 4096, Hkv, Dh, "int8", block=256)
      ring = ring.write(0, jnp.arange(depth), jnp.asarray(rng.standard_normal((depth, Hkv, Dh)), jnp.float32),
                        jnp.asarray(rng.standard_normal((depth, Hkv, Dh)), jnp.float32))
      qkv = jnp.asarray(rng.standard_normal((T, Wq)), jnp.float32)
      fold = jax.jit(lambda x, p, r: rope_attention_pallas.rope_attention_pallas(x, wn, wn, p, r, p[-1] + 1, **rkw))
      full, full_ring = fold(qkv, depth + jnp.arange(T), ring.layer(0))
      r, rows = ring.layer(0), []
      for i in range(T):
        o, r = fold(qkv[i:i + 1], depth + i + jnp.arange(1), r)
        rows.append(o)
      dd = float(np.max(np.abs(np.asarray(full) - np.concatenate([np.asarray(o) for o in rows]))))
      dr = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
               for a, b in zip(full_ring, r))
      print(f"{f'rope + write + attention kernel, depth {depth} (fuse rope)':52s} "
            f"{'bitwise' if dd == dr == 0 else f'DIFFERS: max |diff| out {dd:.3e}, ring {dr:.3e}'}", flush=True)

  # beside a host tier: the ring part with per-row windows on a wrapped ring whose window start crosses a key tile
  # within the pass (the old contiguous split schedule moved its boundaries there), and the tier part block by block
  R, W = 4096, 4096 - T
  bk = attention.attention_pallas.config(Dh, 256, Hkv, jnp.int8).bk
  L = 2 * R + (bk - 3 - T) % bk                           # window starts L + 1 - W + t = bk - 2 + t (mod bk): rows 0-1
                                                          # start in one key tile, rows 2.. in the next
  ring = KVRing.create(1, R, Hkv, Dh, "int8", block=256)
  wpos = jnp.arange(L + T - R, L + T)
  ring = ring.write(0, wpos, jnp.asarray(rng.standard_normal((R, Hkv, Dh)), jnp.float32),
                    jnp.asarray(rng.standard_normal((R, Hkv, Dh)), jnp.float32))
  q = jnp.asarray(rng.standard_normal((T, Hq, Dh)), jnp.float32)
  att = jax.jit(lambda q, p, n, lo: attention.ring_attention(q, *ring.layer(0), p, n, block=256, scale=Dh ** -0.5,
                                                             impl=kern, with_lse=True, lo_T=lo))
  pos = L + jnp.arange(T)
  full = att(q, pos, L + T, pos + 1 - W)
  rows = [att(q[i:i + 1], pos[i:i + 1], L + i + 1, pos[i:i + 1] + 1 - W) for i in range(T)]
  for j, what in ((0, "out"), (1, "lse")):
    dd = float(np.max(np.abs(np.asarray(full[j]) - np.concatenate([np.asarray(r[j]) for r in rows]))))
    print(f"{f'attention kernel, wrapped ring, per-row windows: {what}':52s} "
          f"{'bitwise' if dd == 0 else f'DIFFERS: max |diff| {dd:.3e}'}", flush=True)
  C, tb = 3 * 4096, 4096
  tk = jnp.asarray(rng.integers(-127, 128, (C, Hkv, Dh)), jnp.int8)
  tv = jnp.asarray(rng.integers(-127, 128, (C, Hkv, Dh)), jnp.int8)
  tks, tvs = (jnp.asarray(rng.random((C, Hkv)) * 0.02, jnp.float32) for _ in range(2))
  for span in (None, 2 * tb):                                 # blocks alone; spans of two blocks, then blocks
    tier = jax.jit(lambda q, hi, span=span: attention.tier_attention(q, tk, tv, tks, tvs, hi, tier_block=tb, block=256,
                                                                     scale=Dh ** -0.5, impl=kern, tier_span=span))
    hi = 2 * tb - 2 + jnp.arange(T)                          # rows on both sides of a block (and span) boundary
    full = tier(q, hi)
    rows = [tier(q[i:i + 1], hi[i:i + 1]) for i in range(T)]
    for j, what in ((0, "out"), (1, "lse")):
      dd = float(np.max(np.abs(np.asarray(full[j]) - np.concatenate([np.asarray(r[j]) for r in rows]))))
      print(f"{f'tier attention (span {span}): {what}':52s} "
            f"{'bitwise' if dd == 0 else f'DIFFERS: max |diff| {dd:.3e}'}",
            flush=True)

if "trunk" in ONLY:
  # the trunk: T decode steps against one T-token forward (the verify pass) from the same prefilled state
  from model.options import Options  # noqa: E402
  from ops.tuning import Tunings  # noqa: E402
  # on CPU the decode attention kernel in interpret mode for T <= 8, as on the GPU (prefill: the reference)
  BASE = Options(tunings=Tunings(attention_impl="interpret")) if cpu else Options()
  cut = {"recurrent": cfg.recurrent[:a.layers]} if cfg.is_hybrid else {}    # a hybrid's per-layer flags
  small = dataclasses.replace(cfg, n_layers=a.layers, **cut)
  params = with_kernels(api.fuse_qkv(random_params(small, types=quant_policy("IQ3_S", "Q8_0"))), kern)
  prompt = jnp.asarray(rng.integers(0, small.vocab_size, 40), jnp.int32)
  toks = jnp.asarray(rng.integers(0, small.vocab_size, T), jnp.int32)


  def steps_vs_pass(make_state, prompt, chunk: int, options: Options):
    """Logits of T decode steps and of one T-token pass from the same prefilled state: (max |diff| per position,
    argmax equal per position)."""
    outs = []
    for mode in ("steps", "verify"):
      st = make_state()
      for c in range(0, len(prompt), chunk):
        _, _, st = api.prefill(params, prompt[c:c + chunk], st, cfg=small, options=options)
      if mode == "steps":
        ls = []
        for t in range(T):
          lg, _, st = api.decode_step(params, toks[t], st, cfg=small, options=options)
          ls.append(np.asarray(lg))
        outs.append(np.stack(ls))
      else:
        lg, _, st = api.prefill(params, toks, st, cfg=small, options=options)
        outs.append(np.asarray(lg))
    d = np.max(np.abs(outs[0] - outs[1]), axis=-1)
    return [f"{v:.2e}" for v in d], [bool(np.array_equal(outs[0][i].argmax(), outs[1][i].argmax())) for i in range(T)]


  from bench.glue import glue_options  # noqa: E402
  for rw in a.glue.split(","):
    on, tun = glue_options(rw)
    tun = tun.replace(attention_impl=BASE.tunings.attention_impl) if BASE.tunings else tun
    d, same = steps_vs_pass(lambda: api.init_state(small, 4096, "int8", scratch=T), prompt, len(prompt),
                            BASE.replace(glue=on, tunings=tun))
    print(f"trunk {a.preset} x {a.layers} layers, glue kernels {rw}: {T} steps vs a {T}-token pass, max |diff| per "
          f"position {d}, argmax equal {same}", flush=True)

  # the trunk beside an active host tier (ring 512 under max_context 4,096, a 1,500-token prompt: positions have left
  # the window), as the seed4 arms at 32K and 128K run it
  from decode import engine  # noqa: E402
  from model import host_tier


  def tiered_state():
    st = api.init_state(small, 512, "int8", scratch=T)
    st = st.replace(host=host_tier.place_on_host(host_tier.HostTier.like(st.ring, 4096)))
    return engine.commit_for_store(st, params, small)


  d, same = steps_vs_pass(tiered_state, jnp.asarray(rng.integers(0, small.vocab_size, 1500), jnp.int32), 250, BASE)
  print(f"trunk with an active host tier x {a.layers} layers: {T} steps vs a {T}-token pass, max |diff| per position "
        f"{d}, argmax equal {same}", flush=True)
