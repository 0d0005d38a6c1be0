"""model/tokenizer.py against llama.cpp (llama-cpp-python, vocab_only) on our shipped vocabs.

Each case writes a tiny GGUF (general.architecture + the tokenizer.ggml.* keys, no tensors), loads it
in llama.cpp with vocab_only=True and compares token ids and decoded bytes with ours.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import random
import unicodedata

import gguf
import pytest

from configs import vocab as vocab_lib
from model.tokenizer import Tokenizer

llama_cpp = pytest.importorskip("llama_cpp")

# pre names we support and the spelling llama.cpp knows them by
PRES = {"qwen2": "qwen2", "llama3": "llama3", "llama-bpe": "llama-bpe", "glm4": "glm4",
        "gpt2": "gpt-2", "default": "default"}

TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It wasn't me, said the cat; \"really?\"",
    "A for-loop over a list: for x in xs: print(x) -- see the tutorial (section 4.2).",
    "def f(x, y=3):\n    if x > y:\n        return x ** 2\n\treturn None\n\n\n# done\n",
    "class A:\n  pass\n\n\n\n    \n  \t \n",
    "\t\ttabs\tand\t\t\tmore tabs\t",
    "numbers: 0 7 42 123 1234 12345 123456789 3.14159 1e-10 -42 +7 1,000,000 0x1F",
    "don't DON'T I'LL you're we've she'd it's I'm can't 'quoted' ''double'' o'clock",
    "I'LL WE'VE THEY'RE HE'S Y'ALL 's 'S 'd 'D 'll 'Ll",
    "café naïve résumé Ünïcödé façade São Paulo Œuvre Straße",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "emoji: 🤖🚀 👍🏽 👨‍👩‍👧‍👦 🇩🇪 ❤️ ✓ ∑ ∞ → ≤",
    "   leading spaces",
    "trailing spaces   ",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    " \n \n ",
    "\r\n windows\r\nline endings\r\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|endoftext|>",
    "<|im_end|><|im_end|> <|im_start|>",
    "<|im_start <|im_end| |im_end|> <|endoftext",
    "Ω≈ç√∫˜µ≤≥÷ åß∂ƒ©˙∆˚¬… ¡™£¢∞§¶•ªº–≠ «»‘’“”",
    "mixed123abc 123abc abc123 a1b2c3 ４５６ ⅫⅣ ²³",
    "punctuation!!! ??? ... ,,, ;;; ::: --- ___ *** ### @@@ $$$ %%% ^^^ &&& ||| ~~~ `` <<>> ==",
    "x" * 300,
    "a  b   c    d     e\u00a0f\u2003g\u3000h",
]


def _read_metadata(path) -> dict:
  """GGUF key -> python value (str, int, bool, float, list[str], list[int])."""
  reader = gguf.GGUFReader(path)
  return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _write_gguf(path, md: dict, arch: str = "qwen3moe") -> None:
  w = gguf.GGUFWriter(str(path), arch)
  for key, v in md.items():
    if isinstance(v, bool):
      w.add_bool(key, v)
    elif isinstance(v, int):
      w.add_uint32(key, v)
    elif isinstance(v, str):
      w.add_string(key, v)
    elif v and isinstance(v[0], str):
      w.add_array(key, list(v))
    else:
      w.add_key_value(key, [int(x) for x in v], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


class _Pair:
  """Our tokenizer and llama.cpp's on the same GGUF."""

  def __init__(self, path):
    self.ours = Tokenizer.from_metadata(_read_metadata(str(path)))
    self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    self.vocab = self.llm._model.vocab

  def cpp_encode(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
    return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)

  def cpp_decode(self, ids, special: bool) -> bytes:
    out, buf = b"", ctypes.create_string_buffer(1024)
    for i in ids:
      n = llama_cpp.llama_token_to_piece(self.vocab, i, buf, len(buf), 0, special)
      assert 0 <= n <= len(buf)
      out += buf.raw[:n]
    return out


_CACHE: dict = {}


@functools.lru_cache(maxsize=None)
def _spec(n: int | str) -> vocab_lib.VocabSpec:
  """A shipped vocab (int size), or "own": 2048 tokens trained with the pre's own regexes."""
  if isinstance(n, int):
    return vocab_lib.load_vocab(n)
  return vocab_lib.train_vocab(2048, pre=n)


