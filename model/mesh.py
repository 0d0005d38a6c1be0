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
- every other param and the rest of the state (recurrent state, expert-free projections) is replicated on every
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


def place_state(tree, mesh: jax.sharding.Mesh):
  """`tree` (a request's state, or a loop state holding it) with every uncommitted array placed on `mesh`: each
  KVRing's per-layer codes and scales split by K/V head over "tp" where the heads divide, everything else
  replicated. Committed arrays stay where they are."""
  from model.kv_ring import KVRing
  rep, heads = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "tp"))

  def put(x, sh):
    return jax.device_put(x, sh) if isinstance(x, jax.Array) and not x.committed else x

  def node(x):
    if isinstance(x, KVRing) and x.k and heads_split(mesh, x.k[0].shape[1]):
      per_layer = lambda t: None if t is None else tuple(put(a, heads) for a in t)  # noqa: E731
      return x.replace(k=per_layer(x.k), v=per_layer(x.v), k_scale=per_layer(x.k_scale),
                       v_scale=per_layer(x.v_scale), length=put(x.length, rep))
    return jax.tree.map(lambda a: put(a, rep), x)
  return jax.tree.map(node, tree, is_leaf=lambda x: isinstance(x, KVRing))


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
