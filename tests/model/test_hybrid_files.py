"""The hybrid family's files (qwen3next, qwen35moe; llama.cpp 0.3.36 src/models/qwen3next.cpp, qwen35moe.cpp).

(a) model.gguf_io reads the tiny files (tests.models, model.writer) into the right ModelConfig and params tree, a
    legacy qwen3next file (one ssm_in) into the same tree, and a missing or misshapen tensor or key is one line.
(b) The float64 oracle (tests/ref_hybrid.py) against llama.cpp, relative L2 of the logits over all positions:
    F16 file at llama.cpp's defaults (f16 activations in matmuls, f16 KV, flash attention): measured ~1e-3, bound
    5e-3 with argmax equal outside near-ties; F32 file, f32 KV, no flash attention (f32 end to end): measured
    ~5-7e-7, bound 1e-5 with argmax equal everywhere, the hidden state after output_norm as well; the NextN block
    against llama.cpp's own MTP graph (an MTP context, graph_mtp): measured ~2e-7.
The tiny files are made to tell the rules apart: two key heads for four value heads (grouped and tiled head
mappings differ) and, for qwen35moe, M-RoPE sections under which IMROPE is not NEOX.
"""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from model.gguf_io import GGUFError, GGUFFile, load_gguf, load_params, read_config, tensor_map, to_params
from tests.gguf_edit import rewrite
from tests.model.test_ref_forward import TOL_F16, TOL_F32, _compare, _llama_eval
from tests.models import CFGS, model_path
from tests.ref_hybrid import HybridRefModel, rope_imrope_text
from tests.ref_forward import rope_neox
from tools.llama_ref import logits as llama_logits, rel_l2

ARCHS = ("qwen3next", "qwen35moe")
N_TOKENS = 24


def _tokens(n: int = N_TOKENS, seed: int = 1) -> list[int]:
  return [int(t) for t in np.random.default_rng(seed).integers(0, 509, size=n)]


@pytest.fixture(scope="module")
def refs():
  """get(arch, kind) -> (HybridRefModel, logits, hidden) over _tokens(), made once per module."""
  cache = {}

  def get(arch: str, kind: str):
    if (arch, kind) not in cache:
      ref = HybridRefModel(model_path(arch, kind))
      cache[(arch, kind)] = (ref,) + tuple(ref.forward(_tokens()))
    return cache[(arch, kind)]
  return get


@pytest.fixture(scope="module")
def llama_f32():
  """get(arch) -> llama.cpp's (logits, h_nextn) on the F32 file over _tokens(), f32 KV, no flash attention."""
  cache = {}

  def get(arch: str):
    if arch not in cache:
      cache[arch] = _llama_eval(model_path(arch, "F32"), _tokens(), f32_kv=True)
    return cache[arch]
  return get


def _np(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float64)


# ------------------------------------------------------------------------------------------------ (a) reading

@pytest.mark.parametrize("arch", ARCHS)
def test_config_reads_back(arch):
  path = model_path(arch, "F16")
  f = GGUFFile(path)
  cfg = read_config(f)
  want = CFGS[arch]
  assert cfg.rms_eps == pytest.approx(want.rms_eps, rel=1e-6)
  assert cfg == want.replace(rms_eps=cfg.rms_eps)
  # the layout travels as full_attention_interval when it is that pattern (qwen3next's), else as an array
  assert (f"{arch}.full_attention_interval" in f.md) == (arch == "qwen3next")
  assert (f"{arch}.attention.recurrent_layers" in f.md) == (arch == "qwen35moe")
  if arch == "qwen3next":
    assert cfg.attention_layers == (3,) and cfg.ring_layer(3) == 0 and cfg.recurrent_layers == (0, 1, 2)
    assert [cfg.gdn_key_head(h) for h in range(cfg.Hv)] == [0, 0, 1, 1]
    assert cfg.rope_mode == "neox" and all(cfg.rope_text_pairs)
  else:
    assert cfg.attention_layers == (2, 4) and [cfg.ring_layer(i) for i in (2, 4)] == [0, 1]
    assert cfg.gdn_layer(3) == 2 and [cfg.gdn_key_head(h) for h in range(cfg.Hv)] == [0, 1, 0, 1]
    assert cfg.rope_mode == "imrope" and cfg.rope_sections == (4, 1, 1, 0)
    assert cfg.rope_text_pairs == (True, True, True, True, False, False, True, True)
  assert (cfg.Hk, cfg.Hv, cfg.Dk, cfg.Dv, cfg.Cc, cfg.Kc) == (2, 4, 64, 64, 512, 4)
  assert not cfg.is_recurrent(cfg.n_layers)                          # the NextN block is an attention block
  with pytest.raises(ValueError, match="holds no K/V"):
    cfg.ring_layer(0)
  hash(cfg)


