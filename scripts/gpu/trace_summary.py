"""Per-kernel GPU time from a jax.profiler perfetto trace (`bench.step --profile DIR`), plain Python.

  python scripts/gpu/trace_summary.py DIR/.../perfetto_trace.json.gz --steps 32 [--top 25]

Sums the durations of complete events ("X") on the device processes (process names with "GPU" or "/device:"),
groups them by kernel name, and prints ms per step, share and launches per step; the last line compares the sum
of kernel time with the trace's device span, so the gap (launch latency, host syncs) is visible too. With
--gaps US it then lists the device's idle stretches longer than US microseconds: their total, and the longest
with the kernels before and after and the host events that span them (what the host was doing meanwhile).
"""
import argparse
import collections
import gzip
import json


def load(path):
  """(all events, the device process ids, the device's complete events) of a perfetto trace.json(.gz)."""
  d = json.load(gzip.open(path) if path.endswith(".gz") else open(path))
  ev = d["traceEvents"] if isinstance(d, dict) else d
  dev = {e["pid"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"
         and any(s in str(e.get("args", {}).get("name", "")) for s in ("GPU", "/device:"))}
  return ev, dev, [e for e in ev if e.get("ph") == "X" and e.get("pid") in dev and "dur" in e]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("trace")
  ap.add_argument("--steps", type=int, default=1, help="decode steps in the traced run (per-step figures)")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--gaps", type=float, default=0, help="list device idle stretches longer than this (us)")
  a = ap.parse_args()
  ev, dev, ks = load(a.trace)
  if not ks:
    raise SystemExit(f"{a.trace}: no device events (device processes: {sorted(dev)})")
  tot, cnt = collections.Counter(), collections.Counter()
  for e in ks:
    tot[e["name"]] += e["dur"]
    cnt[e["name"]] += 1
  busy = sum(tot.values())
  span = max(e["ts"] + e["dur"] for e in ks) - min(e["ts"] for e in ks)
  print("| kernel | ms/step | share | launches/step |\n| --- | ---: | ---: | ---: |")
  for name, us in tot.most_common(a.top):
    print(f"| {name[:70]} | {us / 1e3 / a.steps:.3f} | {100 * us / busy:.1f} % | {cnt[name] / a.steps:.0f} |")
  print(f"\nkernel time {busy / 1e3 / a.steps:.3f} ms/step over a device span of {span / 1e3 / a.steps:.3f} ms/step "
        f"({len(ks) / a.steps:.0f} launches/step)")

  if a.gaps:
    iv = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ks)
    gaps, end, last = [], iv[0][1], iv[0][2]
    for t0, t1, name in iv[1:]:
      if t0 - end > a.gaps:
        gaps.append((t0 - end, end, t0, last, name))
      if t1 > end:
        end, last = t1, name
    host = [e for e in ev if e.get("ph") == "X" and e.get("pid") not in dev and "dur" in e]
    print(f"\n{len(gaps)} device idle stretches > {a.gaps:g} us: {sum(g[0] for g in gaps) / 1e3:.3f} ms in all")
    for g, t0, t1, before, after in sorted(gaps, reverse=True)[:a.top]:
      over = sorted((h for h in host if h["ts"] <= t0 and h["ts"] + h["dur"] >= t1), key=lambda h: h["dur"])
      print(f"  {g / 1e3:.3f} ms after {before[:40]} before {after[:40]}; host: "
            + " < ".join(h["name"][:50] for h in over[:3]))


if __name__ == "__main__":
  main()
