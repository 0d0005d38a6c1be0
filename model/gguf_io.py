"""GGUF reading and validation: metadata -> `ModelConfig`, tensors -> the params pytree.

Quantized tensors stay packed (`QTensor` over the file's bytes); no full-precision copy of an expert is made.
Every problem with a file is a `GGUFError` whose message is one line naming the file, the key or tensor,
and what was expected.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from model.config import ARCHS, HYBRID_ARCHS, ModelConfig

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ3_S", "IQ4_NL", "IQ4_XS")


class GGUFError(ValueError):
  """A GGUF file we cannot use; the message is one line."""


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


def check_layout(path: str) -> None:
  """Walk the header (without gguf-py) and check that every tensor's bytes lie inside the file.

  gguf-py fails on short files with whatever numpy error the first bad view raises; this names the problem.
  """
  import struct

  import gguf
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    buf = f.read(min(size, 64 << 20))
  pos = 0

  def take(n: int) -> bytes:
    nonlocal pos
    if pos + n > len(buf):
      what = "header" if len(buf) == size else "header (over 64 MiB)"
      raise GGUFError(f"{path}: truncated GGUF ({size} bytes): the {what} ends at byte {len(buf)}, needed {pos + n}")
    b = buf[pos:pos + n]
    pos += n
    return b

  u32 = lambda: struct.unpack("<I", take(4))[0]  # noqa: E731
  u64 = lambda: struct.unpack("<Q", take(8))[0]  # noqa: E731

  def skip_value(vt: int) -> None:
    if vt == _STRING:
      take(u64())
    elif vt == _ARRAY:
      sub, n = u32(), u64()
      if sub in _SCALAR:
        take(_SCALAR[sub] * n)
      else:
        for _ in range(n):
          skip_value(sub)
    elif vt in _SCALAR:
      take(_SCALAR[vt])
    else:
      raise GGUFError(f"{path}: corrupt GGUF: unknown metadata value type {vt}")

  take(4)
  version = u32()
  if version not in (2, 3):
    raise GGUFError(f"{path}: GGUF version {version}, expected 2 or 3")
  n_tensors, n_kv = u64(), u64()
  alignment = 32
  for _ in range(n_kv):
    key = take(u64()).decode("utf-8", "replace")
    vt = u32()
    if key == "general.alignment" and vt == 4:
      alignment = u32()
    else:
      skip_value(vt)
  infos = []
  for _ in range(n_tensors):
    name = take(u64()).decode("utf-8", "replace")
    dims = [u64() for _ in range(u32())]
    tid, off = u32(), u64()
    try:
      qt = gguf.GGMLQuantizationType(tid)
    except ValueError:
      raise GGUFError(f"{path}: tensor '{name}' has unknown type id {tid}; supported: {', '.join(SUPPORTED_TYPES)}") from None
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    n = 1
    for d in dims:
      n *= d
    infos.append((name, off, n // bs * ts))
  start = (pos + alignment - 1) // alignment * alignment
  for name, off, nbytes in infos:
    if start + off + nbytes > size:
      raise GGUFError(f"{path}: truncated GGUF ({size} bytes): tensor '{name}' needs bytes up to {start + off + nbytes}")


class GGUFFile:
  """Metadata (`md`: key -> python value) and tensors (`tensors`: name -> gguf ReaderTensor) of one file."""

  def __init__(self, path: str | os.PathLike):
    import gguf  # gguf-py: parses the container; we validate what it returns
    self.path = str(path)
    if not os.path.isfile(self.path):
      raise GGUFError(f"{self.path}: no such file")
    with open(self.path, "rb") as f:
      magic = f.read(4)
    if magic != b"GGUF":
      raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    size = os.path.getsize(self.path)
    check_layout(self.path)
    try:
      r = gguf.GGUFReader(self.path)
    except Exception as e:  # gguf-py raises ValueError / IndexError / struct errors on short or bad files
      msg = str(e).splitlines()[0] if str(e) else type(e).__name__
      if "reshape" in msg or "exceeds remaining" in msg or isinstance(e, (IndexError, EOFError)):
        raise GGUFError(f"{self.path}: truncated GGUF ({size} bytes): {msg}") from None
      if "GGMLQuantizationType" in msg:
        raise GGUFError(f"{self.path}: unsupported tensor type ({msg}); supported: {', '.join(SUPPORTED_TYPES)}") from None
      raise GGUFError(f"{self.path}: corrupt GGUF: {msg}") from None
    self.md: dict[str, Any] = {}
    for name, field in r.fields.items():
      if name.startswith("GGUF."):
        continue
      v = field.contents()
      self.md[name] = v
    self.tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
      if t.data_offset + t.n_bytes > size:
        raise GGUFError(f"{self.path}: truncated GGUF ({size} bytes): tensor '{t.name}' needs bytes up to "
                        f"{t.data_offset + t.n_bytes}")

  # -- metadata ---------------------------------------------------------------------------------------
  def get(self, key: str, default: Any = None) -> Any:
    return self.md.get(key, default)

  def require(self, key: str, kind: type | tuple = (int, float)) -> Any:
    if key not in self.md:
      raise GGUFError(f"{self.path}: missing required key '{key}'")
    v = self.md[key]
    if isinstance(v, list) and kind is not list:
      v = v[0] if v else None  # per-layer arrays (e.g. expert_feed_forward_length): layers share one value here
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
      raise GGUFError(f"{self.path}: key '{key}' is {v!r}, expected {getattr(kind, '__name__', kind)}")
    return v

  # -- tensors ----------------------------------------------------------------------------------------
  def has(self, name: str) -> bool:
    return name in self.tensors

  def tensor(self, name: str, shape: tuple[int, ...]):
    """The tensor as (qtype name, numpy view), checked against the expected numpy shape."""
    if name not in self.tensors:
      raise GGUFError(f"{self.path}: missing tensor '{name}' (expected shape {list(shape)})")
    t = self.tensors[name]
    qtype = t.tensor_type.name
    got = tuple(int(d) for d in reversed(t.shape.tolist()))
    if got != tuple(shape):
      raise GGUFError(f"{self.path}: tensor '{name}' has shape {list(got)}, expected {list(shape)}")
    if qtype not in SUPPORTED_TYPES:
      raise GGUFError(f"{self.path}: tensor '{name}' has unsupported type {qtype}; supported: {', '.join(SUPPORTED_TYPES)}")
    return qtype, t.data


def read_config(f: GGUFFile) -> ModelConfig:
  """ModelConfig from metadata (and, for optional features, from which tensors exist)."""
  arch = f.get("general.architecture")
  if arch is None:
    raise GGUFError(f"{f.path}: missing required key 'general.architecture'")
  if arch not in ARCHS:
    raise GGUFError(f"{f.path}: unsupported arch '{arch}' (general.architecture); supported: {', '.join(ARCHS)}")
  if arch in HYBRID_ARCHS:
    return _read_hybrid_config(f, arch)
  k = lambda s: f"{arch}.{s}"  # noqa: E731
  n_blocks = f.require(k("block_count"), int)
  n_nextn = int(f.get(k("nextn_predict_layers"), 0) or 0)
  d_model = f.require(k("embedding_length"), int)
  n_heads = f.require(k("attention.head_count"), int)
  n_kv = f.require(k("attention.head_count_kv"), int)
  head_dim = int(f.get(k("attention.key_length"), d_model // n_heads))
  vocab = _vocab_size(f)
  n_experts = f.require(k("expert_count"), int)
  top_k = f.require(k("expert_used_count"), int)
  d_ff_exp = f.require(k("expert_feed_forward_length"), int)
  kw: dict[str, Any] = {}
  if arch == "glm4moe":
    gating = int(f.get(k("expert_gating_func"), 2) or 2)
    if gating != 2:
      raise GGUFError(f"{f.path}: key '{k('expert_gating_func')}' is {gating}, expected 2 (sigmoid)")
    n_shared = int(f.get(k("expert_shared_count"), 0))
    kw.update(routing="sigmoid", norm_topk=bool(f.get(k("expert_weights_norm"), False)),
              routed_scale=float(f.get(k("expert_weights_scale"), 1.0)), n_dense_lead=int(f.get(k("leading_dense_block_count"), 0)),
              n_shared_experts=n_shared, d_ff_shared=d_ff_exp * n_shared)
  elif arch == "qwen3moe":
    kw.update(routing="softmax", norm_topk=True)
  else:  # qwen2moe
    has_sh = "blk.0.ffn_gate_inp_shexp.weight" in f.tensors
    kw.update(routing="softmax", norm_topk=False, shared_expert_gate=has_sh, n_shared_experts=int(has_sh),
              d_ff_shared=int(f.get(k("expert_shared_feed_forward_length"), 0)))
  if kw.get("n_dense_lead"):
    kw["d_ff"] = f.require(k("feed_forward_length"), int)
  return ModelConfig(
      arch=arch, vocab_size=vocab, d_model=d_model, n_layers=n_blocks - n_nextn, n_heads=n_heads, n_kv_heads=n_kv,
      head_dim=head_dim, rope_dim=int(f.get(k("rope.dimension_count"), head_dim)),
      rope_theta=float(f.get(k("rope.freq_base"), 10000.0)), rms_eps=float(f.require(k("attention.layer_norm_rms_epsilon"), float)),
      n_experts=n_experts, top_k=top_k, d_ff_expert=d_ff_exp, n_nextn=n_nextn,
      qk_norm="blk.0.attn_q_norm.weight" in f.tensors, qkv_bias="blk.0.attn_q.bias" in f.tensors,
      tied_embeddings="output.weight" not in f.tensors, context_length=int(f.get(k("context_length"), 4096)), **kw)


def _vocab_size(f: GGUFFile) -> int:
  if "token_embd.weight" not in f.tensors:
    raise GGUFError(f"{f.path}: missing tensor 'token_embd.weight'")
  vocab = int(f.tensors["token_embd.weight"].shape[1])
  toks = f.get("tokenizer.ggml.tokens")
  if toks is not None and len(toks) != vocab:
    raise GGUFError(f"{f.path}: key 'tokenizer.ggml.tokens' has {len(toks)} entries, expected {vocab} (token_embd rows)")
  return vocab


def _int_list(f: GGUFFile, key: str, n: int, what: str) -> list[int]:
  """A key llama.cpp reads with get_key_or_arr: one value for all n entries, or an array of exactly n."""
  v = f.md.get(key)
  if isinstance(v, list):
    if len(v) != n:
      raise GGUFError(f"{f.path}: key '{key}' has {len(v)} entries, expected {n} ({what})")
    vals = v
  else:
    vals = [v] * n
  if not all(isinstance(x, int) for x in vals):
    raise GGUFError(f"{f.path}: key '{key}' is {v!r}, expected int or an array of int")
  return [int(x) for x in vals]


def _read_hybrid_config(f: GGUFFile, arch: str) -> ModelConfig:
  """qwen3next / qwen35moe as llama.cpp 0.3.36 reads them (src/models/{qwen3next,qwen35moe}.cpp
  load_arch_hparams, llama-model.cpp load_hparams)."""
  k = lambda s: f"{arch}.{s}"  # noqa: E731
  n_blocks = f.require(k("block_count"), int)
  n_nextn = int(f.get(k("nextn_predict_layers"), 0) or 0)
  if not 0 <= n_nextn < n_blocks:
    raise GGUFError(f"{f.path}: key '{k('nextn_predict_layers')}' is {n_nextn}, expected 0 <= n < block_count "
                    f"{n_blocks}")
  n_layers = n_blocks - n_nextn
  d_model = f.require(k("embedding_length"), int)
  rkey = k("attention.recurrent_layers")
  if rkey in f.md:
    arr = f.md[rkey]
    if not isinstance(arr, list) or len(arr) != n_blocks or not all(isinstance(x, (bool, int)) for x in arr):
      raise GGUFError(f"{f.path}: key '{rkey}' is {arr!r}, expected an array of {n_blocks} bools (block_count)")
    if any(arr[n_layers:]):
      raise GGUFError(f"{f.path}: key '{rkey}' marks a NextN block recurrent, expected false for blocks >= {n_layers}")
    recurrent = tuple(bool(x) for x in arr[:n_layers])
  else:
    interval = f.get(k("full_attention_interval"), 4)      # llama.cpp's default: 4
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
      raise GGUFError(f"{f.path}: key '{k('full_attention_interval')}' is {interval!r}, expected an int >= 1")
    recurrent = tuple((i + 1) % interval != 0 for i in range(n_layers))
  attn = [i for i in range(n_layers) if not recurrent[i]] + list(range(n_layers, n_blocks))
  if not attn:
    raise GGUFError(f"{f.path}: every block is recurrent ('{rkey}'): no attention layer to read head counts from")
  if k("attention.head_count") not in f.md:
    raise GGUFError(f"{f.path}: missing required key '{k('attention.head_count')}'")
  heads = _int_list(f, k("attention.head_count"), n_blocks, "block_count")
  kvh = (_int_list(f, k("attention.head_count_kv"), n_blocks, "block_count") if k("attention.head_count_kv") in f.md
         else heads)
  n_heads, n_kv = heads[attn[0]], kvh[attn[0]]
  for i in attn:
    if (heads[i], kvh[i]) != (n_heads, n_kv):
      raise GGUFError(f"{f.path}: attention block {i} has {heads[i]}/{kvh[i]} heads, expected the same "
                      f"{n_heads}/{n_kv} in every attention block")
  if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
    raise GGUFError(f"{f.path}: key '{k('attention.head_count')}' / '{k('attention.head_count_kv')}' are "
                    f"{n_heads} / {n_kv}, expected positive with head_count a multiple of head_count_kv")
  head_dim = int(f.get(k("attention.key_length"), d_model // n_heads))
  head_dim_v = int(f.get(k("attention.value_length"), d_model // n_heads))
  if head_dim_v != head_dim:
    raise GGUFError(f"{f.path}: key '{k('attention.value_length')}' is {head_dim_v}, expected key_length {head_dim}")
  rope_dim = int(f.get(k("rope.dimension_count"), head_dim))
  if rope_dim % 2 or not 0 < rope_dim <= head_dim:
    raise GGUFError(f"{f.path}: key '{k('rope.dimension_count')}' is {rope_dim}, expected even and <= {head_dim}")
  vocab = _vocab_size(f)
  n_experts = f.require(k("expert_count"), int)
  top_k = f.require(k("expert_used_count"), int)
  if n_experts <= 0 or not 0 < top_k <= n_experts:
    raise GGUFError(f"{f.path}: key '{k('expert_count')}' / '{k('expert_used_count')}' are {n_experts} / {top_k}, "
                    f"expected experts > 0 and 0 < used <= experts")
  n_ff = _int_list(f, k("feed_forward_length"), n_blocks, "block_count")[0] if k("feed_forward_length") in f.md else 0
  d_ff_exp = f.require(k("expert_feed_forward_length"), int) if k("expert_feed_forward_length") in f.md else 0
  d_ff_exp = d_ff_exp or n_ff // top_k                # llama.cpp: n_ff_exp, else n_ff / n_expert_used
  d_ff_sh = int(f.get(k("expert_shared_feed_forward_length"), 0) or 0) or n_ff   # llama.cpp: n_ff_shexp, else n_ff
  for key, v in (("expert_feed_forward_length", d_ff_exp), ("expert_shared_feed_forward_length", d_ff_sh)):
    if v <= 0:
      raise GGUFError(f"{f.path}: missing required key '{k(key)}' (nor a '{k('feed_forward_length')}' to derive it "
                      f"from)")
  ssm = {}
  for name, key in (("ssm_conv_kernel", "conv_kernel"), ("ssm_inner", "inner_size"), ("ssm_state", "state_size"),
                    ("ssm_dt_rank", "time_step_rank"), ("ssm_groups", "group_count")):
    ssm[name] = f.require(k(f"ssm.{key}"), int)
    if ssm[name] <= 0:
      raise GGUFError(f"{f.path}: key '{k('ssm.' + key)}' is {ssm[name]}, expected > 0")
  if ssm["ssm_inner"] != ssm["ssm_dt_rank"] * ssm["ssm_state"]:
    raise GGUFError(f"{f.path}: key '{k('ssm.inner_size')}' is {ssm['ssm_inner']}, expected time_step_rank x "
                    f"state_size = {ssm['ssm_dt_rank'] * ssm['ssm_state']} (llama.cpp: value head dim == key head dim)")
  if ssm["ssm_dt_rank"] % ssm["ssm_groups"]:
    raise GGUFError(f"{f.path}: key '{k('ssm.time_step_rank')}' is {ssm['ssm_dt_rank']}, expected a multiple of "
                    f"ssm.group_count {ssm['ssm_groups']}")
  for i in attn:                # llama.cpp would also take a fused attn_qkv or q/k/v biases here: refuse, not ignore
    for n in ("attn_qkv.weight", "attn_qkv.bias", "attn_q.bias", "attn_k.bias", "attn_v.bias"):
      if f.has(f"blk.{i}.{n}"):
        raise GGUFError(f"{f.path}: tensor 'blk.{i}.{n}' in attention block {i} is not supported, expected separate "
                        f"attn_q / attn_k / attn_v weights without biases")
  kw: dict[str, Any] = {}
  if arch == "qwen35moe":                             # required (get_key_or_arr(..., 4, true)): M-RoPE sections
    skey = k("rope.dimension_sections")
    if skey not in f.md:
      raise GGUFError(f"{f.path}: missing required key '{skey}'")
    sec = _int_list(f, skey, 4, "M-RoPE sections")
    if min(sec) < 0 or not any(sec[:3]) or sum(sec) > rope_dim:
      raise GGUFError(f"{f.path}: key '{skey}' is {sec}, expected counts >= 0, one of the first three > 0 and a sum "
                      f"<= rope.dimension_count {rope_dim}")
    kw.update(rope_mode="imrope", rope_sections=tuple(sec))
  return ModelConfig(
      arch=arch, vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
      head_dim=head_dim, rope_dim=rope_dim, rope_theta=float(f.get(k("rope.freq_base"), 10000.0)),
      rms_eps=float(f.require(k("attention.layer_norm_rms_epsilon"), float)), n_experts=n_experts, top_k=top_k,
      d_ff_expert=d_ff_exp, n_shared_experts=1, d_ff_shared=d_ff_sh, shared_expert_gate=True,
      routing="softmax", norm_topk=True, qk_norm=True, n_nextn=n_nextn,
      tied_embeddings="output.weight" not in f.tensors, context_length=int(f.get(k("context_length"), 4096)),
      recurrent=recurrent, attn_output_gate=True, **ssm, **kw)


def _ffn_map(c: ModelConfig, i: int) -> dict[tuple[str, ...], tuple[str, tuple[int, ...]]]:
  D, b = c.d_model, f"blk.{i}."
  m: dict[tuple[str, ...], tuple[str, tuple[int, ...]]] = {}
  if c.is_moe_layer(i):
    E, F = c.n_experts, c.d_ff_expert
    m.update({("ffn", "router"): (b + "ffn_gate_inp.weight", (E, D)),
              ("ffn", "gate_exps"): (b + "ffn_gate_exps.weight", (E, F, D)),
              ("ffn", "up_exps"): (b + "ffn_up_exps.weight", (E, F, D)),
              ("ffn", "down_exps"): (b + "ffn_down_exps.weight", (E, D, F))})
    if c.routing == "sigmoid":
      m[("ffn", "router_bias")] = (b + "exp_probs_b.bias", (E,))
    if c.n_shared_experts or c.shared_expert_gate:
      Fs = c.d_ff_shared
      m.update({("ffn", "gate_shexp"): (b + "ffn_gate_shexp.weight", (Fs, D)),
                ("ffn", "up_shexp"): (b + "ffn_up_shexp.weight", (Fs, D)),
                ("ffn", "down_shexp"): (b + "ffn_down_shexp.weight", (D, Fs))})
    if c.shared_expert_gate:
      m[("ffn", "shexp_gate")] = (b + "ffn_gate_inp_shexp.weight", (D,))
  else:
    m.update({("ffn", "gate"): (b + "ffn_gate.weight", (c.d_ff, D)), ("ffn", "up"): (b + "ffn_up.weight", (c.d_ff, D)),
              ("ffn", "down"): (b + "ffn_down.weight", (D, c.d_ff))})
  return m


def _gdn_map(c: ModelConfig, i: int, f=None) -> dict[tuple[str, ...], tuple[str, tuple[int, ...]]]:
  """A Gated DeltaNet layer's mixer tensors (llama.cpp 0.3.36 create_tensor shapes, numpy order)."""
  D, Hv, Dv, b = c.d_model, c.Hv, c.Dv, f"blk.{i}."
  m: dict[tuple[str, ...], tuple[str, tuple[int, ...]]] = {}
  if c.arch == "qwen3next" and f is not None and not f.has(b + "attn_qkv.weight") and f.has(b + "ssm_in.weight"):
    m[("gdn", "w_in")] = (b + "ssm_in.weight", (c.Cc + Hv * Dv, D))        # legacy: split by load_params
  else:
    m[("gdn", "wqkv")] = (b + "attn_qkv.weight", (c.Cc, D))
    m[("gdn", "wz")] = (b + "attn_gate.weight", (Hv * Dv, D))
  m.update({("gdn", "conv"): (b + "ssm_conv1d.weight", (c.Cc, c.Kc)),
            ("gdn", "dt_bias"): (b + "ssm_dt.bias", (Hv,)),
            ("gdn", "a"): (b + "ssm_a", (Hv,))})
  if c.arch == "qwen3next":
    m[("gdn", "wba")] = (b + "ssm_ba.weight", (2 * Hv, D))                  # split by load_params
  else:
    m[("gdn", "wbeta")] = (b + "ssm_beta.weight", (Hv, D))
    m[("gdn", "walpha")] = (b + "ssm_alpha.weight", (Hv, D))
  m.update({("gdn", "norm"): (b + "ssm_norm.weight", (Dv,)), ("gdn", "wo"): (b + "ssm_out.weight", (D, Hv * Dv))})
  return m


