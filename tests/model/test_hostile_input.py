"""Hostile files never load into a silent wrong answer (issue 28): copies of the default model and of the tiny hybrid
file edited in place through gguf-py's GGUFReader(path, "r+") (tests.gguf_edit) are refused at load with one line
naming the file, the key or tensor and what was expected, as llama.cpp 0.3.36 checks them (aligned, non-overlapping
tensors; hyperparameters finite and in range, block_count bounded before any per-layer work; no NaN / Inf in the
norms, routers and biases). The orbax cache is verified: a damaged, cut-short or stale entry is reported in one
warning line and the GGUF is loaded again, giving the params of a load without a cache."""
from __future__ import annotations

import builtins
import glob
import json
import logging
import os
import time

import gguf
import jax
import numpy as np
import pytest

from configs.default import default_model_path
from model.gguf_io import GGUFError, load_gguf
from model.loader import load_model
from tests.gguf_edit import edit_copy, move_tensor, rewrite, set_tensor_type, set_tensor_values, set_value
from tests.models import model_path

NAN, INF = float("nan"), float("inf")
G = "glm4moe."                        # the default model's arch
Q3 = "qwen3next."


def _cases():
  """name -> (source, edits, what the one line says after the file's path)."""
  d = default_model_path()
  q3 = model_path("qwen3next", "F16")
  return {
      "nan_output_norm": (d, [set_tensor_values("output_norm.weight", NAN)],
                          "tensor 'output_norm.weight' has a non-finite value (nan at flat index 0 of 256), expected "
                          "finite weights"),
      "inf_router": (d, [set_tensor_values("blk.1.ffn_gate_inp.weight", INF, 5)],
                     "tensor 'blk.1.ffn_gate_inp.weight' has a non-finite value (inf at flat index 5 of 4096)"),
      "nan_router_bias": (d, [set_tensor_values("blk.2.exp_probs_b.bias", NAN, 3)],
                          "tensor 'blk.2.exp_probs_b.bias' has a non-finite value (nan at flat index 3 of 16)"),
      "inf_attn_bias": (d, [set_tensor_values("blk.3.attn_q.bias", -INF, 7)],
                        "tensor 'blk.3.attn_q.bias' has a non-finite value (-inf at flat index 7 of 256)"),
      "nan_eps": (d, [set_value(G + "attention.layer_norm_rms_epsilon", NAN)],
                  f"key '{G}attention.layer_norm_rms_epsilon' is nan, expected a finite number > 0"),
      "rope_base_0": (d, [set_value(G + "rope.freq_base", 0.0)],
                      f"key '{G}rope.freq_base' is 0.0, expected a finite number > 0"),
      "rope_base_inf": (d, [set_value(G + "rope.freq_base", INF)],
                        f"key '{G}rope.freq_base' is inf, expected a finite number > 0"),
      "scale_nan": (d, [set_value(G + "expert_weights_scale", NAN)],
                    f"key '{G}expert_weights_scale' is nan, expected a finite number > 0"),
      "overlap": (d, [set_tensor_type("token_embd.weight", "F16")],        # Q8_0 -> F16: 278,528 -> 524,288 bytes
                  "tensor 'token_embd.weight' (data bytes 0..524288) overlaps tensor 'blk.0.attn_k.bias' (from "
                  "278528), expected each tensor's bytes apart"),
      "misaligned": (d, [move_tensor("blk.0.attn_k.weight", 2)],
                     "tensor 'blk.0.attn_k.weight' has offset 279042, expected a multiple of general.alignment 32"),
      "head_count_kv_0": (d, [set_value(G + "attention.head_count_kv", 0)],
                          f"key '{G}attention.head_count_kv' is 0, expected an int in [1, 4] (attention.head_count)"),
      "head_count_kv_3": (d, [set_value(G + "attention.head_count_kv", 3)],
                          f"key '{G}attention.head_count' / '{G}attention.head_count_kv' are 4 / 3, expected "
                          f"head_count a multiple of head_count_kv"),
      "expert_used_0": (d, [set_value(G + "expert_used_count", 0)],
                        f"key '{G}expert_used_count' is 0, expected an int in [1, 16] (expert_count 16)"),
      "expert_used_17": (d, [set_value(G + "expert_used_count", 17)],
                         f"key '{G}expert_used_count' is 17, expected an int in [1, 16] (expert_count 16)"),
      "expert_count_2000": (d, [set_value(G + "expert_count", 2000)],
                            f"key '{G}expert_count' is 2000, expected an int in [1, 1024] (llama.cpp's "
                            f"LLAMA_MAX_EXPERTS)"),
      "nextn_5": (d, [set_value(G + "nextn_predict_layers", 5)],
                  f"key '{G}nextn_predict_layers' is 5, expected an int in [0, 4] (below block_count 5)"),
      "dense_lead_9": (d, [set_value(G + "leading_dense_block_count", 9)],
                       f"key '{G}leading_dense_block_count' is 9, expected an int in [0, 4] (trunk blocks 4)"),
      "rope_dim_odd": (d, [set_value(G + "rope.dimension_count", 31)],
                       f"key '{G}rope.dimension_count' is 31, expected an even number"),
      "block_count_huge": (d, [set_value(G + "block_count", 100_000)],
                           f"key '{G}block_count' is 100000, expected an int in [1, 512] (llama.cpp's "
                           f"LLAMA_MAX_LAYERS)"),
      # the hybrid family: its own keys and tensors
      "hybrid_block_count_huge": (q3, [set_value(Q3 + "block_count", 100_000)],
                                  f"key '{Q3}block_count' is 100000, expected an int in [1, 512]"),
      "hybrid_rope_base_nan": (q3, [set_value(Q3 + "rope.freq_base", NAN)],
                               f"key '{Q3}rope.freq_base' is nan, expected a finite number > 0"),
      "hybrid_eps_0": (q3, [set_value(Q3 + "attention.layer_norm_rms_epsilon", 0.0)],
                       f"key '{Q3}attention.layer_norm_rms_epsilon' is 0.0, expected a finite number > 0"),
      "hybrid_nan_ssm_a": (q3, [set_tensor_values("blk.1.ssm_a", NAN, 2)],
                           "tensor 'blk.1.ssm_a' has a non-finite value (nan at flat index 2 of 4)"),
      "hybrid_inf_conv": (q3, [set_tensor_values("blk.0.ssm_conv1d.weight", INF, 100)],
                          "tensor 'blk.0.ssm_conv1d.weight' has a non-finite value (inf at flat index 100 of 2048)"),
      "hybrid_nan_shexp_gate": (q3, [set_tensor_values("blk.3.ffn_gate_inp_shexp.weight", NAN, 9)],
                                "tensor 'blk.3.ffn_gate_inp_shexp.weight' has a non-finite value (nan at flat index 9 "
                                "of 256)"),
  }


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES)
def test_hostile_file_is_refused_in_one_line(tmp_path, case):
  src, edits, expected = _cases()[case]
  path = edit_copy(src, str(tmp_path / f"{case}.gguf"), *edits)
  t0 = time.perf_counter()
  with pytest.raises(GGUFError) as e:
    load_gguf(path)
  assert time.perf_counter() - t0 < 10                # block_count 100,000: refused before any per-layer work
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(path + ": "), msg
  assert expected in msg, msg


