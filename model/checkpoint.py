"""orbax cache of loaded (repacked) params: a second load skips GGUF parsing.

Layout of one cache entry (a folder): `params/` (orbax StandardCheckpointer over a flat dict of arrays) and
`meta.json` (ModelConfig, each param's packing (qtype, n), the tokenizer's GGUF keys, the GGUF's identity: size,
mtime and the SHA-256 of its header and tensor table (model.gguf_io.identity), and a CRC-32 of every array's
bytes). The entry's name is a hash of the GGUF file's absolute path, size and mtime, plus a layout version, so a
changed file or a changed packing never reads a stale entry. `restore` checks all of it: an entry it cannot use
(meta.json unreadable, another GGUF, arrays orbax cannot read or whose bytes changed) is a `CacheError`, one line;
`save` removes meta.json first and writes it last, so an entry cut short is never read.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import zlib

import jax
import numpy as np

from model.config import ModelConfig
from ops.qtensor import QTensor

LAYOUT_VERSION = 3  # 2: QTensors stored as per-field planes (ops/repack); 3: GGUF identity, CRC-32 per array
_SEP = "/"


class CacheError(Exception):
  """A cache entry that cannot be used (one line); the caller loads the GGUF again and rewrites the entry."""


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


def check_root(root: str) -> None:
  """A NotADirectoryError (one line) when the cache folder `root` exists and is not a folder."""
  if os.path.exists(root) and not os.path.isdir(root):
    raise NotADirectoryError(f"cache_dir {root}: is a file, expected a directory")


def entry_dir(gguf_path: str, root: str) -> str:
  st = os.stat(gguf_path)
  h = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|v{LAYOUT_VERSION}".encode()).hexdigest()
  return os.path.join(os.path.abspath(root), h[:24])


def _crc(a) -> str:
  b = np.ascontiguousarray(np.asarray(a))
  return f"{zlib.crc32(b.reshape(-1).view(np.uint8)):08x}"


def checksums(arrays: dict) -> dict[str, str]:
  """key -> CRC-32 (hex) of the array's bytes as they sit in host memory (copied there from a device), in threads
  (zlib releases the GIL)."""
  with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as ex:
    return dict(zip(arrays, ex.map(_crc, arrays.values())))


def save(directory: str, cfg: ModelConfig, params: dict, tokenizer_md: dict, gguf_identity: dict) -> None:
  """Write the entry of a file whose identity (model.gguf_io.identity) is `gguf_identity`."""
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
  meta_path = os.path.join(directory, "meta.json")
  if os.path.exists(meta_path):
    os.remove(meta_path)                            # until the new arrays are written, the entry is absent
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.join(directory, "params"), arrays, force=True)
  ckpt.wait_until_finished()
  meta = {"layout": LAYOUT_VERSION, "config": dataclasses.asdict(cfg), "packing": packing, "tokenizer": tokenizer_md,
          "shapes": {k: [list(a.shape), str(a.dtype)] for k, a in arrays.items()}, "gguf": gguf_identity,
          "crc32": checksums(arrays)}
  with open(meta_path + ".tmp", "w") as f:
    json.dump(meta, f)
  os.replace(meta_path + ".tmp", meta_path)


@contextlib.contextmanager
def _asyncio_quiet():
  """Drop the asyncio logger's records while orbax reads: a read that fails leaves one 'unhandled exception during
  asyncio.run() shutdown' ERROR per pending chunk (hundreds of lines) beside the exception that restore reports."""
  log = logging.getLogger("asyncio")
  drop = lambda record: False  # noqa: E731
  log.addFilter(drop)
  try:
    yield
  finally:
    log.removeFilter(drop)


def restore(directory: str, gguf_path: str):
  """(ModelConfig, params, tokenizer metadata) from the entry of `gguf_path`, or None if there is none; a
  CacheError (one line) when the entry cannot be used: meta.json unreadable or of another layout, the GGUF's
  identity not the one recorded, arrays orbax cannot read, or an array whose CRC-32 is not the recorded one."""
  from model.gguf_io import identity
  meta_path = os.path.join(directory, "meta.json")
  if not os.path.isfile(meta_path):
    return None
  import orbax.checkpoint as ocp
  try:
    with open(meta_path) as f:
      meta = json.load(f)
    if meta.get("layout") != LAYOUT_VERSION:
      raise CacheError(f"cache entry {directory}: layout {meta.get('layout')!r}, expected {LAYOUT_VERSION}")
    want = dict(meta["gguf"])
    start = int(want["data_start"])
    cfg = ModelConfig(**meta["config"])
    abstract = {k: jax.ShapeDtypeStruct(tuple(s), np.dtype(d) if d != "bfloat16" else jax.numpy.bfloat16)
                for k, (s, d) in meta["shapes"].items()}
    crcs, packing, tok_md = meta["crc32"], meta["packing"], meta["tokenizer"]
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:   # JSONDecodeError is a ValueError
    raise CacheError(f"cache entry {directory}: unreadable meta.json ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''})") from None
  got = identity(gguf_path, start)
  if got != want:
    what = next((k for k in ("size", "mtime_ns", "header_sha256") if got[k] != want.get(k)), "identity")
    raise CacheError(f"cache entry {directory}: recorded for another {gguf_path} (its {what} differs)")
  try:
    with _asyncio_quiet():
      arrays = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), abstract)
  except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many types for missing or damaged data:
    # each means the entry cannot be used, and the GGUF it came from is still there to load
    why = str(e).splitlines()[0].split(". See full TensorStore details")[0][:200] if str(e) else ""
    raise CacheError(f"cache entry {directory}: orbax cannot read its arrays ({type(e).__name__}: {why})") from None
  if set(arrays) != set(crcs):
    raise CacheError(f"cache entry {directory}: arrays {sorted(set(arrays) ^ set(crcs))[:3]} do not match meta.json")
  for k, c in checksums(arrays).items():
    if c != crcs[k]:
      raise CacheError(f"cache entry {directory}: array '{k}' has CRC-32 {c}, recorded {crcs[k]} (damaged data)")
  flat = {k: a for k, a in arrays.items() if "@" not in k}
  try:
    for k, p in packing.items():
      flat[k] = QTensor(tuple(arrays[f"{k}@{name}"] for name in p["planes"]), p["qtype"], p["n"])
  except (KeyError, TypeError, ValueError) as e:
    raise CacheError(f"cache entry {directory}: packing in meta.json does not match its arrays ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''})") from None
  return cfg, _unflatten(flat), tok_md
