"""Copy a GGUF file with edits (for bad-input tests): drop or set keys, drop or reshape tensors."""
from __future__ import annotations

import gguf
import numpy as np


def rewrite(src: str, dst: str, *, arch: str | None = None, drop_keys=(), set_keys: dict | None = None,
            drop_tensors=(), reshape: dict | None = None) -> str:
  r = gguf.GGUFReader(src)
  set_keys = dict(set_keys or {})
  a = arch or r.fields["general.architecture"].contents()
  w = gguf.GGUFWriter(dst, a)
  for name, f in r.fields.items():
    if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys or name in set_keys:
      continue
    sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
    w.add_key_value(name, f.contents(), f.types[0], sub)
  for k, (v, vt) in set_keys.items():
    w.add_key_value(k, v, vt)
  for t in r.tensors:
    if t.name in drop_tensors:
      continue
    data = np.array(t.data)
    if reshape and t.name in reshape:
      data = data.reshape(reshape[t.name])
    if t.tensor_type.name in ("F32", "F16"):
      w.add_tensor(t.name, data)
    else:
      w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return dst


# -- in-place edits of a copy (gguf-py's GGUFReader(path, "r+") over the copy's bytes) -------------------------------

def edit_copy(src: str, dst: str, *edits) -> str:
  """Copy `src` to `dst` byte for byte, then apply each edit(reader) to the copy through a writable GGUFReader: the
  file keeps its layout, so an edit changes exactly the bytes it names (values, a type id, an offset)."""
  import shutil
  shutil.copyfile(src, dst)
  r = gguf.GGUFReader(dst, "r+")
  for e in edits:
    e(r)
  r.data.flush()
  del r
  return dst


def set_value(key: str, value):
  """An edit: metadata scalar `key` (or element 0 of an array key) becomes `value` in its own type."""
  def edit(r):
    f = r.fields[key]
    f.parts[f.data[0]][0] = value
  return edit


def set_tensor_type(name: str, qtype: str):
  """An edit: tensor `name`'s type id becomes `qtype` (its bytes and offset stay)."""
  def edit(r):
    t = next(t for t in r.tensors if t.name == name)
    t.field.parts[4][0] = int(gguf.GGMLQuantizationType[qtype])
  return edit


def move_tensor(name: str, delta: int):
  """An edit: tensor `name`'s offset (from the data section's start) moves by `delta` bytes."""
  def edit(r):
    t = next(t for t in r.tensors if t.name == name)
    t.field.parts[5][0] = int(t.field.parts[5][0]) + delta
  return edit


def set_tensor_values(name: str, value: float, index=0):
  """An edit: element(s) `index` of float tensor `name` (flat index or slice into its values) become `value`."""
  def edit(r):
    t = next(t for t in r.tensors if t.name == name)
    t.data.reshape(-1)[index] = value
  return edit


def set_block_scale(name: str, value: float, block: int = 0):
  """An edit: the f16 scale `d` (the block's first two bytes) of quantized block `block` of tensor `name` (a type
  whose blocks start with d: Q8_0, Q5_0, Q6_K's last two bytes are not covered) becomes `value`."""
  import numpy as np

  def edit(r):
    t = next(t for t in r.tensors if t.name == name)
    _, ts = gguf.GGML_QUANT_SIZES[t.tensor_type]
    raw = t.data.reshape(-1)
    raw[block * ts:block * ts + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
  return edit
