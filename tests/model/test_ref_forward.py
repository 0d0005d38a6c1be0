"""Validates the float64 numpy oracle (tests/ref_forward.py) against llama.cpp (llama-cpp-python) on tiny GGUFs.

Relative L2 of the logits over all positions, ||ref - llama|| / ||llama||:
- F16 file, llama.cpp defaults: its CPU matmuls round the activations to f16, its KV cache is f16 and flash
  attention (auto = on) takes Q in f16, so ~5e-4 is expected (measured 5.1e-4 .. 6.2e-4; ~3e-4 with flash
  attention off); bound 5e-3, argmax equal wherever llama.cpp's top-2 gap is not a near-tie.
- F32 file, f32 KV cache, flash attention off: llama.cpp is f32 end to end (measured ~2-3e-7); bound 1e-5,
  argmax equal everywhere. This is the check that pins the oracle's semantics.
- The glm4moe NextN block against llama.cpp's MTP context, same f32 settings.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.models import model_path  # noqa: E402
from tests.ref_forward import RefModel, rms_norm, rope_neox  # noqa: E402

import gguf  # noqa: E402

N_TOKENS = 24
TOL_F16 = 5e-3     # F16 file, llama.cpp defaults (f16 activations in matmuls, f16 KV cache, flash attention)
TOL_F32 = 1e-5     # F32 file, f32 KV cache, no flash attention: f32 end to end (measured ~2-3e-7)


# ----------------------------------------------------------------------------------------------------------
# A second tiny GGUF writer, independent of model/writer.py: the oracle is also validated on files the project's
# writer did not make (`standin=True`), so a writer bug cannot hide an oracle bug.
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
  """Tiny qwen3moe, qwen2moe or glm4moe (+1 NextN block) GGUF: hidden 256, 2 trunk layers, 4 q / 2 kv heads
  of 64, 8 experts top-2 of width 256, vocab 512. qwen3moe: q/k norm. qwen2moe: q/k/v bias, a gated shared
  expert of width 384. glm4moe: block 0 dense, shared expert, sigmoid routing with a selection bias, partial
  rotary (32 of 64), q/k/v bias, weight norm + scale 2.5."""
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

  glm, q2 = arch == "glm4moe", arch == "qwen2moe"
  F_sh = 384                         # qwen2moe shared-expert width
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
  if q2:
    w.add_expert_shared_feed_forward_length(F_sh)
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
    if glm or q2:
      w.add_tensor(p + "attn_q.bias", bias(H * Dh))
      w.add_tensor(p + "attn_k.bias", bias(Hkv * Dh))
      w.add_tensor(p + "attn_v.bias", bias(Hkv * Dh))
    if glm:
      w.add_tensor(p + "post_attention_norm.weight", norm_w(D))
    elif q2:
      w.add_tensor(p + "ffn_norm.weight", norm_w(D))
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
      if q2:
        w.add_tensor(p + "ffn_gate_inp_shexp.weight", (rng.standard_normal(D) / np.sqrt(D)).astype(np.float32))
        w.add_tensor(p + "ffn_gate_shexp.weight", mat(F_sh, D))
        w.add_tensor(p + "ffn_up_shexp.weight", mat(F_sh, D))
        w.add_tensor(p + "ffn_down_shexp.weight", mat(D, F_sh))
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


# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
  """get(arch, dtype, standin=False) -> path of a tiny GGUF: the project's writer's file (tests.models.model_path),
  or with standin the independent writer's."""
  d = tmp_path_factory.mktemp("ref_forward")
  cache = {}

  def get(arch: str, dtype: str, standin: bool = False) -> str:
    key = (arch, dtype, standin)
    if key not in cache:
      if standin:
        cache[key] = _standin_write_tiny_gguf(str(d / f"tiny-{arch}-{dtype}-standin.gguf"), arch, dtype=dtype, seed=0)
      else:
        cache[key] = model_path(arch, dtype.upper())
    return cache[key]
  return get


def _tokens(vocab_size: int, n: int = N_TOKENS, seed: int = 1) -> list[int]:
  rng = np.random.default_rng(seed)
  return [int(t) for t in rng.integers(0, min(vocab_size, 509), size=n)]


def _llama_logits(path: str, tokens: list[int], f32_kv: bool = False) -> np.ndarray:
  return _llama_eval(path, tokens, f32_kv=f32_kv)[0]