def _block_map(c: ModelConfig, i: int, f=None) -> dict[tuple[str, ...], tuple[str, tuple[int, ...]]]:
  """Param path (inside the block) -> (GGUF tensor name, numpy shape) for block i."""
  D, Hq, Hkv, Dh = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
  b = f"blk.{i}."
  post_norm = c.arch == "glm4moe" or c.is_hybrid
  m = {("attn_norm",): (b + "attn_norm.weight", (D,)),
       ("ffn_norm",): (b + ("post_attention_norm.weight" if post_norm else "ffn_norm.weight"), (D,))}
  if c.is_recurrent(i):
    m.update(_gdn_map(c, i, f))
  else:
    nq = 2 if c.attn_output_gate else 1                 # gated: per head [query | gate], split by load_params
    m.update({
        ("attn", "wqg" if c.attn_output_gate else "wq"): (b + "attn_q.weight", (nq * Hq * Dh, D)),
        ("attn", "wk"): (b + "attn_k.weight", (Hkv * Dh, D)),
        ("attn", "wv"): (b + "attn_v.weight", (Hkv * Dh, D)),
        ("attn", "wo"): (b + "attn_output.weight", (D, Hq * Dh)),
    })
    if c.qkv_bias:
      m.update({("attn", "bq"): (b + "attn_q.bias", (Hq * Dh,)), ("attn", "bk"): (b + "attn_k.bias", (Hkv * Dh,)),
                ("attn", "bv"): (b + "attn_v.bias", (Hkv * Dh,))})
    if c.qk_norm:
      m.update({("attn", "q_norm"): (b + "attn_q_norm.weight", (Dh,)), ("attn", "k_norm"): (b + "attn_k_norm.weight", (Dh,))})
  m.update(_ffn_map(c, i))
  return m


