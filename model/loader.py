"""`load_model`: a GGUF file (or its orbax cache entry) -> `LoadedModel` (config, params, tokenizer)."""
from __future__ import annotations

import dataclasses
import os
import time

from absl import logging

from model import checkpoint
from model.config import ModelConfig
from model.api import fuse_qkv
from model.gguf_io import identity, load_gguf

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "moejax", "params")


@dataclasses.dataclass
class LoadedModel:
  cfg: ModelConfig
  params: dict
  tokenizer: "object"
  path: str
  from_cache: bool = False
  load_s: float = 0.0


def _tokenizer_md(md: dict) -> dict:
  return {k: v for k, v in md.items() if k.startswith("tokenizer.")}


def load_model(path: str, cache_dir: str | None = None, expert_store: str | None = None,
               mesh=None) -> LoadedModel:
  """Load `path`; with `cache_dir`, read the orbax entry if one exists, else parse GGUF and write the entry.

  An entry that cannot be used (model.checkpoint.restore's CacheError: damaged, cut short, another file's) is
  reported in one warning line and the GGUF is loaded again, the entry rewritten. A `cache_dir` that is a file is
  a NotADirectoryError.

  `expert_store` (a memory kind, e.g. "pinned_host"; None or "device": device memory) places the routed experts
  there: from a GGUF file one tensor at a time as they are built, so the device never holds the whole store
  (the expert cache's case: a model larger than the device); from the orbax cache after the restore.
  `mesh` (a jax.sharding.Mesh, model.mesh.make_mesh; None: one device) places every param on it as it is built
  (model.mesh.placer: routed experts split by expert id over "ep", the rest replicated; from the orbax cache after
  the restore, tensor by tensor); it excludes `expert_store`. A model whose experts do not split is a MeshError.
  Attention's q, k and v weights are fused into one (model.api.fuse_qkv); the cache stores them as in the file.

  >>> from configs.default import default_model_path
  >>> m = load_model(default_model_path())
  >>> m.cfg.arch, m.cfg.n_nextn
  ('glm4moe', 1)
  """
  from model.tokenizer import Tokenizer
  t0 = time.perf_counter()
  store = expert_store if expert_store not in (None, "device") else None
  if mesh is not None and store:
    raise ValueError(f"load_model: expert_store {store!r} under a mesh, expected every expert on the devices")
  if cache_dir:
    checkpoint.check_root(cache_dir)
  if cache_dir and os.path.isfile(path):
    entry = checkpoint.entry_dir(path, cache_dir)
    try:
      got = checkpoint.restore(entry, path)
    except checkpoint.CacheError as e:
      logging.warning("%s; loading %s from the GGUF again (the entry is rewritten)", e, path)
      got = None
    if got is not None:
      cfg, params, tok_md = got
      logging.info("loaded %s from cache %s", path, entry)
      if store:
        from model.expert_cache import place_store
        params = place_store(params, cfg, store)
      if mesh is not None:
        from model.mesh import check_experts, shard_params, spec_from
        check_experts(spec_from(mesh), cfg.n_experts)
        params = shard_params(params, mesh)
      return LoadedModel(cfg, fuse_qkv(params), Tokenizer.from_metadata(tok_md), path, True, time.perf_counter() - t0)
  place = None
  if store:
    from model.expert_cache import placer
    place = placer(store)
  if mesh is not None:
    from model.mesh import placer
    place = placer(mesh)
  cfg, params, tok, f = load_gguf(path, place)
  if cache_dir:
    checkpoint.save(checkpoint.entry_dir(path, cache_dir), cfg, params, _tokenizer_md(f.md),
                    identity(path, f.data_start))
  return LoadedModel(cfg, fuse_qkv(params), tok, path, False, time.perf_counter() - t0)
