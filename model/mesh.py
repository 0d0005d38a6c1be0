"""A device mesh for models larger than one device: expert and head parallelism over one host's devices
(jax.sharding).

`MeshSpec` (what `--mesh ep=2` says) -> `make_mesh` -> a `jax.sharding.Mesh` with axes ("ep", "tp"). Under it:
- the routed experts of every MoE block (ffn/{gate,up,down}_exps, the expert store) are split by expert id: device
  i of the `ep` axis holds experts [i E/ep, (i + 1) E/ep) of every block (PartitionSpec("ep") on the leading axis
  of each plane);
- with tp > 1, the K/V rings (main and drafter) are split by K/V head over the `tp` axis where the heads divide
  (PartitionSpec(None, "tp") on each layer's [R, Hkv, Dh] codes and [R, Hkv] scales: `place_state`), and each
  attention layer's ring write and attention run head-parallel (`head_parallel`: a shard_map over "tp" in which a
  device writes and attends its Hkv / tp heads and their H / tp query heads, then an all_gather of the heads'
  outputs over "tp"); where they do not divide, rings and attention stay replicated;
- with tp > 1, a hybrid model's Gated DeltaNet states [Hv, Dk, Dv] are split by value head over "tp" where the
  heads allow it (`delta_heads`), and each DeltaNet layer's recurrence runs head parallel (`delta_parallel`: a
  device runs its value heads and the key heads they read, then an all_gather of the heads' outputs);
- every other param and the rest of the state (conv windows, expert-free projections) is replicated on every
  device (a host tier, which lives in the first device's pinned host memory, is refused under a mesh by the CLIs).
`placer(mesh)` is a `load_params` hook that puts each param there as soon as it is built, one tensor at a time, so
no device ever holds more than one tensor beyond its share; `shard_params` does the same for params already built
(an orbax cache entry).

The routed experts under the mesh (`expert_parallel`): a `jax.shard_map` over "ep" in which every device runs the
model's own MoE function on its local experts for all the step's tokens, the (token, expert) pairs routed to
experts it does not own given weight 0 (and local id 0), then a `psum` over "ep" sums the partial outputs. The
decode kernels (ops/moe_pallas, T <= 16) skip those pairs and read only the device's own experts; the reference
paths and the grouped prefill GEMM still compute them on local expert 0 (work a device could drop). The
router, attention and dense projections run replicated, the same on every device. What changes against one device
is the order of the sum over a token's top-k experts (per device, then across devices): float32 summation order.
The decode step, the MTP round and prefill stay the same pure jitted functions: the mesh reaches them as
`Options.mesh`, a static argument (a Mesh is hashable).

Head parallel attention computes each head as one device does, on fewer heads; the projections around it stay
replicated (their weights whole on every device: tp splits the K/V, the memory that grows with context, not the
weights). The partitioned program may order a float32 sum otherwise (XLA is free to split the replicated ops
too): logits within the summation-order bound, as under ep (tests/model/test_mesh.py).

>>> parse_mesh("ep=2", n_devices=4), parse_mesh("ep=2,tp=2", n_devices=4)
(MeshSpec(ep=2, tp=1), MeshSpec(ep=2, tp=2))
>>> parse_mesh("ep=3", n_devices=2)
Traceback (most recent call last):
...
model.mesh.MeshError: 'ep=3': ep x tp = 3 devices, expected at most the 2 devices there are
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ops.qtensor import QTensor

AXES = ("ep", "tp")
STORE_NAMES = ("gate_exps", "up_exps", "down_exps")


class MeshError(ValueError):
  """A mesh that cannot be made or does not fit the model (one line)."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  ep: int = 1     # expert parallel: devices the routed experts are split across, by expert id
  tp: int = 1     # head parallel: devices the K/V rings and the attention heads are split across

  @property
  def size(self) -> int:
    return self.ep * self.tp

  def __str__(self) -> str:
    return ",".join(f"{a}={getattr(self, a)}" for a in AXES)


def parse_mesh(text: str | None, n_devices: int) -> MeshSpec:
  """'ep=2', 'ep=4,tp=2' (axis=size pairs, axes ep and tp, each at most once; sizes positive integers whose
  product is at most `n_devices`) -> MeshSpec; None or '' -> one device. Anything else is a MeshError."""
  if not text:
    return MeshSpec()
  sizes: dict[str, int] = {}
  for part in text.split(","):
    m = re.fullmatch(r"\s*([a-z]+)\s*=\s*([0-9]+)\s*", part)
    if not m:
      raise MeshError(f"{text!r}: {part.strip()!r} is not axis=size, expected pairs such as ep=2 or ep=2,tp=1")
    axis, size = m.group(1), int(m.group(2))
    if axis not in AXES:
      raise MeshError(f"{text!r}: unknown axis {axis!r}, expected axes {' and '.join(AXES)}")
    if axis in sizes:
      raise MeshError(f"{text!r}: axis {axis} given twice, expected each axis at most once")
    if size < 1:
      raise MeshError(f"{text!r}: {axis}={size}, expected a positive size")
    sizes[axis] = size
  spec = MeshSpec(**sizes)
  if spec.size > n_devices:
    raise MeshError(f"{text!r}: ep x tp = {spec.size} devices, expected at most the {n_devices} devices there are")
  return spec