def _pair(tmp_path_factory, n: int | str, pre: str, drop: tuple[str, ...] = (), **override) -> _Pair:
  """llama.cpp and us on vocab `n` (see _spec; "own" = trained with `pre`) under pre name `pre`."""
  key = (n, pre, drop, tuple(sorted((k, repr(v)) for k, v in override.items())))
  if key not in _CACHE:
    md = _spec(pre if n == "own" else n).metadata()
    md["tokenizer.ggml.pre"] = PRES[pre]
    md.update(override)
    for k in drop:
      md.pop(k)
    path = tmp_path_factory.mktemp("tok") / "vocab.gguf"
    _write_gguf(path, md)
    _CACHE[key] = _Pair(path)
  return _CACHE[key]


def _fuzz_texts(seed: int, count: int) -> list[str]:
  rng = random.Random(seed)
  atoms = (list("abcdefghijklmnopqrstuvwxyzABCDEFXYZ0123456789") + list(" \t\n\r'\".,;:!?()[]{}<>|-_=+*/\\#@$%^&~`")
           + ["  ", "   ", "\n\n", " \n", "\t\t", "'s", "'T", "'ll", "'RE", "don't", "123", "4567", "the", " the",
              "é", "ü", "ß", "Ω", "日本", "中文", "한국", "🤖", "👍🏽", "\u00a0", "\u3000", "\u200b", "²", "٣", "Ⅻ",
              "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "|>", "def ", "return", "    "])
  return ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 40))) for _ in range(count)]


# --- ids against llama.cpp ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", vocab_lib.SIZES + ("own",))
@pytest.mark.parametrize("pre", list(PRES))
def test_ids_match_llama_cpp(tmp_path_factory, n, pre):
  p = _pair(tmp_path_factory, n, pre)
  bad = []
  for text in TEXTS + _fuzz_texts(seed={1024: 1, 4096: 2, "own": 3}[n], count=300):
    ours, ref = p.ours.encode(text), p.cpp_encode(text, add_special=True)
    if ours != ref:
      bad.append((text, ours, ref))
  assert not bad, f"{len(bad)} mismatches, first: {bad[0]!r}"


def _unicode_pool(rng: random.Random, size: int) -> list[str]:
  """Codepoints from all planes, each assigned in this Python's Unicode (3.12: 15.0).

  Not unassigned ones: Oniguruma (in `tokenizers`) already has Unicode 16 tables, llama.cpp's are
  older, so for codepoints new in Unicode 16 (e.g. Egyptian Hieroglyphs Ext-A, U+13460..U+143FA) the
  two disagree on \\p{L} and split differently; that gap is known and documented in model/tokenizer.py.
  """
  spans = [(0x21, 0x7E, 4), (0x80, 0x7FF, 2), (0x800, 0xD7FF, 3), (0xE000, 0xFFFD, 1), (0x10000, 0x1FFFF, 2),
           (0x20000, 0x3134A, 1)]
  pool: set[str] = set(" \t\n\r\x0b\x0c\x85\u00a0\u2000\u2028\u3000\u200b\ufeff'sSdD")
  while len(pool) < size:
    lo, hi, _ = rng.choices(spans, weights=[w for *_, w in spans])[0]
    c = chr(rng.randint(lo, hi))
    if unicodedata.category(c) not in ("Cn", "Cs"):
      pool.add(c)
  return sorted(pool)


@pytest.mark.parametrize("pre", ["qwen2", "llama3", "glm4", "gpt2", "default"])
def test_ids_match_llama_cpp_unicode(tmp_path_factory, pre):
  """A vocab trained (with `pre`'s own regexes) on random text over a pool of Unicode characters, so
  that merges cross every kind of character boundary: any split difference shows up in the ids."""
  rng = random.Random(1234)
  pool = _unicode_pool(rng, 200)
  spec = vocab_lib.train_vocab(3000, text="".join(rng.choices(pool, k=100_000)), pre=pre)
  md = spec.metadata()
  md["tokenizer.ggml.pre"] = PRES[pre]
  path = tmp_path_factory.mktemp("tok") / "pool.gguf"
  _write_gguf(path, md)
  p = _Pair(path)
  bad = []
  for _ in range(1000):
    text = "".join(rng.choices(pool, k=rng.randint(1, 30)))
    ours = p.ours.encode(text)
    if ours != p.cpp_encode(text, add_special=True) or p.ours.decode(ours) != text:
      bad.append(text)
  assert not bad, f"{len(bad)} mismatches, first: {ascii(bad[0])}"


