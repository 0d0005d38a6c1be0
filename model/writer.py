"""GGUF writer: tiny random models for tests, and full-size synthetic files for benchmarks.

`write_gguf` writes every tensor `model.gguf_io.tensor_map` names for a `ModelConfig`, streaming one tensor
at a time (a 30B-shape file never sits in memory). Float tensors get random values of a stable scale;
quantized tensors are random *valid* blocks written directly as bytes (`ops.quant.random_blocks`), which is
how the full-size synthetic files are made without any real weights. The tokenizer is the caller's (a
`configs.vocab.VocabSpec`-like object): model/ does not import configs/.

Hybrid files (qwen3next, qwen35moe) are what llama.cpp 0.3.36 loads and runs: the layer layout as
`full_attention_interval` when it is that pattern, else `attention.recurrent_layers`; `ssm_conv1d` always F32
(ggml's CPU ssm_conv reads F32 weights only, and llama.cpp's quantizer leaves the tensor as it is).
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from model.config import ModelConfig
from model.gguf_io import tensor_map

TypePolicy = Callable[[str, tuple[int, ...]], str]


def _always_f32(name: str, shape: tuple[int, ...]) -> bool:
  """1-D tensors (norms, biases, ssm_a) and the Gated DeltaNet conv kernel stay F32, as llama.cpp's files have them."""
  return len(shape) == 1 or "ssm_conv1d" in name


def float_policy(dtype: str = "F16") -> TypePolicy:
  """2-D and 3-D weights in `dtype` (F32/F16/BF16); 1-D tensors (norms, biases) and ssm_conv1d in F32, as
  llama.cpp writes."""
  return lambda name, shape: "F32" if _always_f32(name, shape) else dtype


def quant_policy(experts: str = "IQ3_S", other: str = "Q8_0") -> TypePolicy:
  """Routed experts in `experts`, other matrices in `other`; router, ssm_conv1d and 1-D tensors in F32."""
  def pick(name: str, shape: tuple[int, ...]) -> str:
    if _always_f32(name, shape) or "ffn_gate_inp" in name:
      return "F32"
    return experts if "_exps." in name else other
  return pick


def _write_metadata(w, c: ModelConfig, name: str) -> None:
  a = c.arch
  w.add_string("general.name", name)
  u32 = lambda k, v: w.add_uint32(f"{a}.{k}", int(v))  # noqa: E731
  u32("block_count", c.n_blocks)
  u32("context_length", c.context_length)
  u32("embedding_length", c.d_model)
  u32("feed_forward_length", c.d_ff or c.d_ff_expert * c.top_k)
  u32("attention.head_count", c.n_heads)
  u32("attention.head_count_kv", c.n_kv_heads)
  u32("attention.key_length", c.head_dim)
  u32("attention.value_length", c.head_dim)
  u32("rope.dimension_count", c.rope_dim)
  w.add_float32(f"{a}.rope.freq_base", c.rope_theta)
  w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c.rms_eps)
  u32("expert_count", c.n_experts)
  u32("expert_used_count", c.top_k)
  u32("expert_feed_forward_length", c.d_ff_expert)
  if a == "qwen2moe" or c.is_hybrid:
    u32("expert_shared_feed_forward_length", c.d_ff_shared)
  if a == "glm4moe":
    u32("leading_dense_block_count", c.n_dense_lead)
    u32("expert_shared_count", c.n_shared_experts)
    w.add_float32(f"{a}.expert_weights_scale", c.routed_scale)
    w.add_bool(f"{a}.expert_weights_norm", c.norm_topk)
    u32("expert_gating_func", 2)
    u32("nextn_predict_layers", c.n_nextn)
  if c.is_hybrid:
    u32("nextn_predict_layers", c.n_nextn)
    u32("ssm.conv_kernel", c.ssm_conv_kernel)
    u32("ssm.inner_size", c.ssm_inner)
    u32("ssm.state_size", c.ssm_state)
    u32("ssm.time_step_rank", c.ssm_dt_rank)
    u32("ssm.group_count", c.ssm_groups)
    k = _interval(c.recurrent)
    if k is not None:
      u32("full_attention_interval", k)
    else:
      w.add_array(f"{a}.attention.recurrent_layers", [bool(r) for r in c.recurrent] + [False] * c.n_nextn)
    if c.rope_mode == "imrope":
      w.add_array(f"{a}.rope.dimension_sections", [int(x) for x in c.rope_sections])


