"""bench/prefill_cache: the least recently used entry leaves first, hits and misses are counted."""
import doctest

from bench import prefill_cache
from bench.prefill_cache import PrefillCache


def test_lru_order_and_counts():
  c = PrefillCache(capacity=2)
  c.put("a", 1)
  c.put("b", 2)
  assert c.get("a") == 1                      # a is now the most recent
  c.put("c", 3)                               # b leaves
  assert (c.get("b"), c.get("a"), c.get("c"), len(c)) == (None, 1, 3, 2)
  assert (c.hits, c.misses) == (3, 1)
  assert doctest.testmod(prefill_cache).failed == 0