@pytest.mark.parametrize("pre", ["qwen2", "glm4", "default"])
def test_ids_match_without_parse_special(tmp_path_factory, pre):
  p = _pair(tmp_path_factory, "own", pre)
  for text in TEXTS + _fuzz_texts(seed=7, count=100):
    assert p.ours.encode(text, parse_special=False) == p.cpp_encode(text, False, parse_special=False), text


def test_pre_tokenizers_differ():
  """The per-pre vocabs really exercise the regexes: the same text splits differently."""
  text = "x 12345678 (abc) don't\n\n  y 2024 100"
  got = {}
  for pre in ("qwen2", "llama3", "glm4", "gpt2", "default"):
    tok = Tokenizer.from_metadata(_spec(pre).metadata())
    got[pre] = [tok.token_text(i) for i in tok.encode(text)]
  assert all(len(t) == 1 for t in got["qwen2"] if t.isdigit())           # \p{N}: one digit a piece
  for pre in ("llama3", "glm4"):                                          # \p{N}{1,3}
    assert "100" in got[pre] and max(len(t) for t in got[pre] if t.isdigit()) <= 3
  assert "Ġ1" in got["gpt2"]                                              # " ?\p{N}+"
  assert "Ġ(" in got["qwen2"] and "Ġ(" not in got["default"]              # default splits \p{P} first
  assert len({tuple(v) for v in got.values()}) >= 3, got


@pytest.mark.parametrize("pre", list(PRES))
def test_ignore_merges(tmp_path_factory, pre):
  """Whole pre-tokens that are in the vocab but unreachable by merges: llama3/glm4 emit them as is."""
  spec = _spec(1024)
  extra = ["Ġzyxwv", "qqqq", "Ġthe"]
  extra = [t for t in extra if t not in spec.tokens]
  p = _pair(tmp_path_factory, 1024, pre, **{"tokenizer.ggml.tokens": list(spec.tokens) + extra,
                                            "tokenizer.ggml.token_type": list(spec.token_types) + [1] * len(extra)})
  for text in ["a zyxwv qqqq", " zyxwv", "qqqq zyxwv the"]:
    ours, ref = p.ours.encode(text), p.cpp_encode(text, add_special=True)
    assert ours == ref, text
    assert (spec.size in ours) == (pre in ("llama3", "llama-bpe", "glm4")), (text, ours)


def test_special_tokens_are_single_ids(tmp_path_factory):
  p = _pair(tmp_path_factory, 1024, "qwen2")
  spec = vocab_lib.load_vocab(1024)
  ids = p.ours.encode("<|im_start|>user\nhi<|im_end|>\n<|endoftext|>")
  for name in vocab_lib.SPECIAL_TOKENS:
    assert spec.tokens.index(name) in ids
  assert p.ours.encode("<|im_end|>") == [spec.tokens.index("<|im_end|>")]
  # as plain text it is several ordinary tokens
  assert len(p.ours.encode("<|im_end|>", parse_special=False)) > 1


# --- BOS handling ------------------------------------------------------------------------------------


def test_add_bos_from_metadata(tmp_path_factory):
  p = _pair(tmp_path_factory, 1024, "qwen2", **{"tokenizer.ggml.add_bos_token": True})
  bos = vocab_lib.load_vocab(1024).bos_id
  assert p.ours.add_bos and p.ours.bos_id == bos
  for text in ["", "hello", "<|endoftext|>x"]:
    assert p.ours.encode(text) == p.cpp_encode(text, add_special=True)
    assert p.ours.encode(text)[0] == bos
    assert p.ours.encode(text, add_bos=False) == p.cpp_encode(text, add_special=False)
  q = _pair(tmp_path_factory, 1024, "qwen2")
  assert not q.ours.add_bos
  assert q.ours.encode("hello", add_bos=True) == [bos] + q.ours.encode("hello")


@pytest.mark.parametrize("pre,expected", [("llama3", True), ("qwen2", False), ("glm4", False)])
def test_add_bos_default_without_key(tmp_path_factory, pre, expected):
  p = _pair(tmp_path_factory, 1024, pre, drop=("tokenizer.ggml.add_bos_token",))
  assert p.ours.add_bos is expected
  for text in ["", "hello there"]:
    assert p.ours.encode(text) == p.cpp_encode(text, add_special=True)


