"""Our own small byte-level BPE vocabulary (no vocabularies come from hubs).

Trained with `tokenizers`' BpeTrainer on text that ships with Python, `pydoc_data.topics.topics` (the
standard library's documentation topics, joined in sorted key order), pre-tokenized with the qwen2
regex (so merges never cross its splits) and the ByteLevel alphabet (all 256 byte symbols are tokens);
tokens are capped by BpeTrainer(max_token_length=16) (no long table-border tokens from the docs).
Layout, like Qwen's: trained tokens first (ids 0..N-4, the 256 byte symbols first), then the three
control tokens `<|endoftext|>` (EOS, also BOS/PAD), `<|im_start|>`, `<|im_end|>`. `add_bos` is False.

Shipped as `configs/data/vocab_{N}.json` for N = 1024 and 4096:
    python -m configs.vocab --size 1024
`pydoc_data` changes between Python versions, so retraining reproduces the shipped file only on the
Python whose text it was made from (the file records the version and a sha256 of the text); the
shipped file, not retraining, is what models use.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import pathlib
import sys
from typing import Any

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"
SIZES = (1024, 4096)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PRE = "qwen2"
TT_NORMAL, TT_CONTROL = 1, 3


@dataclasses.dataclass(frozen=True)
class VocabSpec:
  tokens: tuple[str, ...]        # id order, GGUF byte-level form ("Ġthe")
  token_types: tuple[int, ...]   # tokenizer.ggml.token_type: 1 normal, 3 control
  merges: tuple[str, ...]        # "a b", rank order
  bos_id: int
  eos_id: int
  pre: str                       # tokenizer.ggml.pre
  add_bos: bool

  @property
  def size(self) -> int:
    return len(self.tokens)

  def metadata(self) -> dict[str, Any]:
    """The GGUF tokenizer keys as `model.tokenizer.Tokenizer.from_metadata` reads them."""
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": self.pre,
        "tokenizer.ggml.tokens": list(self.tokens),
        "tokenizer.ggml.token_type": list(self.token_types),
        "tokenizer.ggml.merges": list(self.merges),
        "tokenizer.ggml.bos_token_id": self.bos_id,
        "tokenizer.ggml.eos_token_id": self.eos_id,
        "tokenizer.ggml.padding_token_id": self.eos_id,
        "tokenizer.ggml.add_bos_token": self.add_bos,
    }


def training_text() -> str:
  import pydoc_data.topics
  topics = pydoc_data.topics.topics
  return "\n\n".join(topics[k] for k in sorted(topics))


def train_vocab(n: int, text: str | None = None, pre: str = PRE) -> VocabSpec:
  """Trains an `n`-token vocab (`n` includes the 256 bytes and the 3 control tokens).

  `pre` (a `tokenizer.ggml.pre` name, see model/tokenizer.py) picks the split regexes the merges
  respect; the shipped vocabs use qwen2, tests train others to exercise each pre-tokenizer.
  """
  from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

  from model.tokenizer import pre_regexes

  n_special = len(SPECIAL_TOKENS)
  if n < 256 + n_special + 1:
    raise ValueError(f"vocab size {n} < 256 bytes + {n_special} special tokens + 1")
  text = training_text() if text is None else text
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre_regexes(pre)]
      + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  trainer = trainers.BpeTrainer(
      vocab_size=n, min_frequency=2, max_token_length=16, show_progress=False,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([text], trainer=trainer)
  state = json.loads(tok.to_str())["model"]
  vocab: dict[str, int] = state["vocab"]
  merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
  by_id = sorted(vocab, key=vocab.__getitem__)
  normal = [t for t in by_id if t not in SPECIAL_TOKENS]
  if len(normal) + n_special != n:
    raise ValueError(f"training text too small: got {len(normal) + n_special} tokens, asked {n}")
  tokens = tuple(normal) + SPECIAL_TOKENS
  types = (TT_NORMAL,) * len(normal) + (TT_CONTROL,) * n_special
  eos = tokens.index("<|endoftext|>")
  return VocabSpec(tokens=tokens, token_types=types, merges=tuple(merges), bos_id=eos, eos_id=eos,
                   pre=pre, add_bos=False)


def vocab_path(n: int) -> pathlib.Path:
  return DATA_DIR / f"vocab_{n}.json"


def save_vocab(spec: VocabSpec, path: pathlib.Path, text: str | None = None) -> None:
  text = training_text() if text is None else text
  doc = {
      "source": "pydoc_data.topics.topics, values joined by blank lines in sorted key order",
      "python": "%d.%d.%d" % sys.version_info[:3],
      "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
      "pre": spec.pre, "bos_id": spec.bos_id, "eos_id": spec.eos_id, "add_bos": spec.add_bos,
      "tokens": list(spec.tokens), "token_type": list(spec.token_types), "merges": list(spec.merges),
  }
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(doc, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")


@functools.lru_cache(maxsize=None)
def load_vocab(n: int = 1024) -> VocabSpec:
  """The shipped vocab of `n` tokens (configs/data/vocab_{n}.json)."""
  path = vocab_path(n)
  if not path.exists():
    raise ValueError(f"no shipped vocab of size {n} (have {', '.join(map(str, SIZES))}): {path}")
  doc = json.loads(path.read_text(encoding="utf-8"))
  return VocabSpec(tokens=tuple(doc["tokens"]), token_types=tuple(doc["token_type"]),
                   merges=tuple(doc["merges"]), bos_id=int(doc["bos_id"]), eos_id=int(doc["eos_id"]),
                   pre=doc["pre"], add_bos=bool(doc["add_bos"]))


def shipped_provenance(n: int = 1024) -> dict[str, str]:
  doc = json.loads(vocab_path(n).read_text(encoding="utf-8"))
  return {"python": doc["python"], "text_sha256": doc["text_sha256"]}


def add_to_gguf(writer, spec: VocabSpec) -> None:
  """Writes every tokenizer.ggml.* key llama.cpp needs for this vocab (writer: gguf.GGUFWriter; model.writer's rule)."""
  from model.writer import write_vocab
  write_vocab(writer, spec)


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--size", type=int, action="append", help=f"vocab size (default: {SIZES})")
  args = ap.parse_args(argv)
  text = training_text()
  for n in args.size or SIZES:
    spec = train_vocab(n, text)
    save_vocab(spec, vocab_path(n), text)
    print(f"wrote {vocab_path(n)}: {spec.size} tokens, {len(spec.merges)} merges")


if __name__ == "__main__":
  main()
