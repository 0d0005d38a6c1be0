"""Print the fastest decode-attention variant of an `bench.attention --variants` log at one depth, as a
bench.step attn spec (dots/bk/warps/stages). Usage: python3 scripts/gpu/best_attn.py LOG DEPTH [FALLBACK]."""
import re
import sys

log, depth = sys.argv[1], int(sys.argv[2])
best = (float("inf"), sys.argv[3] if len(sys.argv) > 3 else "tf32x3/64/4/2")
pat = re.compile(r"depth\s+(\d+)\s+R\s+(\d+)\s+(\S+)\s+([\d.]+) us")
for line in open(log, errors="replace"):
  m = pat.search(line)
  if m and int(m.group(1)) == depth and ":" in m.group(3) and len(m.group(3).split(":")) == 4:
    best = min(best, (float(m.group(4)), m.group(3).replace(":", "/")))
print(best[1])