def tensor_map(c: ModelConfig, f: GGUFFile | None = None) -> dict[tuple[str, ...], tuple[str, tuple[int, ...]]]:
  """Every param path -> (GGUF name, numpy shape). Optional NextN tensors are included when `f` has them.

  The params tree (`load_params`; numpy shapes [out, in]: y = x @ w.T; letters as docs/SHAPES.md):
    token_embd [V, D], output_norm [D], output [V, D] (absent when tied: the head is token_embd)
    blk_{i} (trunk block i < n_layers), mtp_{j}/blk (NextN block j, GGUF block n_layers + j):
      attn_norm [D]; ffn_norm [D] (ffn_norm.weight, or post_attention_norm.weight for glm4moe and the hybrid archs)
      attention block: attn/wq [H Dh, D], wk, wv [Hkv Dh, D], wo [D, H Dh], optional bq / bk / bv,
        q_norm / k_norm [Dh]; with attn_output_gate (hybrid) also attn/wgate [H Dh, D]: the file's attn_q is
        [H, 2, Dh] rows (per head its Dh query rows, then its Dh gate rows), split at load into wq and wgate; the
        layer's output is attention [T, H Dh] * sigmoid(x @ wgate.T) before wo
      Gated DeltaNet block (ModelConfig.is_recurrent(i)): attn_norm, ffn_norm and
        gdn/wqkv [Cc, D]   attn_qkv: rows q [Hk Dk] | k [Hk Dk] | v [Hv Dv], head-major (head h at h Dk / h Dv)
        gdn/wz [Hv Dv, D]  attn_gate: z, the gate of the output norm (value head h at rows h Dv)
        gdn/wbeta, gdn/walpha [Hv, D]  value-head rows: beta = sigmoid(x @ wbeta.T), alpha = x @ walpha.T
                           (qwen35moe: ssm_beta / ssm_alpha; qwen3next: ssm_ba [Hk, 2, Hv / Hk] rows, per key head
                           its Hv / Hk beta rows then its alpha rows, split at load; value head h = g (Hv / Hk) + j)
        gdn/conv [Cc, Kc]  ssm_conv1d (F32 in llama.cpp's files): out[t, c] = sum_k x[t - Kc + 1 + k, c] conv[c, k]
        gdn/dt_bias [Hv]   ssm_dt.bias; gdn/a [Hv] ssm_a = -exp(A_log): log-decay g = softplus(alpha + dt_bias) * a
        gdn/norm [Dv]      ssm_norm: RMSNorm over each value head, times silu(z)
        gdn/wo [D, Hv Dv]  ssm_out
        (legacy qwen3next files with ssm_in [Hk, 2 Dk + 2 (Hv / Hk) Dv] rows, per key head q | k | v | z, load into
        the same gdn/wqkv and gdn/wz)
      ffn (MoE blocks): router [E, D], gate_exps / up_exps [E, F, D], down_exps [E, D, F], router_bias [E]
        (glm4moe), gate_shexp / up_shexp [Fs, D], down_shexp [D, Fs], shexp_gate [D] (qwen2moe, hybrid: the
        shared expert's output times sigmoid(x . shexp_gate)); dense blocks: ffn/gate, up [Fd, D], down [D, Fd]
    mtp_{j}: enorm, hnorm [D], eh_proj [D, 2 D] (input: embedding first, then hidden), shared_head_norm [D],
      optional embed_tokens, shared_head_head [V, D], and blk (the block above).

  Keys here name file tensors; the three split ones (attn/wqg, gdn/wba, gdn/w_in) are replaced at load by the
  pieces `row_splits` names."""
  V, D = c.vocab_size, c.d_model
  m = {("token_embd",): ("token_embd.weight", (V, D)), ("output_norm",): ("output_norm.weight", (D,))}
  if not c.tied_embeddings:
    m[("output",)] = ("output.weight", (V, D))
  for i in range(c.n_layers):
    m.update({(f"blk_{i}",) + p: v for p, v in _block_map(c, i, f).items()})
  for j in range(c.n_nextn):
    i = c.n_layers + j
    n = f"blk.{i}.nextn."
    mm = {("enorm",): (n + "enorm.weight", (D,)), ("hnorm",): (n + "hnorm.weight", (D,)),
          ("eh_proj",): (n + "eh_proj.weight", (D, 2 * D)), ("shared_head_norm",): (n + "shared_head_norm.weight", (D,))}
    for opt, shape in (("embed_tokens", (V, D)), ("shared_head_head", (V, D))):
      if f is not None and f.has(n + opt + ".weight"):
        mm[(opt,)] = (n + opt + ".weight", shape)
    mm.update({("blk",) + p: v for p, v in _block_map(c, i, f).items()})
    m.update({(f"mtp_{j}",) + p: v for p, v in mm.items()})
  return m