def _compare(name: str, got: np.ndarray, want: np.ndarray, tol: float, strict_argmax: bool) -> None:
  """Relative L2 over all positions < tol, and at every single position < 4 tol (an error at one position cannot
  hide in the mean). Argmax equal everywhere (strict), or, with f16 rounding in llama.cpp, everywhere llama.cpp's
  top-2 gap exceeds 4x that position's RMS logit error: a flip there means the error fell on the top two logits
  far above its typical size. (A bound by the position's *largest* error would make the check hold by arithmetic;
  a fraction of near-ties depends on the machine's f16 rounding, so neither is asserted.)"""
  err = got - want
  rel = float(np.linalg.norm(err) / np.linalg.norm(want))
  rel_pos = np.linalg.norm(err, axis=-1) / np.linalg.norm(want, axis=-1)
  rms_pos = np.sqrt(np.mean(err * err, axis=-1))
  top2 = np.sort(want, axis=-1)[:, -2:]
  gap = top2[:, 1] - top2[:, 0]
  print(f"\n{name}: rel L2 {rel:.3e} over {len(want)} positions, worst position {rel_pos.max():.3e} "
        f"(max abs {np.abs(err).max():.3e}, smallest llama.cpp top-2 gap {gap.min():.3e})")
  assert rel < tol, f"{name}: rel L2 {rel:.3e} >= {tol}"
  assert rel_pos.max() < 4 * tol, f"{name}: position {int(rel_pos.argmax())} rel L2 {rel_pos.max():.3e} >= {4 * tol}"
  check = np.ones(len(want), bool) if strict_argmax else gap > 4 * rms_pos
  if not check.all():
    print(f"  {int((~check).sum())} near-tie position(s) left out of the argmax check")
  np.testing.assert_array_equal(np.argmax(got, -1)[check], np.argmax(want, -1)[check])


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "glm4moe"])
def test_logits_match_llama_cpp_f16(tiny_files, arch):
  """F16 file, llama.cpp at its defaults: matmuls round activations to f16, f16 KV cache, flash attention."""
  path = tiny_files(arch, "f16")
  ref = RefModel(path)
  assert ref.arch == arch
  toks = _tokens(ref.vocab_size)
  logits, hidden = ref.forward(toks)
  assert logits.shape == (len(toks), ref.vocab_size) and hidden.shape == (len(toks), ref.d_model)
  _compare(f"{arch} F16 file, llama.cpp defaults", logits, _llama_logits(path, toks), TOL_F16, strict_argmax=False)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "glm4moe"])
def test_logits_match_llama_cpp_f32(tiny_files, arch):
  """F32 file, f32 KV cache, no flash attention: llama.cpp is f32 end to end, so the oracle must agree to ~1e-7."""
  path = tiny_files(arch, "f32")
  ref = RefModel(path)
  toks = _tokens(ref.vocab_size)
  logits, hidden = ref.forward(toks)
  want, want_h = _llama_eval(path, toks, f32_kv=True)
  _compare(f"{arch} F32 file, f32 KV", logits, want, TOL_F32, strict_argmax=True)
  if want_h is not None and arch == "glm4moe":        # only the glm4moe graph fills h_nextn (zeros otherwise)
    rel_h = float(np.linalg.norm(hidden - want_h) / np.linalg.norm(want_h))
    print(f"{arch} hidden after output_norm: rel L2 {rel_h:.3e}")
    assert rel_h < TOL_F32


_QUIET_LOG = None