@pytest.mark.parametrize("arch", ARCHS)
def test_params_tree(arch):
  """Names and shapes of the hybrid blocks, and the row splits: attn_q into wq / wgate (per head [query | gate]),
  qwen3next's ssm_ba into wbeta / walpha (per key head Hv/Hk betas, then Hv/Hk alphas)."""
  path = model_path(arch, "F32")
  f = GGUFFile(path)
  cfg = read_config(f)
  p = load_params(f, cfg)
  D, H, Dh, Hkv, Hv, Dv, Cc = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.n_kv_heads, cfg.Hv, cfg.Dv, cfg.Cc
  shapes = lambda node: {k: tuple(v.shape) for k, v in node.items()}  # noqa: E731
  gdn = {"wqkv": (Cc, D), "wz": (Hv * Dv, D), "wbeta": (Hv, D), "walpha": (Hv, D), "conv": (Cc, cfg.Kc),
         "dt_bias": (Hv,), "a": (Hv,), "norm": (Dv,), "wo": (D, Hv * Dv)}
  attn = {"wq": (H * Dh, D), "wgate": (H * Dh, D), "wk": (Hkv * Dh, D), "wv": (Hkv * Dh, D), "wo": (D, H * Dh),
          "q_norm": (Dh,), "k_norm": (Dh,)}
  ffn = {"router": (8, D), "gate_exps": (8, 256, D), "up_exps": (8, 256, D), "down_exps": (8, D, 256),
         "gate_shexp": (256, D), "up_shexp": (256, D), "down_shexp": (D, 256), "shexp_gate": (D,)}
  for i in range(cfg.n_layers):
    b = p[f"blk_{i}"]
    assert set(b) == {"attn_norm", "ffn_norm", "ffn", "gdn" if cfg.is_recurrent(i) else "attn"}
    assert shapes(b["gdn" if cfg.is_recurrent(i) else "attn"]) == (gdn if cfg.is_recurrent(i) else attn)
    assert shapes(b["ffn"]) == ffn
  assert shapes(p["mtp_0"]["blk"]["attn"]) == attn
  assert set(p["mtp_0"]) == {"enorm", "hnorm", "eh_proj", "shared_head_norm", "blk"}
  t = {x.name: x for x in gguf.GGUFReader(path).tensors}
  a = np.asarray(t[f"blk.{cfg.attention_layers[0]}.attn_q.weight"].data).reshape(H, 2, Dh, D)
  np.testing.assert_array_equal(_np(p[f"blk_{cfg.attention_layers[0]}"]["attn"]["wq"]), a[:, 0].reshape(H * Dh, D))
  np.testing.assert_array_equal(_np(p[f"blk_{cfg.attention_layers[0]}"]["attn"]["wgate"]), a[:, 1].reshape(H * Dh, D))
  if arch == "qwen3next":
    ba = np.asarray(t["blk.0.ssm_ba.weight"].data).reshape(cfg.Hk, 2, Hv // cfg.Hk, D)
    np.testing.assert_array_equal(_np(p["blk_0"]["gdn"]["wbeta"]), ba[:, 0].reshape(Hv, D))
    np.testing.assert_array_equal(_np(p["blk_0"]["gdn"]["walpha"]), ba[:, 1].reshape(Hv, D))
  np.testing.assert_array_equal(_np(p["blk_0"]["gdn"]["a"]), np.asarray(t["blk.0.ssm_a"].data))
  assert (_np(p["blk_0"]["gdn"]["a"]) < 0).all()                     # -exp(A_log)
  assert p["blk_0"]["gdn"]["conv"].dtype == np.float32


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_file_loads(arch):
  """llama.cpp's quantizer on the tiny F32 file (tests.models): K-quant rows split like float rows."""
  from ops.qtensor import QTensor
  path = model_path(arch, "Q4_K_M")
  cfg, params, _, f = load_gguf(path)
  i = cfg.attention_layers[0]
  attn = params[f"blk_{i}"]["attn"]
  assert isinstance(attn["wq"], QTensor) and isinstance(attn["wgate"], QTensor)
  from gguf.quants import dequantize
  t = f.tensors[f"blk.{i}.attn_q.weight"]
  full = dequantize(t.data, t.tensor_type).reshape(cfg.n_heads, 2, cfg.head_dim, cfg.d_model)
  np.testing.assert_array_equal(_np(attn["wgate"].dense()), full[:, 1].reshape(-1, cfg.d_model))
  assert f.tensors["blk.0.ssm_conv1d.weight"].tensor_type.name == "F32"
  assert np.isfinite(llama_logits(path, _tokens(8))).all()


def _copy(src: str, dst: str, tensors) -> str:
  """A copy of src's metadata with the tensors `tensors(list of (name, array))` returns (F32 / F16 files)."""
  r = gguf.GGUFReader(src)
  w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
  for key, fld in r.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
      continue
    sub = fld.types[-1] if fld.types[0] == gguf.GGUFValueType.ARRAY else None
    w.add_key_value(key, fld.contents(), fld.types[0], sub)
  for name, value in tensors([(x.name, np.array(x.data)) for x in r.tensors]):
    w.add_tensor(name, value)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return dst


def _legacy_qwen3next(src: str, dst: str) -> str:
  """A copy of a qwen3next file with each DeltaNet layer's attn_qkv + attn_gate replaced by the one legacy ssm_in
  (rows per key head: q | k | v | z), built here from the shapes alone."""
  cfg = read_config(GGUFFile(src))
  Hk, Dk, gv = cfg.Hk, cfg.Dk, cfg.Hv // cfg.Hk * cfg.Dv

  def legacy(tensors):
    t = dict(tensors)
    for name, value in tensors:
      if name.endswith("attn_gate.weight"):
        continue
      if name.endswith("attn_qkv.weight"):
        q, k, v = np.split(value, [Hk * Dk, 2 * Hk * Dk])
        z = t[name.replace("attn_qkv", "attn_gate")]
        rows = [q.reshape(Hk, Dk, -1), k.reshape(Hk, Dk, -1), v.reshape(Hk, gv, -1), z.reshape(Hk, gv, -1)]
        yield name.replace("attn_qkv", "ssm_in"), np.concatenate(rows, axis=1).reshape(-1, value.shape[1])
      else:
        yield name, value
  return _copy(src, dst, legacy)


def test_legacy_ssm_in_file(tmp_path, refs):
  """A legacy qwen3next file (ssm_in): llama.cpp runs it as the file it came from, the loader gives the same
  gdn/wqkv and gdn/wz, and so does the oracle."""
  src = model_path("qwen3next", "F32")
  legacy = _legacy_qwen3next(src, str(tmp_path / "legacy.gguf"))
  assert "blk.0.ssm_in.weight" in GGUFFile(legacy).tensors and "blk.0.attn_qkv.weight" not in GGUFFile(legacy).tensors
  toks = _tokens(12)
  want, _ = _llama_eval(src, toks, f32_kv=True)
  got, _ = _llama_eval(legacy, toks, f32_kv=True)
  assert rel_l2(got, want) < 1e-6
  f = GGUFFile(legacy)
  cfg = read_config(f)
  tmap = tensor_map(cfg, f)
  t = {x.name: x for x in gguf.GGUFReader(src).tensors}
  for i in (0, 1, 2):
    path = (f"blk_{i}", "gdn", "w_in")                  # what load_params does with it: to_params' row split
    name, shape = tmap[path]
    got = dict(to_params(cfg, path, *f.tensor(name, shape), shape))
    assert sorted(got) == [path[:2] + ("wqkv",), path[:2] + ("wz",)]
    for n, tn in (("wqkv", "attn_qkv"), ("wz", "attn_gate")):
      np.testing.assert_array_equal(_np(got[path[:2] + (n,)]), np.asarray(t[f"blk.{i}.{tn}.weight"].data))
  ref, logits, _ = refs("qwen3next", "F32")
  np.testing.assert_allclose(HybridRefModel(legacy).forward(_tokens())[0], logits, rtol=1e-12, atol=1e-12)


def _bad_files(tmp):
  q3, q35 = model_path("qwen3next", "F16"), model_path("qwen35moe", "F16")
  out = lambda n: os.path.join(tmp, n)  # noqa: E731
  U32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING
  return {
      "missing_ssm_a": (rewrite(q3, out("a.gguf"), drop_tensors=("blk.0.ssm_a",)),
                        "missing tensor 'blk.0.ssm_a' (expected shape [4])"),
      "missing_qkv": (rewrite(q3, out("qkv.gguf"), drop_tensors=("blk.1.attn_qkv.weight",)),
                      "missing tensor 'blk.1.attn_qkv.weight' (expected shape [512, 256])"),
      "conv_shape": (rewrite(q3, out("conv.gguf"), reshape={"blk.1.ssm_conv1d.weight": (256, 8)}),
                     "tensor 'blk.1.ssm_conv1d.weight' has shape [256, 8], expected [512, 4]"),
      "ba_shape": (rewrite(q3, out("ba.gguf"), reshape={"blk.2.ssm_ba.weight": (4, 512)}),
                   "tensor 'blk.2.ssm_ba.weight' has shape [4, 512], expected [8, 256]"),
      "gated_q_shape": (rewrite(q3, out("q.gguf"), reshape={"blk.3.attn_q.weight": (256, 512)}),
                        "tensor 'blk.3.attn_q.weight' has shape [256, 512], expected [512, 256]"),
      "mtp_block": (rewrite(q3, out("mtp.gguf"), drop_tensors=("blk.4.attn_k.weight",)),
                    "missing tensor 'blk.4.attn_k.weight' (expected shape [128, 256])"),
      "attn_bias": (_copy(q35, out("bias.gguf"), lambda ts: ts + [("blk.2.attn_k.bias", np.zeros(128, np.float32))]),
                    "tensor 'blk.2.attn_k.bias' in attention block 2 is not supported"),
      "missing_beta": (rewrite(q35, out("beta.gguf"), drop_tensors=("blk.3.ssm_beta.weight",)),
                       "missing tensor 'blk.3.ssm_beta.weight' (expected shape [4, 256])"),
      "missing_state_size": (rewrite(q3, out("ss.gguf"), drop_keys=("qwen3next.ssm.state_size",)),
                             "missing required key 'qwen3next.ssm.state_size'"),
      "bad_group_count": (rewrite(q3, out("gc.gguf"), set_keys={"qwen3next.ssm.group_count": ("two", STR)}),
                          "key 'qwen3next.ssm.group_count' is 'two', expected int"),
      "heads_not_divisible": (rewrite(q3, out("hv.gguf"), set_keys={"qwen3next.ssm.group_count": (3, U32)}),
                              "key 'qwen3next.ssm.time_step_rank' is 4, expected a multiple of ssm.group_count 3"),
      "missing_sections": (rewrite(q35, out("sec.gguf"), drop_keys=("qwen35moe.rope.dimension_sections",)),
                           "missing required key 'qwen35moe.rope.dimension_sections'"),
      "recurrent_length": (rewrite(q35, out("rl.gguf"), drop_keys=("qwen35moe.attention.recurrent_layers",),
                                   set_keys={"qwen35moe.attention.recurrent_layers": (
                                       [True, False, True], gguf.GGUFValueType.ARRAY)}),
                           "key 'qwen35moe.attention.recurrent_layers' is [True, False, True], expected an array "
                           "of 6 bools (block_count)"),
  }


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
  return _bad_files(str(tmp_path_factory.mktemp("bad_hybrid")))


BAD_CASES = ["missing_ssm_a", "missing_qkv", "conv_shape", "ba_shape", "gated_q_shape", "mtp_block", "attn_bias",
             "missing_beta", "missing_state_size", "bad_group_count", "heads_not_divisible", "missing_sections",
             "recurrent_length"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_file_is_one_clear_line(bad_files, case):
  path, expected = bad_files[case]
  with pytest.raises(GGUFError) as e:
    load_gguf(path)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(path)
  assert expected in msg, msg


# ------------------------------------------------------------------------------------------------ (b) the oracle

@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_matches_llama_cpp_f16(refs, arch):
  """F16 file, llama.cpp at its defaults through tools.llama_ref.logits."""
  ref, logits, hidden = refs(arch, "F16")
  assert logits.shape == (N_TOKENS, ref.vocab_size) and hidden.shape == (N_TOKENS, ref.d_model)
  _compare(f"{arch} F16 file, llama.cpp defaults", logits, llama_logits(model_path(arch, "F16"), _tokens()), TOL_F16,
           strict_argmax=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_matches_llama_cpp_f32(refs, llama_f32, arch):
  """F32 file, f32 KV cache, no flash attention: llama.cpp is f32 end to end."""
  ref, logits, hidden = refs(arch, "F32")
  want, want_h = llama_f32(arch)
  _compare(f"{arch} F32 file, f32 KV", logits, want, TOL_F32, strict_argmax=True)
  assert want_h is not None                          # both graphs fill h_nextn: the hidden after output_norm
  rel_h = rel_l2(hidden, want_h)
  print(f"{arch} hidden after output_norm: rel L2 {rel_h:.3e}")
  assert rel_h < TOL_F32


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_matches_llama_cpp(refs, arch):
  """The NextN block against llama.cpp's MTP context (graph_mtp of qwen3next.cpp / qwen35moe.cpp: a gated attention
  block over its own plain KV cache, then the shared head). Entries as llama.cpp's drafter lays them out: token t_j
  with the target hidden state of position j - 1, a zero state for position 0 (tests/model/test_ref_forward.py)."""
  ref, _, hidden = refs(arch, "F32")
  toks = _tokens()
  h_in = np.concatenate([np.zeros((1, ref.d_model)), hidden[:-1]]).astype(np.float32).astype(np.float64)
  want, want_h = _llama_eval(model_path(arch, "F32"), toks, f32_kv=True, hidden=h_in)
  logits, h_out = ref.mtp_forward(h_in, toks, start_pos=0)
  _compare(f"{arch} NextN, llama.cpp MTP context", logits, want, TOL_F32, strict_argmax=True)
  assert want_h is not None and rel_l2(h_out, want_h) < TOL_F32


def test_the_tiny_files_tell_the_rules_apart(refs, llama_f32):
  """Against llama.cpp's F32 logits (first 12 positions): the other arch's value -> key head mapping, or NEOX for
  qwen35moe's IMROPE, misses by far more than the F32 bound (so the files check both rules)."""
  n = 12
  for arch in ARCHS:
    ref = refs(arch, "F32")[0]
    want = llama_f32(arch)[0][:n]
    wrong = HybridRefModel.__new__(HybridRefModel)
    wrong.__dict__.update(ref.__dict__)
    r = ref.n_v_heads // ref.n_k_heads
    wrong.key_head = (lambda h: h % ref.n_k_heads) if arch == "qwen3next" else (lambda h: h // r)
    assert rel_l2(wrong.forward(_tokens()[:n])[0], want) > 1e-2
    if arch == "qwen35moe":
      neox = HybridRefModel.__new__(HybridRefModel)
      neox.__dict__.update(ref.__dict__)
      neox.rope_sections = None
      assert rel_l2(neox.forward(_tokens()[:n])[0], want) > 100 * TOL_F32


def test_imrope_text_rule():
  """IMROPE on text positions: NEOX where a pair's sector takes p, unrotated where it takes the fourth component."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 2, 32))
  pos = np.arange(5) + 3
  y = rope_imrope_text(x, pos, 16, 1e4, [4, 1, 1, 0])
  n = rope_neox(x, pos, 16, 1e4)
  rot = np.array([True, True, True, True, False, False, True, True])
  np.testing.assert_allclose(y[..., :8][..., rot], n[..., :8][..., rot])
  np.testing.assert_allclose(y[..., 8:16][..., rot], n[..., 8:16][..., rot])
  np.testing.assert_array_equal(y[..., :8][..., ~rot], x[..., :8][..., ~rot])
  np.testing.assert_array_equal(y[..., 16:], x[..., 16:])
  np.testing.assert_allclose(rope_imrope_text(x, pos, 16, 1e4, [11, 11, 10, 0]), n)   # Qwen3.5's sections: NEOX


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_is_causal_and_returns_states(refs, arch):
  ref, logits, hidden = refs(arch, "F16")
  pre, hpre, states = ref.forward(_tokens()[:9], return_states=True)
  np.testing.assert_allclose(pre, logits[:9], rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(hpre, hidden[:9], rtol=1e-12, atol=1e-12)
  rec = [i for i in range(ref.n_layers) if ref.recurrent[i]]
  assert sorted(states) == rec
  conv, S = states[rec[0]]
  Cc = 2 * ref.n_k_heads * ref.d_state + ref.d_inner
  assert conv.shape == (Cc, ref.d_conv - 1) and S.shape == (ref.n_v_heads, ref.d_state, ref.head_v_dim)
  assert np.abs(S).max() > 0