def row_splits(c: ModelConfig, path: tuple[str, ...]) -> dict[str, np.ndarray] | None:
  """For a file tensor that load_params splits by rows: new last path key -> the source rows it takes, in order
  (a row permutation: quantized rows move whole, so every type splits exactly). None for other tensors."""
  key = path[-1]
  if key == "wqg":                                   # attn_q: [H, 2, Dh] rows
    r = np.arange(2 * c.n_heads * c.head_dim).reshape(c.n_heads, 2, c.head_dim)
    return {"wq": r[:, 0].reshape(-1), "wgate": r[:, 1].reshape(-1)}
  if key == "wba":                                   # ssm_ba: [Hk, 2, Hv / Hk] rows
    g = c.Hv // c.Hk
    r = np.arange(2 * c.Hv).reshape(c.Hk, 2, g)
    return {"wbeta": r[:, 0].reshape(-1), "walpha": r[:, 1].reshape(-1)}
  if key == "w_in":                                  # legacy ssm_in: [Hk, q Dk | k Dk | v (Hv/Hk) Dv | z (Hv/Hk) Dv]
    gv = c.Hv // c.Hk * c.Dv
    r = np.arange(c.Hk * (2 * c.Dk + 2 * gv)).reshape(c.Hk, 2 * c.Dk + 2 * gv)
    q, k, v, z = np.split(r, [c.Dk, 2 * c.Dk, 2 * c.Dk + gv], axis=1)
    return {"wqkv": np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)]), "wz": z.reshape(-1)}
  return None