def test_directory_and_unreadable_file_are_one_line(tmp_path, monkeypatch):
  with pytest.raises(GGUFError, match=r": is a directory, expected a GGUF file$"):
    load_gguf(str(tmp_path))
  path = edit_copy(default_model_path(), str(tmp_path / "locked.gguf"))
  real_open = builtins.open

  def locked(file, *a, **k):                          # chmod 000 does not stop root: refuse the path here
    if str(file) == path:
      raise PermissionError(13, "Permission denied", path)
    return real_open(file, *a, **k)
  monkeypatch.setattr(builtins, "open", locked)
  with pytest.raises(GGUFError) as e:
    load_gguf(path)
  assert str(e.value) == f"{path}: cannot read the file (Permission denied)"


def test_add_bos_without_a_bos_id_is_refused_at_load(tmp_path):
  path = rewrite(default_model_path(), str(tmp_path / "bos.gguf"), drop_keys=("tokenizer.ggml.bos_token_id",),
                 set_keys={"tokenizer.ggml.add_bos_token": (True, gguf.GGUFValueType.BOOL)})
  with pytest.raises(GGUFError) as e:
    load_gguf(path)
  assert str(e.value) == (f"{path}: the tokenizer adds BOS (tokenizer.ggml.add_bos_token or its pre default) but key "
                          f"'tokenizer.ggml.bos_token_id' is missing")


# -- the orbax cache -------------------------------------------------------------------------------------------------