def check_experts(spec: MeshSpec, n_experts: int) -> None:
  """A MeshError unless the routed experts split evenly over ep (models without routed experts: ep must be 1)."""
  if spec.ep > 1 and (n_experts < 1 or n_experts % spec.ep):
    raise MeshError(f"ep={spec.ep}: the model has {n_experts} routed experts, expected a number divisible by ep")


def make_mesh(spec: MeshSpec, devices=None) -> jax.sharding.Mesh | None:
  """The mesh of `spec` over the first ep x tp devices (default jax.devices()), axes ("ep", "tp") of Auto type;
  None for one device (the one-device path, untouched)."""
  if spec.size == 1:
    return None
  devs = list(devices if devices is not None else jax.devices())[:spec.size]
  auto = jax.sharding.AxisType.Auto
  return jax.sharding.Mesh(np.array(devs).reshape(spec.ep, spec.tp), AXES, axis_types=(auto, auto))


def is_store_path(path: tuple) -> bool:
  """Whether a params path (tuple of keys) names a routed-expert tensor (split by expert id under a mesh)."""
  return len(path) >= 2 and path[-2] == "ffn" and path[-1] in STORE_NAMES


def spec_of(path: tuple) -> P:
  """The PartitionSpec of the param at `path`: P("ep") (leading, expert axis) for routed experts, else replicated."""
  return P("ep") if is_store_path(path) else P()


def _put(w, sharding, path=None):
  """A param (QTensor or array) with every plane put in `sharding`; a MeshError when its leading axis does not
  split over the sharding's ep axis."""
  planes = w.planes if isinstance(w, QTensor) else (w,)
  if sharding.spec != P():
    ep = sharding.mesh.shape["ep"]
    if planes[0].shape[0] % ep:
      name = "/".join(path) if path else "a routed-expert tensor"
      raise MeshError(f"ep={ep}: {name} has {planes[0].shape[0]} experts, expected a number divisible by ep")
  out = tuple(jax.device_put(p, sharding) for p in planes)
  return w.replace(planes=out) if isinstance(w, QTensor) else out[0]


def placer(mesh: jax.sharding.Mesh):
  """A `load_params` hook that places each param on `mesh` as it is built (routed experts split by expert id, the
  rest replicated): one tensor at a time, so no device holds the whole expert store while the model loads."""
  def place(path: tuple, param):
    return _put(param, NamedSharding(mesh, spec_of(path)), path)
  return place


def _walk(params: dict, fn, path=()):
  return {k: _walk(v, fn, path + (k,)) if isinstance(v, dict) else fn(path + (k,), v) for k, v in params.items()}


def shard_params(params: dict, mesh: jax.sharding.Mesh | None) -> dict:
  """The params placed on `mesh` (as `placer`), tensor by tensor; the params themselves for no mesh."""
  if mesh is None:
    return params
  return _walk(params, placer(mesh))


def mesh_of(tree) -> jax.sharding.Mesh | None:
  """The mesh of the first array of `tree` placed on a NamedSharding over more than one device, else None."""
  for x in jax.tree.leaves(tree):
    sh = getattr(x, "sharding", None) if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) else None
    if isinstance(sh, NamedSharding) and sh.mesh.size > 1:
      return sh.mesh
  return None


def device_bytes(params) -> dict[str, int]:
  """Bytes of `params` held by each device (its shards of every array), keyed by str(device), in device order."""
  out: dict = {}
  for x in jax.tree.leaves(params):
    if isinstance(x, jax.Array):
      for s in x.addressable_shards:
        out[s.device] = out.get(s.device, 0) + int(s.data.nbytes)
  return {str(d): out[d] for d in sorted(out, key=lambda d: d.id)}


def tp_of(mesh) -> int:
  """The mesh's tp size (1 without a mesh)."""
  return 1 if mesh is None else mesh.shape["tp"]


def heads_split(mesh, n_kv_heads: int) -> bool:
  """Whether K/V rings and attention run head parallel on `mesh`: tp > 1 dividing the K/V heads."""
  tp = tp_of(mesh)
  return tp > 1 and n_kv_heads % tp == 0


