"""Validates the float64 numpy oracle (tests/ref_forward.py) against llama.cpp (llama-cpp-python) on tiny GGUFs.

Relative L2 of the logits over all positions, ||ref - llama|| / ||llama||: on an F16 file llama.cpp's CPU
matmuls round the activations to f16 (and the KV cache is f16), so ~1e-3 is expected; on an F32 file only
the f16 KV cache remains. Argmax must agree at every position.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ref_forward import RefModel, rms_norm, rope_neox  # noqa: E402

import gguf  # noqa: E402

N_TOKENS = 24
TOL_F16 = 5e-3
TOL_F32 = 1e-3


# ----------------------------------------------------------------------------------------------------------
# STAND-IN tiny GGUF writer. Used only while `model.writer.write_tiny_gguf` does not exist; kept here so the
# oracle's validation never depends on the code it validates.
# ----------------------------------------------------------------------------------------------------------

def _byte_symbols() -> list[str]:
  """GPT-2's bytes_to_unicode: the 256 byte-level symbols, in byte order."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  table = dict(zip(bs, cs))
  return [chr(table[b]) for b in range(256)]


def _tiny_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str], int]:
  """256 byte symbols + merges of letter pairs + 3 control tokens: (tokens, types, merges, eos id)."""
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  tokens = _byte_symbols()
  letters = "etaoinshrdlucmfwypvbgkjqxz"
  n_merges = vocab_size - 256 - len(specials)
  merges = [f"{a} {b}" for a in letters for b in letters][:n_merges]
  tokens += [m.replace(" ", "") for m in merges]
  types = [int(gguf.TokenType.NORMAL)] * len(tokens)
  eos = len(tokens)
  tokens += specials
  types += [int(gguf.TokenType.CONTROL)] * len(specials)
  assert len(tokens) == vocab_size and len(set(tokens)) == vocab_size
  return tokens, types, merges, eos


def _standin_write_tiny_gguf(path: str, arch: str, dtype: str = "f16", seed: int = 0) -> str:
  """Tiny qwen3moe or glm4moe (+1 NextN block) GGUF: hidden 256, 2 trunk layers, 4 q / 2 kv heads of 64,
  8 experts top-2 of width 256, vocab 512. glm4moe: block 0 dense, shared expert, sigmoid routing with a
  selection bias, partial rotary (32 of 64), q/k/v bias, weight norm + scale 2.5."""
  rng = np.random.default_rng(seed)
  D, L, H, Hkv, Dh, E, K, F, V = 256, 2, 4, 2, 64, 8, 2, 256, 512
  F_dense = 512
  wt = np.float16 if dtype == "f16" else np.float32

  def mat(out_f, in_f, *lead):
    return (rng.standard_normal((*lead, out_f, in_f)) / np.sqrt(in_f)).astype(wt)

  def norm_w(n):
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  def bias(n, s=0.1):
    return (s * rng.standard_normal(n)).astype(np.float32)

  glm = arch == "glm4moe"
  n_nextn = 1 if glm else 0
  w = gguf.GGUFWriter(path, arch)
  w.add_context_length(512)
  w.add_embedding_length(D)
  w.add_block_count(L + n_nextn)
  w.add_feed_forward_length(F_dense if glm else F)
  w.add_head_count(H)
  w.add_head_count_kv(Hkv)
  w.add_key_length(Dh)
  w.add_value_length(Dh)
  w.add_rope_dimension_count(Dh // 2 if glm else Dh)
  w.add_rope_freq_base(10000.0 if glm else 1000000.0)
  w.add_layer_norm_rms_eps(1e-6)
  w.add_expert_count(E)
  w.add_expert_used_count(K)
  w.add_expert_feed_forward_length(F)
  w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32))
  if glm:
    w.add_leading_dense_block_count(1)
    w.add_expert_shared_count(1)
    w.add_expert_weights_scale(2.5)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_nextn_predict_layers(n_nextn)
  tokens, types, merges, eos = _tiny_vocab(V)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("qwen2")
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  w.add_bos_token_id(eos)
  w.add_eos_token_id(eos)

  w.add_tensor("token_embd.weight", rng.standard_normal((V, D)).astype(wt))
  w.add_tensor("output_norm.weight", norm_w(D))
  w.add_tensor("output.weight", (2.0 * rng.standard_normal((V, D)) / np.sqrt(D)).astype(wt))
  for il in range(L + n_nextn):
    p = f"blk.{il}."
    w.add_tensor(p + "attn_norm.weight", norm_w(D))
    w.add_tensor(p + "attn_q.weight", mat(H * Dh, D))
    w.add_tensor(p + "attn_k.weight", mat(Hkv * Dh, D))
    w.add_tensor(p + "attn_v.weight", mat(Hkv * Dh, D))
    w.add_tensor(p + "attn_output.weight", mat(D, H * Dh))
    if glm:
      w.add_tensor(p + "attn_q.bias", bias(H * Dh))
      w.add_tensor(p + "attn_k.bias", bias(Hkv * Dh))
      w.add_tensor(p + "attn_v.bias", bias(Hkv * Dh))
      w.add_tensor(p + "post_attention_norm.weight", norm_w(D))
    else:
      w.add_tensor(p + "attn_q_norm.weight", norm_w(Dh))
      w.add_tensor(p + "attn_k_norm.weight", norm_w(Dh))
      w.add_tensor(p + "ffn_norm.weight", norm_w(D))
    if glm and il == 0:
      w.add_tensor(p + "ffn_gate.weight", mat(F_dense, D))
      w.add_tensor(p + "ffn_up.weight", mat(F_dense, D))
      w.add_tensor(p + "ffn_down.weight", mat(D, F_dense))
    else:
      # the router stays F32, as llama.cpp's converter writes it
      w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((E, D)) / np.sqrt(D)).astype(np.float32))
      w.add_tensor(p + "ffn_gate_exps.weight", mat(F, D, E))
      w.add_tensor(p + "ffn_up_exps.weight", mat(F, D, E))
      w.add_tensor(p + "ffn_down_exps.weight", mat(D, F, E))
      if glm:
        w.add_tensor(p + "exp_probs_b.bias", bias(E, 0.05))
        w.add_tensor(p + "ffn_gate_shexp.weight", mat(F, D))
        w.add_tensor(p + "ffn_up_shexp.weight", mat(F, D))
        w.add_tensor(p + "ffn_down_shexp.weight", mat(D, F))
    if il >= L:
      w.add_tensor(p + "nextn.eh_proj.weight", mat(D, 2 * D))
      w.add_tensor(p + "nextn.enorm.weight", norm_w(D))
      w.add_tensor(p + "nextn.hnorm.weight", norm_w(D))
      w.add_tensor(p + "nextn.shared_head_norm.weight", norm_w(D))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _write_tiny_gguf(path: str, arch: str, dtype: str = "f16", seed: int = 0) -> str:
  try:
    from model.writer import write_tiny_gguf  # the project's writer, once it exists
  except ImportError:
    write_tiny_gguf = None
  if write_tiny_gguf is not None:
    out = write_tiny_gguf(path, arch, dtype=dtype, seed=seed)
    return str(out) if out is not None else path
  return _standin_write_tiny_gguf(path, arch, dtype=dtype, seed=seed)


# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
  d = tmp_path_factory.mktemp("ref_forward")
  cache = {}

  def get(arch: str, dtype: str) -> str:
    key = (arch, dtype)
    if key not in cache:
      cache[key] = _write_tiny_gguf(str(d / f"tiny-{arch}-{dtype}.gguf"), arch, dtype=dtype, seed=0)
    return cache[key]
  return get


def _tokens(vocab_size: int, n: int = N_TOKENS, seed: int = 1) -> list[int]:
  rng = np.random.default_rng(seed)
  return [int(t) for t in rng.integers(0, min(vocab_size, 509), size=n)]


def _llama_logits(path: str, tokens: list[int]) -> np.ndarray:
  llama_cpp = pytest.importorskip("llama_cpp")
  llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=64, n_batch=64, n_threads=2,
                        n_threads_batch=2, verbose=False)
  try:
    llm.eval(tokens)
    return np.array(llm.scores[:len(tokens)], dtype=np.float64)
  finally:
    llm.close()


@pytest.mark.parametrize("arch,dtype,tol", [
    ("qwen3moe", "f16", TOL_F16), ("glm4moe", "f16", TOL_F16),
    ("qwen3moe", "f32", TOL_F32), ("glm4moe", "f32", TOL_F32),
])
def test_logits_match_llama_cpp(tiny_files, arch, dtype, tol):
  path = tiny_files(arch, dtype)
  ref = RefModel(path)
  assert ref.arch == arch
  toks = _tokens(ref.vocab_size)
  logits, hidden = ref.forward(toks)
  assert logits.shape == (len(toks), ref.vocab_size) and hidden.shape == (len(toks), ref.d_model)
  want = _llama_logits(path, toks)
  rel = float(np.linalg.norm(logits - want) / np.linalg.norm(want))
  top2 = np.sort(want, axis=-1)[:, -2:]
  print(f"\n{arch} {dtype}: rel L2 {rel:.3e} over {len(toks)} positions "
        f"(max abs {np.max(np.abs(logits - want)):.3e}, smallest top-2 gap {np.min(top2[:, 1] - top2[:, 0]):.3e})")
  assert rel < tol, f"{arch} {dtype}: rel L2 {rel:.3e} >= {tol}"
  np.testing.assert_array_equal(np.argmax(logits, -1), np.argmax(want, -1))


# ---------------------------------------------------------------- self-checks of the oracle (no llama.cpp)