def _leaves(m):
  from ops.qtensor import QTensor
  out = []
  for x in jax.tree.leaves(m.params, is_leaf=lambda v: isinstance(v, QTensor)):
    out += [np.asarray(p) for p in x.planes] if isinstance(x, QTensor) else [np.asarray(x)]
  return out


def _same_params(a, b):
  la, lb = _leaves(a), _leaves(b)
  assert len(la) == len(lb) > 50
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(x, y)


@pytest.fixture
def cached(tmp_path):
  """(GGUF copy, cache folder, its entry, the params loaded without a cache); the entry is written."""
  src = edit_copy(default_model_path(), str(tmp_path / "m.gguf"))
  root = str(tmp_path / "cache")
  fresh = load_model(src)
  assert not load_model(src, root).from_cache and load_model(src, root).from_cache
  (entry,) = glob.glob(os.path.join(root, "*", ""))
  return src, root, entry, fresh


def _reload(src, root, caplog, what):
  """Load through a damaged entry: one warning line naming what was wrong, the GGUF read again, the entry rewritten."""
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    m = load_model(src, root)
  msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(msgs) == 1 and "\n" not in msgs[0], msgs
  assert what in msgs[0] and msgs[0].endswith(f"; loading {src} from the GGUF again (the entry is rewritten)"), msgs
  assert not m.from_cache
  assert load_model(src, root).from_cache                   # rewritten
  return m


def test_flipped_bits_in_a_cache_entry_are_found(cached, caplog):
  """Flips land in raw array bytes (the CRC-32 finds them) or in a compressed chunk or the data file's index (orbax
  cannot decode it): which one depends on the entry's layout, which orbax does not keep fixed between writes."""
  src, root, entry, fresh = cached
  big = max(sorted(glob.glob(os.path.join(entry, "params", "**", "d", "*"), recursive=True)), key=os.path.getsize)
  blob = bytearray(open(big, "rb").read())
  for i in np.random.default_rng(0).choice(len(blob) * 8, 100, replace=False):
    blob[i // 8] ^= 1 << (i % 8)
  open(big, "wb").write(blob)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    m = load_model(src, root)
  msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(msgs) == 1 and ("(damaged data); loading " in msgs[0] or ": orbax cannot read its arrays (" in msgs[0]), msgs
  assert not m.from_cache and load_model(src, root).from_cache
  _same_params(m, fresh)


def test_an_array_whose_crc_is_not_the_recorded_one_is_damaged_data(cached, caplog):
  """The CRC-32 path on its own: meta.json records another checksum for one array than its bytes have."""
  src, root, entry, fresh = cached
  meta = os.path.join(entry, "meta.json")
  doc = json.load(open(meta))
  name = sorted(doc["crc32"])[0]
  doc["crc32"][name] = f"{(int(doc['crc32'][name], 16) + 1) % (1 << 32):08x}"
  json.dump(doc, open(meta, "w"))
  _same_params(_reload(src, root, caplog, f"array '{name}' has CRC-32 "), fresh)


def test_cut_short_or_missing_cache_data_is_one_line(cached, caplog):
  src, root, entry, fresh = cached
  meta = os.path.join(entry, "meta.json")
  text = open(meta).read()
  open(meta, "w").write(text[: len(text) // 2])
  _reload(src, root, caplog, f"cache entry {entry[:-1]}: unreadable meta.json (JSONDecodeError: ")
  big = max(glob.glob(os.path.join(entry, "params", "**", "d", "*"), recursive=True), key=os.path.getsize)
  os.remove(big)
  _same_params(_reload(src, root, caplog, f"cache entry {entry[:-1]}: orbax cannot read its arrays ("), fresh)


def test_an_entry_of_another_file_with_the_same_size_and_mtime_is_not_read(cached, caplog):
  """The entry's name hashes path, size and mtime; the header's SHA-256 in meta.json tells a file edited in place
  (here: general.name) and given back its mtime."""
  src, root, entry, fresh = cached
  st = os.stat(src)
  r = gguf.GGUFReader(src, "r+")
  r.fields["general.name"].parts[-1][:4] = np.frombuffer(b"XXXX", np.uint8)
  r.data.flush()
  del r
  os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
  m = _reload(src, root, caplog, "recorded for another " + src + " (its header_sha256 differs)")
  assert m.cfg == fresh.cfg
  _same_params(m, fresh)


def test_cache_dir_naming_a_file_is_one_line(tmp_path):
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(NotADirectoryError) as e:
    load_model(default_model_path(), str(f))
  assert str(e.value) == f"cache_dir {f}: is a file, expected a directory"