def delta_heads(mesh, Hk: int, Hv: int, tiled: bool) -> tuple[int, int] | None:
  """(value heads, key heads) of one device when a Gated DeltaNet layer runs head parallel on `mesh`, else None.

  A device takes Hv / tp contiguous value heads (its rows of the [Hv, Dk, Dv] state) and the contiguous key
  heads they read: Hk / tp of them where value head h reads key head h // (Hv / Hk) (qwen3next; tp must divide
  Hk), min(Hk, Hv / tp) where it reads h % Hk (qwen35moe; one of Hk and Hv / tp must divide the other)."""
  tp = tp_of(mesh)
  if tp == 1 or Hv % tp:
    return None
  hv = Hv // tp
  if not tiled:
    return (hv, Hk // tp) if Hk % tp == 0 else None
  hk = min(Hk, hv)
  return (hv, hk) if max(Hk, hv) % hk == 0 else None


def place_state(tree, mesh: jax.sharding.Mesh, cfg=None):
  """`tree` (a request's state, or a loop state holding it) with every uncommitted array placed on `mesh`: each
  KVRing's per-layer codes and scales split by K/V head over "tp" where the heads divide; given the model's `cfg`,
  each RecurrentState's delta-rule states [Hv, Dk, Dv] split by value head where its DeltaNet layers run head
  parallel (`delta_heads`); everything else replicated (the conv windows too: the q | k | v channels of a device's
  heads are not one slice of them). Committed arrays stay where they are."""
  from model.kv_ring import KVRing
  from model.recurrent import RecurrentState
  rep, heads, lead = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P("tp"))

  def put(x, sh):
    return jax.device_put(x, sh) if isinstance(x, jax.Array) and not x.committed else x

  def node(x):
    if isinstance(x, KVRing) and x.k and heads_split(mesh, x.k[0].shape[1]):
      per_layer = lambda t: None if t is None else tuple(put(a, heads) for a in t)  # noqa: E731
      return x.replace(k=per_layer(x.k), v=per_layer(x.v), k_scale=per_layer(x.k_scale),
                       v_scale=per_layer(x.v_scale), length=put(x.length, rep))
    if isinstance(x, RecurrentState) and x.delta and cfg is not None:
      if delta_heads(mesh, cfg.Hk, cfg.Hv, cfg.gdn_heads_tiled):
        return x.replace(conv=tuple(put(a, rep) for a in x.conv), delta=tuple(put(a, lead) for a in x.delta))
    return jax.tree.map(lambda a: put(a, rep), x)
  return jax.tree.map(node, tree, is_leaf=lambda x: isinstance(x, (KVRing, RecurrentState)))


def head_parallel(write_attend, mesh: jax.sharding.Mesh):
  """`write_attend(q_THDh, k_THkvDh, v_THkvDh, arrays, pos_T, length) -> (arrays, o_THDh)` (a layer's ring write
  and its attention over the ring, `arrays` the layer's (k, v, k_scale, v_scale), None scales allowed) run head
  parallel:
  inside a shard_map over "tp" each device takes its H / tp query heads and Hkv / tp K/V heads (contiguous, so
  the GQA groups stay whole) and its shards of the ring arrays; o is all-gathered over "tp" (replicated after),
  the arrays come back split by head."""
  heads, rep = P(None, "tp"), P()

  def local(q, k, v, arrays, pos, length):
    arrays, o = write_attend(q, k, v, arrays, pos, length)
    return arrays, jax.lax.all_gather(o, "tp", axis=1, tiled=True)

  def run(q, k, v, arrays, pos, length):
    specs = tuple(None if a is None else heads for a in arrays)
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, specs, rep, rep), out_specs=(specs, rep),
                         check_vma=False)(q, k, v, arrays, pos, length)
  return run


def _key_start(i, hv: int, Hk: int, Hv: int, tiled: bool):
  """The first key head of device i's value heads [i hv, (i + 1) hv)."""
  return (i * hv) % Hk if tiled else i * hv // (Hv // Hk)


