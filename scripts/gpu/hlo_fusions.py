"""What each kernel of a traced step computes: the trace's per-kernel time joined with the ops inside each
fusion of XLA's optimized HLO, plain Python.

  XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_loop.*" \
    python -m bench.step ... --profile TRACE
  python scripts/gpu/hlo_fusions.py DIR/*after_optimizations.txt TRACE/.../perfetto_trace.json.gz --steps 32

Prints, per kernel name (a fusion's name with dots as underscores, or a custom call's), ms per step, launches per
step and the opcodes of its fused computation (most frequent first), so the glue between the big kernels can be
read by what it does (norms, RoPE, int8 quantization, ring updates, router, merges).
"""
import argparse
import collections
import gzip
import json
import re

ap = argparse.ArgumentParser()
ap.add_argument("hlo")
ap.add_argument("trace", nargs="?")
ap.add_argument("--steps", type=int, default=1)
ap.add_argument("--top", type=int, default=60)
a = ap.parse_args()

comp_ops, calls, comp = {}, {}, None
for line in open(a.hlo):
  m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
  if m and "=" not in line.split("{")[0]:
    comp = m.group(1)
    comp_ops[comp] = collections.Counter()
    continue
  m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^=]*? ([a-z\-]+)\(", line)
  if m and comp:
    name, op = m.groups()
    comp_ops[comp][op] += 1
    c = re.search(r"calls=%?([\w.\-]+)", line)
    if op == "fusion" and c:
      calls[name.replace(".", "_").replace("-", "_")] = c.group(1)


def describe(kernel):
  c = comp_ops.get(calls.get(kernel, ""), collections.Counter())
  drop = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}
  return " ".join(f"{op}x{n}" if n > 1 else op for op, n in c.most_common() if op not in drop)


if not a.trace:
  for k in sorted(calls):
    print(k, ":", describe(k))
  raise SystemExit
d = json.load(gzip.open(a.trace) if a.trace.endswith(".gz") else open(a.trace))
ev = d["traceEvents"] if isinstance(d, dict) else d
dev = {e["pid"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"
       and any(s in str(e.get("args", {}).get("name", "")) for s in ("GPU", "/device:"))}
tot, cnt = collections.Counter(), collections.Counter()
for e in ev:
  if e.get("ph") == "X" and e.get("pid") in dev and "dur" in e:
    tot[e["name"]] += e["dur"]
    cnt[e["name"]] += 1
print("| kernel | ms/step | launches/step | ops |\n| --- | ---: | ---: | --- |")
for k, t in tot.most_common(a.top):
  print(f"| {k} | {t / 1e3 / a.steps:.3f} | {cnt[k] / a.steps:.0f} | {describe(k)[:160]} |")
print(f"\n{sum(cnt.values()) / a.steps:.0f} launches/step, {sum(tot.values()) / 1e3 / a.steps:.3f} ms/step of kernels")