# --- decode ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", vocab_lib.SIZES)
def test_roundtrip_and_decode_matches_llama_cpp(tmp_path_factory, n):
  p = _pair(tmp_path_factory, n, "qwen2")
  for text in TEXTS + _fuzz_texts(seed=3, count=200):
    ids = p.ours.encode(text)
    assert p.ours.decode(ids, skip_special=False) == text
    for skip in (True, False):
      assert p.ours.decode(ids, skip_special=skip) == p.cpp_decode(ids, special=not skip).decode("utf-8", "replace")
  assert p.ours.decode(p.ours.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_decode_partial_utf8(tmp_path_factory):
  p = _pair(tmp_path_factory, 1024, "qwen2")
  ids = p.ours.encode("🤖")
  assert len(ids) > 1                      # a 4-byte character over several byte tokens
  assert p.ours.decode(ids) == "🤖"
  assert p.ours.decode(ids[:1]) == "\ufffd"
  with pytest.raises(ValueError, match="out of range"):
    p.ours.decode([p.ours.vocab_size])


def test_token_text_and_sizes():
  spec = vocab_lib.load_vocab(1024)
  tok = Tokenizer.from_metadata(spec.metadata())
  assert tok.vocab_size == 1024 and tok.eos_id == spec.eos_id and tok.bos_id == spec.bos_id
  assert tok.token_text(spec.eos_id) == "<|endoftext|>"
  assert tok.token_text(tok.encode(" the")[0]) == "Ġthe"


# --- errors ------------------------------------------------------------------------------------------


def _md(**kv):
  md = vocab_lib.load_vocab(1024).metadata()
  md.update(kv)
  return md


@pytest.mark.parametrize("model", ["llama", "bert", None])
def test_unsupported_model_error(model):
  md = _md()
  md["tokenizer.ggml.model"] = model
  if model is None:
    md.pop("tokenizer.ggml.model")
  with pytest.raises(ValueError) as e:
    Tokenizer.from_metadata(md)
  msg = str(e.value)
  assert "\n" not in msg and "tokenizer.ggml.model" in msg and repr(model) in msg and "gpt2" in msg


def test_unknown_pre_error():
  with pytest.raises(ValueError) as e:
    Tokenizer.from_metadata(_md(**{"tokenizer.ggml.pre": "deepseek-v3"}))
  msg = str(e.value)
  assert "\n" not in msg and "tokenizer.ggml.pre" in msg and "'deepseek-v3'" in msg
  for name in ("qwen2", "llama3", "glm4", "gpt2", "default"):
    assert name in msg


def test_missing_pre_is_default():
  md = _md()
  md.pop("tokenizer.ggml.pre")
  assert Tokenizer.from_metadata(md).pre == "default"


# --- the shipped vocab -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", vocab_lib.SIZES)
def test_shipped_vocab(n):
  spec = vocab_lib.load_vocab(n)
  assert spec.size == n == len(spec.token_types)
  assert spec.tokens[-3:] == vocab_lib.SPECIAL_TOKENS
  assert spec.token_types[-3:] == (3, 3, 3) and set(spec.token_types[:-3]) == {1}
  assert spec.eos_id == spec.tokens.index("<|endoftext|>") and spec.pre == "qwen2" and not spec.add_bos
  assert len(set(spec.tokens)) == n
  from tokenizers.pre_tokenizers import ByteLevel
  assert set(ByteLevel.alphabet()) <= set(spec.tokens[:256])
  merges_ok = all(a + b in spec.tokens for a, b in (m.split(" ") for m in spec.merges))
  assert merges_ok and len(spec.merges) == n - 256 - 3


@pytest.mark.parametrize("n", vocab_lib.SIZES)
def test_retrain_reproduces_shipped(n):
  prov = vocab_lib.shipped_provenance(n)
  text = vocab_lib.training_text()
  if hashlib.sha256(text.encode("utf-8")).hexdigest() != prov["text_sha256"]:
    pytest.skip(f"pydoc_data differs from the one the vocab was trained on (Python {prov['python']})")
  assert vocab_lib.train_vocab(n, text) == vocab_lib.load_vocab(n)


def test_add_to_gguf_roundtrip(tmp_path):
  spec = vocab_lib.load_vocab(1024)
  path = tmp_path / "v.gguf"
  w = gguf.GGUFWriter(str(path), "qwen3moe")
  vocab_lib.add_to_gguf(w, spec)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  md = _read_metadata(str(path))
  for key, v in spec.metadata().items():
    assert md[key] == v, key
  reader = gguf.GGUFReader(str(path))
  assert reader.fields["tokenizer.ggml.token_type"].types[-1] == gguf.GGUFValueType.INT32
  llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
  assert llm.n_vocab() == 1024 and llm.token_eos() == spec.eos_id
  text = "<|im_start|>user\nDon't panic: 42!<|im_end|>"
  assert Tokenizer.from_metadata(md).encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True)