def delta_parallel(mesh: jax.sharding.Mesh, Hk: int, Hv: int, Dk: int, Dv: int, tiled: bool):
  """(step, chunked): wrappers that run a Gated DeltaNet layer's recurrence head parallel over "tp" (`delta_heads`
  must allow it). In a shard_map each device takes its Hv / tp value heads (its shard of the [Hv, Dk, Dv] state,
  of g and beta) and the key heads they read, runs the one-device function on them (the value -> key head map
  restricted to a device's heads is the same map on fewer heads), and the heads' outputs are all-gathered over
  "tp". Each head's sums are the one-device program's.

  step(fn)(qkv_TCc, win_CcKw, w_CcKc, g_THv, beta_THv, state, keep) for ops.gated_delta.gated_delta_step's form:
  the conv rows of a device's heads (its q, k and v channels) are sliced from the replicated projection, window
  and weights, and the windows after come back whole (replicated), gathered and put back in q | k | v order.
  chunked(fn)(q_THkDk, k_THkDk, v_THvDv, g_THv, beta_THv, state) for gated_delta_chunked's form."""
  hv, hk = delta_heads(mesh, Hk, Hv, tiled)
  n_key = Hk // hk                       # devices 0 .. n_key - 1 hold every key head once, in order
  rep, heads, lead = P(), P(None, "tp"), P("tp")

  def chans(x, i, axis):
    a, sl = _key_start(i, hv, Hk, Hv, tiled) * Dk, functools.partial(jax.lax.dynamic_slice_in_dim, x, axis=axis)
    return jnp.concatenate([sl(a, hk * Dk), sl(Hk * Dk + a, hk * Dk), sl(2 * Hk * Dk + i * hv * Dv, hv * Dv)], axis)

  def unchans(x, axis):                  # the gathered windows [tp, ..., Cc / tp, ...] -> [..., Cc, ...]
    part = lambda d, a, n: jax.lax.slice_in_dim(x[d], a, a + n, axis=axis)  # noqa: E731
    q = [part(d, 0, hk * Dk) for d in range(n_key)]
    k = [part(d, hk * Dk, hk * Dk) for d in range(n_key)]
    v = [part(d, 2 * hk * Dk, hv * Dv) for d in range(x.shape[0])]
    return jnp.concatenate(q + k + v, axis)

  def step(fn):
    def run(qkv, win, w, g, beta, state, keep):
      def local(qkv, win, w, g, beta, state):
        i = jax.lax.axis_index("tp")
        out = fn(chans(qkv, i, 1), chans(win, i, 0), chans(w, i, 0), g, beta, state)
        o, win_, st = out[:3]
        res = (jax.lax.all_gather(o, "tp", axis=1, tiled=True), unchans(jax.lax.all_gather(win_, "tp"), 0), st)
        return res + ((unchans(jax.lax.all_gather(out[3], "tp"), 1), out[4]) if keep else ())
      outs = (rep, rep, lead) + ((rep, heads) if keep else ())
      return jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, rep, heads, heads, lead), out_specs=outs,
                           check_vma=False)(qkv, win, w, g, beta, state)
    return run

  def chunked(fn):
    def run(q, k, v, g, beta, state):
      def local(q, k, v, g, beta, state):
        a = _key_start(jax.lax.axis_index("tp"), hv, Hk, Hv, tiled)
        q, k = (jax.lax.dynamic_slice_in_dim(t, a, hk, axis=1) for t in (q, k))
        o, st = fn(q, k, v, g, beta, state)
        return jax.lax.all_gather(o, "tp", axis=1, tiled=True), st
      return jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, heads, heads, heads, lead), out_specs=(rep, lead),
                           check_vma=False)(q, k, v, g, beta, state)
    return run
  return step, chunked


def expert_parallel(moe, mesh: jax.sharding.Mesh, n_experts: int):
  """`moe(x_TD, ids_TX, w_TX, gate, up, down) -> y_TD` over experts split by expert id on `mesh`'s ep axis.

  Inside a shard_map each device sees its E/ep local experts (gate/up/down with spec P("ep"), everything else
  replicated); a pair routed to an expert it does not own gets weight 0 and local id 0, so its term of the sum over
  top-k is exactly 0, and `moe` runs as on one device (told the model's n_experts, so it picks the same gather /
  grouped path; told which pairs the device owns, so the decode kernels skip the others and read only the device's
  own experts' rows: ops.moe.moe's `owned`). A psum over "ep" adds the devices' partial outputs: y is replicated.
  Float32: the sum over a token's X experts runs per device, then across devices, instead of in top-k order."""
  ep = mesh.shape["ep"]
  e_local = n_experts // ep

  def local(x_TD, ids_TX, w_TX, gate, up, down):
    e0 = jax.lax.axis_index("ep") * e_local
    own = (ids_TX >= e0) & (ids_TX < e0 + e_local)
    y = moe(x_TD, jnp.where(own, ids_TX - e0, 0), jnp.where(own, w_TX, 0).astype(w_TX.dtype), gate, up, down,
            n_experts=n_experts, owned=own)
    return jax.lax.psum(y.astype(jnp.float32), "ep")

  def run(x_TD, ids_TX, w_TX, gate, up, down):
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P("ep"), P("ep"), P("ep")), out_specs=P(),
                         check_vma=False)(x_TD, ids_TX, w_TX, gate, up, down)
  return run


def spec_from(mesh: jax.sharding.Mesh | None) -> MeshSpec:
  """The MeshSpec of a mesh made by make_mesh (None: one device)."""
  return MeshSpec() if mesh is None else MeshSpec(**{a: mesh.shape[a] for a in AXES})
