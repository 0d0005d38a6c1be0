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
