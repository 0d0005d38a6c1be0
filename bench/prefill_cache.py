"""`PrefillCache`: prompts already prefilled, so that a benchmark's arms that share a prompt and a ring pay one
prefill (`python -m bench.cells --reuse_prefill`). decode.engine.start_request takes it as `prefill_cache` (any
object with get and put) and hands out copies of an entry's arrays (the jitted steps donate the state)."""
from __future__ import annotations

import collections
import threading


class PrefillCache:
  """An entry is the main trunk's result of `start_request` (the ring, the host tier, the last logits and the prompt's
  last hidden states) under a key of everything that shapes it: the weights, the model options, the prompt, the
  ring's capacity and scratch, the tier's size, the KV dtype, the prefill chunking and the hidden rows kept
  (decode.engine.hidden_rows). The drafter ring is not part of it (it is filled after the prefill, from the hidden
  states), so a NextN arm and a lookup arm with the same k share an entry. Requests with an expert cache use it only
  for a prompt that streams whole (the state then holds no expert cache; a hit gets empty slots). `capacity`
  entries, least recently used out first; each holds a whole ring and tier, so keep it small on a GPU. Threads
  may share one (bench.cells.compile_all).

  >>> cache = PrefillCache(capacity=1)
  >>> cache.put("a", 1); cache.put("b", 2)
  >>> cache.get("a"), cache.get("b"), len(cache), (cache.hits, cache.misses)
  (None, 2, 1, (1, 1))
  """

  def __init__(self, capacity: int = 4):
    self.capacity, self._d = capacity, collections.OrderedDict()
    self.hits = self.misses = 0
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self._d)

  def get(self, key):
    with self._lock:
      if key not in self._d:
        self.misses += 1
        return None
      self.hits += 1
      self._d.move_to_end(key)
      return self._d[key]

  def put(self, key, value) -> None:
    with self._lock:
      self._d[key] = value
      self._d.move_to_end(key)
      while len(self._d) > self.capacity:
        self._d.popitem(last=False)