def _interval(recurrent: tuple[bool, ...]) -> int | None:
  """The full_attention_interval k whose layout (layer i recurrent iff (i + 1) % k != 0) is `recurrent`, if any."""
  n = len(recurrent)
  for k in range(1, n + 2):
    if tuple((i + 1) % k != 0 for i in range(n)) == tuple(recurrent):
      return k
  return None


def write_vocab(w, vocab) -> None:
  """Every tokenizer.ggml.* key llama.cpp needs for `vocab` (a configs.vocab.VocabSpec or any object with its
  fields; byte-level BPE: tokens, token_types, merges, bos_id, eos_id, pre, add_bos; the eos token also pads) into
  `w`, a gguf.GGUFWriter."""
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(vocab.pre)
  w.add_token_list(list(vocab.tokens))
  w.add_token_types(list(vocab.token_types))
  w.add_token_merges(list(vocab.merges))
  w.add_bos_token_id(vocab.bos_id)
  w.add_eos_token_id(vocab.eos_id)
  w.add_pad_token_id(vocab.eos_id)
  w.add_add_bos_token(vocab.add_bos)


def _random_float(name: str, shape: tuple[int, ...], rng: np.random.Generator, cfg: ModelConfig) -> np.ndarray:
  """Random values of a scale that keeps a random model's activations and logits well spread.

  Router gains were chosen by measurement on the tiny files: softmax routers with a large gain, sigmoid routers
  (glm4moe) with a small one, since a large gain saturates the sigmoid and leaves near-ties between experts that
  llama.cpp's 8-bit activations then break differently (one flipped expert moves a position's logits ~50 %).
  """
  if len(shape) == 1:
    if name.endswith(".ssm_a"):       # -exp(A_log): log-decays of 0.2-2 per unit of softplus(alpha + dt_bias)
      return (-rng.uniform(0.2, 2.0, shape)).astype(np.float32)
    if name.endswith(".bias"):
      return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if "shexp" in name:  # qwen2moe shared-expert gate vector
      return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)   # norm weights
  fan_in = shape[-1]
  gain = 1.0
  if name in ("output.weight",) or name.endswith("shared_head_head.weight"):
    gain = 4.0       # spread the logits so argmax is decisive
  elif "ffn_gate_inp" in name:
    gain = 3.0 if cfg.routing == "softmax" else 0.5
  elif name == "token_embd.weight" or name.endswith("embed_tokens.weight"):
    return rng.standard_normal(shape).astype(np.float32)
  return (gain * rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def _random_tensor(tname: str, shape: tuple[int, ...], t: str, rng: np.random.Generator, cfg: ModelConfig,
                   block_scale: float) -> np.ndarray:
  """One tensor as the file stores it: F32/F16 values, BF16 raw bytes, or random valid quantized blocks."""
  from ops import quant
  if t in ("F32", "F16"):
    return _random_float(tname, shape, rng, cfg).astype(np.float32 if t == "F32" else np.float16)
  if t == "BF16":
    f = _random_float(tname, shape, rng, cfg)
    return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(tuple(shape[:-1]) + (2 * shape[-1],))
  return quant.random_blocks(t, shape, rng, scale=block_scale)


def write_gguf(path: str | os.PathLike, cfg: ModelConfig, vocab, *, types: TypePolicy | None = None, seed: int = 0,
               name: str | None = None, progress: bool = False, block_scale: float = 1e-3) -> str:
  """Write a random model of shape `cfg` to `path`; returns the path.

  vocab: the tokenizer, a `configs.vocab.VocabSpec`-like object (tokens, token_types, merges, bos_id, eos_id,
    pre, add_bos; dataclasses.replace-able), padded with unused control tokens to cfg.vocab_size.
  types: tensor name, numpy shape -> GGUF type name (default: `float_policy("F16")`).
  """
  import gguf

  from ops import quant

  types = types or float_policy("F16")
  rng = np.random.default_rng(seed)
  vocab = pad_vocab(vocab, cfg.vocab_size)
  fake = _FakeFile(cfg)
  entries = sorted(tensor_map(cfg, fake).values(), key=lambda e: _order(e[0]))
  w = gguf.GGUFWriter(str(path), cfg.arch)
  _write_metadata(w, cfg, name or f"random-{cfg.arch}")
  write_vocab(w, vocab)
  plan = []
  for tname, shape in entries:
    t = types(tname, shape)
    qt = gguf.GGMLQuantizationType[t]
    if t in ("F32", "F16"):
      dt = np.float32 if t == "F32" else np.float16
      w.add_tensor_info(tname, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
    else:
      nb = quant.row_bytes(t, shape[-1])
      byte_shape = tuple(shape[:-1]) + (nb,)
      w.add_tensor_info(tname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qt)
    plan.append((tname, shape, t))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()
  it = plan
  if progress:
    from tqdm import tqdm
    it = tqdm(plan, desc=f"writing {os.path.basename(str(path))}", unit="tensor")
  for tname, shape, t in it:
    w.write_tensor_data(_random_tensor(tname, shape, t, rng, cfg, block_scale))
  w.close()
  return str(path)


def pad_vocab(vocab, n: int):
  """The vocab padded with unused control tokens `<|pad_i|>` up to n entries (full-size shapes)."""
  if len(vocab.tokens) == n:
    return vocab
  if len(vocab.tokens) > n:
    raise ValueError(f"vocab has {len(vocab.tokens)} tokens, more than the model's vocab_size {n}")
  import dataclasses
  extra = n - len(vocab.tokens)
  return dataclasses.replace(vocab, tokens=tuple(vocab.tokens) + tuple(f"<|pad_{i}|>" for i in range(extra)),
                             token_types=tuple(vocab.token_types) + (3,) * extra)


def _order(name: str):
  """GGUF order: token_embd, blocks by index, then output_norm / output."""
  if name.startswith("blk."):
    return (1, int(name.split(".")[1]), name)
  return (0 if name.startswith("token_embd") else 2, 0, name)


class _FakeFile:
  """Answers `has` for optional tensors: the writer writes the NextN head norm but not an own head/embedding, and
  the hybrid layers' attn_qkv / attn_gate (not the legacy ssm_in)."""

  def __init__(self, cfg):
    self.cfg = cfg

  def has(self, name: str) -> bool:
    return False


def random_params(cfg: ModelConfig, *, types: TypePolicy | None = None, seed: int = 0, block_scale: float = 1e-3,
                  progress: bool = False, workers: int | None = None, place=None) -> dict:
  """The params pytree of a random model of shape `cfg`, with the tensors, types and layout that `write_gguf` +
  `load_gguf` would give, built in memory (benchmarks on full-size shapes skip the multi-GB file round trip; the
  loader's path is tested on the tiny files). Tensor i (in file order) draws from its own generator (seed, i), so
  `workers` threads (default: up to 8, one per core) build tensors at once (numpy's bulk work and the transfers
  release the GIL; the seed-mtp shape took 82 s on one thread on the H200 machine) and the result does not depend
  on their number. The values are not write_gguf's (one generator for the whole file there). `place(path, param)`,
  when given, is applied to each param as it is built, as load_params' hook (model.mesh.placer: a model larger than
  one device, split over a mesh, never whole on one device)."""
  import concurrent.futures as cf

  from model.gguf_io import to_params
  types = types or float_policy("F16")
  entries = sorted(tensor_map(cfg, _FakeFile(cfg)).items(), key=lambda e: _order(e[1][0]))

  def build(i):
    path, (tname, shape) = entries[i]
    t = types(tname, shape)
    pieces = to_params(cfg, path, t, _random_tensor(tname, shape, t, np.random.default_rng([seed, i]), cfg,
                                                    block_scale), shape)
    return [(p, place(tuple(p), v)) for p, v in pieces] if place else pieces

  from tqdm import tqdm
  built = [None] * len(entries)
  with cf.ThreadPoolExecutor(workers or max(1, min(8, os.cpu_count() or 1))) as pool, \
       tqdm(total=len(entries), desc="random params", unit="tensor", disable=not progress) as bar:
    futures = {pool.submit(build, i): i for i in range(len(entries))}
    for f in cf.as_completed(futures):
      built[futures[f]] = f.result()
      bar.update()
  params: dict = {}
  for pieces in built:
    for path, param in pieces:
      node = params
      for p in path[:-1]:
        node = node.setdefault(p, {})
      node[path[-1]] = param
  return params