def _to_param(qtype: str, data: np.ndarray, shape: tuple[int, ...]):
  import jax.numpy as jnp

  from ops.qtensor import QTensor
  if qtype == "F32":
    return jnp.asarray(np.asarray(data, np.float32).reshape(shape))
  if qtype == "F16":
    return jnp.asarray(np.asarray(data, np.float16).reshape(shape))
  if qtype == "BF16":  # gguf-py hands BF16 over as raw bytes / uint16
    raw = np.ascontiguousarray(data).view(np.uint16).reshape(shape)
    return jnp.asarray(raw).view(jnp.bfloat16)
  return QTensor.from_gguf(data, qtype, shape[-1])


def to_params(c: ModelConfig, path: tuple[str, ...], qtype: str, data: np.ndarray,
              shape: tuple[int, ...]) -> list[tuple[tuple[str, ...], Any]]:
  """The params one file tensor gives: [(path, param)], split by rows where `row_splits` says (data's first axis is
  the tensor's rows for every type: values, or each row's quantized blocks)."""
  split = row_splits(c, path)
  if split is None:
    return [(path, _to_param(qtype, data, shape))]
  data = np.asarray(data).reshape(shape[0], -1)
  return [(path[:-1] + (key,), _to_param(qtype, data[rows], (len(rows),) + tuple(shape[1:])))
          for key, rows in split.items()]