def test_rope_neox_partial():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 3, 64))
  pos = np.arange(5) + 7
  y = rope_neox(x, pos, 32, 10000.0)
  np.testing.assert_array_equal(y[..., 32:], x[..., 32:])                  # pass-through tail
  np.testing.assert_allclose(np.linalg.norm(y[..., :32], axis=-1), np.linalg.norm(x[..., :32], axis=-1))
  # pair (i, i+16), angle pos * base^(-2i/32)
  i, p = 3, pos[2]
  a = p * 10000.0 ** (-2 * i / 32)
  np.testing.assert_allclose(y[2, 1, i], x[2, 1, i] * np.cos(a) - x[2, 1, i + 16] * np.sin(a))
  np.testing.assert_allclose(y[2, 1, i + 16], x[2, 1, i] * np.sin(a) + x[2, 1, i + 16] * np.cos(a))
  # relative-position property: <rope(q, m), rope(k, n)> depends on m - n only
  q, k = rng.standard_normal((1, 1, 64)), rng.standard_normal((1, 1, 64))
  d1 = np.sum(rope_neox(q, np.array([10]), 32, 1e4) * rope_neox(k, np.array([4]), 32, 1e4))
  d2 = np.sum(rope_neox(q, np.array([106]), 32, 1e4) * rope_neox(k, np.array([100]), 32, 1e4))
  np.testing.assert_allclose(d1, d2)


@pytest.mark.parametrize("arch", ["qwen3moe", "glm4moe"])
def test_forward_is_causal(tiny_files, arch):
  ref = RefModel(tiny_files(arch, "f16"))
  toks = _tokens(ref.vocab_size, 12)
  full, hfull = ref.forward(toks)
  pre, hpre = ref.forward(toks[:7])
  np.testing.assert_allclose(pre, full[:7], rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(hpre, hfull[:7], rtol=1e-12, atol=1e-12)


def test_tiny_config_read(tiny_files):
  q = RefModel(tiny_files("qwen3moe", "f16"))
  assert (q.n_layers, q.n_nextn, q.d_model, q.head_dim, q.rope_dim, q.vocab_size) == (2, 0, 256, 64, 64, 512)
  assert q.norm_w and q.weights_scale == 0.0
  g = RefModel(tiny_files("glm4moe", "f16"))
  assert (g.n_layers, g.n_nextn, g.n_dense_lead, g.n_shared, g.rope_dim, g.head_dim) == (2, 1, 1, 1, 32, 64)
  assert g.gating == 2 and g.norm_w and g.weights_scale == 2.5
  # the router and the selection bias: weights are the unbiased sigmoid probs, renormalised then scaled
  x = np.random.default_rng(0).standard_normal((3, g.d_model))
  ids, w = g.route(1, x)
  probs = 1 / (1 + np.exp(-(x @ g.t["blk.1.ffn_gate_inp.weight"].T)))
  np.testing.assert_allclose(w.sum(-1), 2.5)
  np.testing.assert_allclose(w / 2.5, np.take_along_axis(probs, ids, -1) / np.take_along_axis(probs, ids, -1).sum(-1, keepdims=True))


def test_mtp_forward(tiny_files):
  ref = RefModel(tiny_files("glm4moe", "f16"))
  toks = _tokens(ref.vocab_size, 12)
  _, hidden = ref.forward(toks)
  # entry j: hidden at j with token j+1, at absolute position j+1
  logits, h = ref.mtp_forward(hidden[:-1], toks[1:], start_pos=1)
  assert logits.shape == (11, ref.vocab_size) and h.shape == (11, ref.d_model)
  # causal over its own entries
  lp, hp = ref.mtp_forward(hidden[:5], toks[1:6], start_pos=1)
  np.testing.assert_allclose(lp, logits[:5], rtol=1e-12, atol=1e-12)
  # the first entry attends to itself only: its value does not depend on start_pos through attention
  # (RoPE cancels for a single key), but later entries do through relative positions
  l0a, _ = ref.mtp_forward(hidden[:1], toks[1:2], start_pos=1)
  l0b, _ = ref.mtp_forward(hidden[:1], toks[1:2], start_pos=50)
  np.testing.assert_allclose(l0a, l0b, rtol=1e-9, atol=1e-9)
  # hand-built entry 0 up to eh_proj: embedding first, then hidden
  p = f"blk.{ref.n_layers}.nextn."
  e = rms_norm(ref.t["token_embd.weight"][toks[1]], ref.t[p + "enorm.weight"], ref.eps)
  hh = rms_norm(hidden[0], ref.t[p + "hnorm.weight"], ref.eps)
  x = ref.t[p + "eh_proj.weight"] @ np.concatenate([e, hh])
  x = ref.block(ref.n_layers, x[None], np.array([1]))
  want = rms_norm(x, ref.t[p + "shared_head_norm.weight"], ref.eps) @ ref.t["output.weight"].T
  np.testing.assert_allclose(logits[:1], want, rtol=1e-12, atol=1e-12)
