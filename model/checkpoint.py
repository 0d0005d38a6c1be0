"""orbax cache of loaded (repacked) params: a second load skips GGUF parsing.

Layout of one cache entry (a folder): `params/` (orbax StandardCheckpointer over a flat dict of arrays) and
`meta.json` (ModelConfig, each param's packing (qtype, n) and the tokenizer's GGUF keys). The entry's name is a
hash of the GGUF file's absolute path, size and mtime, plus a layout version, so a changed file or a changed
packing never reads a stale entry.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import numpy as np

from model.config import ModelConfig
from ops.qtensor import QTensor

LAYOUT_VERSION = 2  # 2: QTensors stored as per-field planes (ops/repack)
_SEP = "/"


def _flatten(params: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in params.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(_flatten(v, key + _SEP))
    else:
      out[key] = v
  return out


def _unflatten(flat: dict) -> dict:
  out: dict = {}
  for k, v in flat.items():
    node = out
    parts = k.split(_SEP)
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = v
  return out


def entry_dir(gguf_path: str, root: str) -> str:
  st = os.stat(gguf_path)
  h = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|v{LAYOUT_VERSION}".encode()).hexdigest()
  return os.path.join(os.path.abspath(root), h[:24])


def save(directory: str, cfg: ModelConfig, params: dict, tokenizer_md: dict) -> None:
  import orbax.checkpoint as ocp
  flat = _flatten(params)
  arrays, packing = {}, {}
  for k, v in flat.items():
    if isinstance(v, QTensor):  # one array per plane: "<key>@<plane name>"
      for name, p in zip(v.plane_names, v.planes):
        arrays[f"{k}@{name}"] = p
      packing[k] = {"qtype": v.qtype, "n": v.n, "planes": list(v.plane_names)}
    else:
      arrays[k] = v
  os.makedirs(directory, exist_ok=True)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.join(directory, "params"), arrays, force=True)
  ckpt.wait_until_finished()
  meta = {"layout": LAYOUT_VERSION, "config": dataclasses.asdict(cfg), "packing": packing, "tokenizer": tokenizer_md,
          "shapes": {k: [list(a.shape), str(a.dtype)] for k, a in arrays.items()}}
  with open(os.path.join(directory, "meta.json"), "w") as f:
    json.dump(meta, f)


def restore(directory: str):
  """(ModelConfig, params, tokenizer metadata) from a cache entry, or None if there is none."""
  meta_path = os.path.join(directory, "meta.json")
  if not os.path.isfile(meta_path):
    return None
  import orbax.checkpoint as ocp
  with open(meta_path) as f:
    meta = json.load(f)
  if meta.get("layout") != LAYOUT_VERSION:
    return None
  abstract = {k: jax.ShapeDtypeStruct(tuple(s), np.dtype(d) if d != "bfloat16" else jax.numpy.bfloat16)
              for k, (s, d) in meta["shapes"].items()}
  arrays = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), abstract)
  flat = {k: a for k, a in arrays.items() if "@" not in k}
  for k, p in meta["packing"].items():
    flat[k] = QTensor(tuple(arrays[f"{k}@{name}"] for name in p["planes"]), p["qtype"], p["n"])
  return ModelConfig(**meta["config"]), _unflatten(flat), meta["tokenizer"]