def load_params(f: GGUFFile, c: ModelConfig, place=None) -> dict:
  """The params pytree (nested dicts of arrays / QTensors; layout: `tensor_map`) for `c` from file `f`;
  `place(path, param)`, when given, is applied to each param as soon as it is built (e.g.
  model.expert_cache.placer: the routed experts go to host memory one tensor at a time)."""
  params: dict = {}
  for path, (name, shape) in tensor_map(c, f).items():
    qtype, data = f.tensor(name, shape)
    if len(shape) == 1 and qtype not in ("F32", "F16", "BF16"):
      raise GGUFError(f"{f.path}: tensor '{name}' is {qtype}, expected a float type for a 1-D tensor")
    for ppath, param in to_params(c, path, qtype, data, shape):
      node = params
      for p in ppath[:-1]:
        node = node.setdefault(p, {})
      node[ppath[-1]] = place(tuple(ppath), param) if place else param
  return params


def load_gguf(path: str | os.PathLike, place=None):
  """Read and validate a file: (ModelConfig, params, Tokenizer, GGUFFile); `place` as in load_params."""
  from model.tokenizer import Tokenizer
  f = GGUFFile(path)
  cfg = read_config(f)
  params = load_params(f, cfg, place)
  try:
    tok = Tokenizer.from_metadata(f.md)
  except ValueError as e:
    raise GGUFError(f"{f.path}: {str(e).splitlines()[0]}") from None
  return cfg, params, tok, f