def _llama_eval(path: str, tokens: list[int], *, f32_kv: bool = False,
                hidden: np.ndarray | None = None, pos0: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
  """llama.cpp over `tokens` at positions pos0..pos0+T-1 in one batch, every position an output, through the
  low-level API of llama-cpp-python: (logits [T, V], h_nextn [T, D] or None).

  hidden=None: the trunk (a default context); h_nextn is the hidden state after output_norm (glm4moe only).
  hidden [T, D]: the NextN block, through an MTP context (LLAMA_CONTEXT_TYPE_MTP) on a model loaded with
  load_mtp; entry j is (hidden[j], tokens[j]); h_nextn is the block's output after shared_head_norm.
  f32_kv: f32 KV cache and no flash attention (default: llama.cpp's f16 KV, flash attention auto).
  Extra buffer types (CPU repacking, AMX) are off: ggml's AMX matmul segfaults on tiny Q8_0 files here."""
  llama_cpp = pytest.importorskip("llama_cpp")
  import ctypes

  C = llama_cpp.llama_cpp
  C.llama_backend_init()
  global _QUIET_LOG
  if _QUIET_LOG is None:                              # llama.cpp logs every load to stderr otherwise
    _QUIET_LOG = C.llama_log_callback(lambda level, text, user: None)
    C.llama_log_set(_QUIET_LOG, None)
  mtp = hidden is not None
  mp = C.llama_model_default_params()
  mp.use_extra_bufts = False
  mp.load_mtp = mtp                                   # default false: the NextN tensors are skipped
  model = C.llama_model_load_from_file(path.encode(), mp)
  assert model, f"llama.cpp failed to load {path}"
  ctx = batch = None
  try:
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    n_embd = C.llama_model_n_embd(model)
    cp = C.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 64
    cp.n_threads = cp.n_threads_batch = 2
    if mtp:
      cp.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP
    if f32_kv:
      cp.type_k = cp.type_v = 0                       # GGML_TYPE_F32
      cp.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = C.llama_init_from_model(model, cp)
    assert ctx, "llama.cpp refused the context"
    # llama_set_embeddings_nextn / llama_get_embeddings_nextn are LLAMA_API in src/llama-ext.h, which lacks
    # extern "C": exported under C++-mangled names and not bound by llama-cpp-python.
    try:
      set_nextn = C._lib["_Z26llama_set_embeddings_nextnP13llama_contextbb"]
      get_nextn = C._lib["_Z26llama_get_embeddings_nextnP13llama_context"]
      set_nextn.argtypes, set_nextn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
      get_nextn.argtypes, get_nextn.restype = [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)
      set_nextn(ctx, True, False)
    except (AttributeError, KeyError):
      get_nextn = None
    h32 = np.ascontiguousarray(hidden, dtype=np.float32) if mtp else None
    batch = C.llama_batch_ext_init(ctx)
    keep = []
    for j, t in enumerate(tokens):
      idx = C.llama_batch_ext_add_token(batch, 0, int(t))
      pos = (ctypes.c_int32 * 4)(pos0 + j, 0, 0, 0)
      keep.append(pos)
      assert C.llama_batch_ext_set_pos(batch, idx, pos)
      if mtp:
        # the hidden state goes in as the entry's "token embedding" (set_embd_state is a stub returning false)
        row = C.llama_embd(h32[j].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, h32.shape[1])
        assert C.llama_batch_ext_set_embd_token(batch, idx, row)
      assert C.llama_batch_ext_set_output_logits(batch, idx, True)
    assert C.llama_process(ctx, C.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
    logits = np.stack([np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, j), shape=(n_vocab,))
                       for j in range(len(tokens))]).astype(np.float64)
    h = None
    if get_nextn is not None:
      ptr = get_nextn(ctx)
      if ptr:
        h = np.ctypeslib.as_array(ptr, shape=(len(tokens), n_embd)).astype(np.float64)
    return logits, h
  finally:
    if batch:
      C.llama_batch_ext_free(batch)
    if ctx:
      C.llama_free(ctx)
    C.llama_model_free(model)


def test_mtp_matches_llama_cpp(tiny_files):
  """The NextN block against llama.cpp's MTP context (glm4moe graph_mtp), F32 file, f32 KV.

  llama.cpp's drafter (common/speculative.cpp, draft-mtp `process`) pairs the token at position p with the
  target hidden state of position p-1, and the sequence's first token (position 0) with a ZERO hidden state
  (pending_h starts zeroed). Its drafter KV thus holds one more entry than this stack's design (first entry
  (h_0, t_1) at position 1). The oracle reproduces llama.cpp's layout with
  mtp_forward([0, h_0 .. h_{T-2}], [t_0 .. t_{T-1}], start_pos=0)."""
  path = tiny_files("glm4moe", "f32")
  ref = RefModel(path)
  assert ref.n_nextn >= 1
  toks = _tokens(ref.vocab_size, 12)
  _, hidden = ref.forward(toks)
  h_in = np.concatenate([np.zeros((1, ref.d_model)), hidden[:-1]]).astype(np.float32).astype(np.float64)
  want_logits, want_h = _llama_eval(path, toks, f32_kv=True, hidden=h_in)
  logits, h_out = ref.mtp_forward(h_in, toks, start_pos=0)
  _compare("glm4moe NextN, llama.cpp MTP context", logits, want_logits, TOL_F32, strict_argmax=True)
  if want_h is not None:
    rel_h = float(np.linalg.norm(h_out - want_h) / np.linalg.norm(want_h))
    print(f"glm4moe NextN h_out (after shared_head_norm): rel L2 {rel_h:.3e}")
    assert rel_h < TOL_F32
  # this stack's layout (no zero entry at position 0) gives visibly different drafts from position 1 on
  design, _ = ref.mtp_forward(h_in[1:], toks[1:], start_pos=1)
  print(f"design layout vs llama.cpp layout, positions 1..: rel L2 "
        f"{np.linalg.norm(design - logits[1:]) / np.linalg.norm(logits[1:]):.3e}")


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
  q = RefModel(tiny_files("qwen3moe", "f16", standin=True))
  assert (q.n_layers, q.n_nextn, q.d_model, q.head_dim, q.rope_dim, q.vocab_size) == (2, 0, 256, 64, 64, 512)
  assert q.norm_w and q.weights_scale == 0.0
  g = RefModel(tiny_files("glm4moe", "f16", standin=True))
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
  want = rms_norm(x, ref.t[p + "shared_head_norm.weight"], ref.eps) @ ref.output_weight.T
  np.testing.assert_allclose(logits[:1], want, rtol=1e-12, atol=1e-12)
