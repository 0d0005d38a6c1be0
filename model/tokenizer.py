"""Byte-level BPE tokenizer built from GGUF metadata (`tokenizer.ggml.model == "gpt2"`).

Goal: the same text gives the same ids as llama.cpp (`llama_tokenize(..., parse_special=True)`).

How it is built (mirrors llama.cpp's BPE path, llama-vocab.cpp):

- Special tokens: every token whose `tokenizer.ggml.token_type` is 3 (control), 4 (user-defined) or 2
  (unknown) is matched in the text as a whole string before any pre-tokenization, exactly like
  llama.cpp's `tokenizer_st_partition`: longest token text first (bytes), each one cutting every
  occurrence out of the raw text fragments that are left. The raw fragments in between are BPE-encoded.
  Default `parse_special=True` (what llama.cpp's CLI/server use for prompts). With
  `parse_special=False`, control and unknown tokens are plain text but user-defined tokens are still
  matched (llama.cpp does the same).
- Raw fragments go through a `tokenizers` pipeline: `Split(regex, "isolated")` for each regex of
  `tokenizer.ggml.pre` (in order), then `ByteLevel(add_prefix_space=False, use_regex=False)`, then
  `models.BPE(vocab, merges)`; `ignore_merges` (a whole pre-token that is in the vocab is emitted as is)
  for the pre names where llama.cpp sets it (llama3, glm4).
- BOS: `tokenizer.ggml.bos_token_id` (None when absent). `encode` prepends BOS when `add_bos`
  (argument, else `tokenizer.ggml.add_bos_token`, else the pre-name default: True for llama3, False
  otherwise).
  EOS is never appended (llama.cpp's `add_eos_token` is not used by any gpt2-type model we load).
- Pre names: qwen2, llama3 (= llama-bpe, llama-v3), glm4, gpt2 (llama.cpp spells it gpt-2; both are
  accepted), default; a missing `tokenizer.ggml.pre` means default, as in llama.cpp.
- Decode is the exact inverse of the byte-level mapping: normal tokens map back through the GPT-2
  byte table, user-defined tokens are emitted as their text, control/unknown tokens are emitted as
  their text only with `skip_special=False`; tokens of other types (unused, undefined) decode to "".
  Bytes are joined before UTF-8 decoding (errors="replace"), so a multi-byte character split over
  tokens decodes correctly. llama.cpp's `clean_spaces` post-pass of `llama_detokenize` (drops the
  space in " ." / " 's" for some pre names; off for qwen2) is deliberately not applied: it is lossy,
  and `decode(encode(x)) == x` holds here.

Known differences from llama.cpp (none reachable with the shipped vocab or qwen2/glm4/llama3 GGUFs
converted by convert_hf_to_gguf.py, on text made of characters assigned in Unicode 15):
- Unicode tables: the split regexes run in Oniguruma (inside `tokenizers`), whose tables are
  Unicode 16; llama.cpp's (unicode-data.cpp) are older. Characters new in Unicode 16 (e.g. Egyptian
  Hieroglyphs Ext-A U+13460..U+143FA, Garay, Kirat Rai, Sunuwar, ...) are letters to us and
  unassigned to llama.cpp, so words containing them can split, and so tokenize, differently.
- llama.cpp forces a few names (`<|im_end|>`, `<|endoftext|>`, FIM tokens, ...) to control type
  even when `token_type` says normal; here `token_type` is taken as written.
- Merges whose parts or result are not in the vocab are dropped (`tokenizers` refuses them);
  llama.cpp keeps their rank and falls back to bytes for the resulting symbol.
- A missing `tokenizer.ggml.bos_token_id` gives `bos_id = None` (llama.cpp: 11 for gpt2 vocabs).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

# --- pre-tokenizer regexes (the strings llama.cpp uses for each `tokenizer.ggml.pre`, llama-vocab.cpp) --
# The "adapted" forms: llama.cpp spells the contraction group without (?i:...) ('[sS] etc.).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
REGEX_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama3 and glm4 (chatglm-bpe) share one regex: numbers split in groups of up to three digits.
REGEX_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
REGEXES_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    REGEX_GPT2,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


@dataclasses.dataclass(frozen=True)
class _PreSpec:
  regexes: tuple[str, ...]
  ignore_merges: bool = False
  add_bos: bool = False          # default when `tokenizer.ggml.add_bos_token` is absent


_PRE = {
    "qwen2": _PreSpec((REGEX_QWEN2,)),
    "llama3": _PreSpec((REGEX_LLAMA3,), ignore_merges=True, add_bos=True),
    "glm4": _PreSpec((REGEX_LLAMA3,), ignore_merges=True),
    "gpt2": _PreSpec((REGEX_GPT2,)),
    "default": _PreSpec(REGEXES_DEFAULT),
}
# Other spellings of the same pre-tokenizers. llama.cpp itself knows GPT-2's as "gpt-2" (not "gpt2").
_PRE_ALIASES = {"llama-bpe": "llama3", "llama-v3": "llama3", "gpt-2": "gpt2"}
SUPPORTED_PRE = tuple(_PRE) + tuple(_PRE_ALIASES)

# tokenizer.ggml.token_type values (llama.cpp's LLAMA_TOKEN_TYPE_*)
TT_UNDEFINED, TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = range(7)


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (what byte-level BPE vocab strings are written in)."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
      + list(range(ord("\xae"), ord("\xff") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {b: chr(c) for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
  return {c: b for b, c in byte_to_unicode().items()}


def pre_regexes(pre: str) -> tuple[str, ...]:
  """The split regexes of a `tokenizer.ggml.pre` name (applied in order, each splitting the pieces)."""
  name = _PRE_ALIASES.get(pre, pre)
  if name not in _PRE:
    raise _fail("tokenizer.ggml.pre", pre, SUPPORTED_PRE)
  return _PRE[name].regexes


def _fail(key: str, value: Any, supported: Sequence[str]) -> ValueError:
  return ValueError(f"unsupported {key} = {value!r}; supported: {', '.join(supported)}")


class Tokenizer:
  """Byte-level BPE tokenizer of a GGUF file; same ids as llama.cpp (see the module docstring)."""

  def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None,
               pre: str, bos_id: int | None, eos_id: int | None, add_bos: bool | None):
    name = _PRE_ALIASES.get(pre, pre)
    if name not in _PRE:
      raise _fail("tokenizer.ggml.pre", pre, SUPPORTED_PRE)
    spec = _PRE[name]
    n = len(tokens)
    self.pre = name
    self.vocab_size = n
    # llama.cpp renames empty entries (so every id has a distinct, non-empty text)
    self._tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    if token_types is None:
      token_types = [TT_NORMAL] * n
    if len(token_types) < n:
      raise ValueError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {n} tokens")
    self._types = [int(t) for t in token_types[:n]]
    for key, v in (("tokenizer.ggml.bos_token_id", bos_id), ("tokenizer.ggml.eos_token_id", eos_id)):
      if v is not None and not 0 <= v < n:
        raise ValueError(f"{key} = {v} is out of range for a vocab of {n} tokens")
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.add_bos = spec.add_bos if add_bos is None else bool(add_bos)

    vocab = {t: i for i, t in enumerate(self._tokens)}   # duplicates: the last id wins, as in llama.cpp
    pairs = []
    for m in merges:
      # llama.cpp splits at the first space after the first character
      cut = m.find(" ", 1)
      if cut < 0:
        continue
      a, b = m[:cut], m[cut + 1:]
      if a in vocab and b in vocab and a + b in vocab:
        pairs.append((a, b))
    self.n_merges = len(pairs)
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges, byte_fallback=False,
                     fuse_unk=False)
    hf = _HFTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()   # for ad-hoc use of `_hf`; `decode` below handles token types
    self._hf = hf

    # special tokens, in llama.cpp's matching order: longest text (in bytes) first
    special = [i for i, t in enumerate(self._types) if t in (TT_CONTROL, TT_USER_DEFINED, TT_UNKNOWN)]
    special.sort(key=lambda i: -len(self._tokens[i].encode("utf-8")))
    self._special = [(self._tokens[i], i) for i in special]
    self._special_user = [(s, i) for s, i in self._special if self._types[i] == TT_USER_DEFINED]
    self._piece_cache: dict[int, bytes] = {}

  @classmethod
  def from_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
    """Builds the tokenizer from GGUF metadata (key -> python value)."""
    model = md.get("tokenizer.ggml.model")
    if model != "gpt2":
      raise _fail("tokenizer.ggml.model", model, ["gpt2 (byte-level BPE)"])
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
      if key not in md:
        raise ValueError(f"missing {key} (needed for tokenizer.ggml.model = 'gpt2')")
    pre = md.get("tokenizer.ggml.pre") or "default"   # llama.cpp: missing -> "default" (with a warning)
    add_bos = md.get("tokenizer.ggml.add_bos_token")
    return cls(tokens=list(md["tokenizer.ggml.tokens"]), merges=list(md["tokenizer.ggml.merges"]),
               token_types=md.get("tokenizer.ggml.token_type"), pre=str(pre),
               bos_id=_opt_int(md.get("tokenizer.ggml.bos_token_id")),
               eos_id=_opt_int(md.get("tokenizer.ggml.eos_token_id")),
               add_bos=None if add_bos is None else bool(add_bos))

  # --- encode ------------------------------------------------------------------------------------

  def _partition(self, text: str, parse_special: bool) -> list[str | int]:
    """Cuts special tokens out of `text` (llama.cpp's tokenizer_st_partition): str = raw, int = id."""
    frags: list[str | int] = [text]
    for s, i in (self._special if parse_special else self._special_user):
      if not any(isinstance(f, str) and s in f for f in frags):
        continue
      out: list[str | int] = []
      for f in frags:
        if isinstance(f, int) or s not in f:
          out.append(f)
          continue
        parts = f.split(s)
        for k, p in enumerate(parts):
          if k:
            out.append(i)
          if p:
            out.append(p)
      frags = out
    return frags

  def encode(self, text: str, add_bos: bool | None = None, *, parse_special: bool = True) -> list[int]:
    """Token ids of `text`; BOS first when `add_bos` (default: the GGUF's `add_bos_token`).

    `parse_special=True` (default) matches control/user-defined token texts such as "<|im_end|>" in
    `text` as single tokens, like llama.cpp's `llama_tokenize(..., parse_special=true)`.
    """
    ids: list[int] = []
    if self.add_bos if add_bos is None else add_bos:
      if self.bos_id is None:
        raise ValueError("add_bos requested but the GGUF has no tokenizer.ggml.bos_token_id")
      ids.append(self.bos_id)
    if not text:
      return ids
    frags = self._partition(text, parse_special) if self._special else [text]
    for f in frags:
      # one fragment at a time: encode_batch would start the Rust thread pool (trouble after fork)
      if isinstance(f, int):
        ids.append(f)
      else:
        ids.extend(self._hf.encode(f, add_special_tokens=False).ids)
    return ids

  # --- decode ------------------------------------------------------------------------------------

  def _piece(self, i: int) -> bytes:
    p = self._piece_cache.get(i)
    if p is None:
      t, tt = self._tokens[i], self._types[i]
      if tt in (TT_CONTROL, TT_UNKNOWN, TT_USER_DEFINED):
        p = t.encode("utf-8")
      elif tt in (TT_NORMAL, TT_BYTE):
        u2b = _unicode_to_byte()
        p = bytes(u2b[c] for c in t) if all(c in u2b for c in t) else \
            b"".join(bytes([u2b[c]]) if c in u2b else c.encode("utf-8") for c in t)
      else:
        p = b""
      self._piece_cache[i] = p
    return p

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    """Text of `ids`; control tokens (BOS/EOS/<|im_end|>...) are dropped when `skip_special`."""
    out = []
    for i in ids:
      i = int(i)
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
      if skip_special and self._types[i] in (TT_CONTROL, TT_UNKNOWN):
        continue
      out.append(self._piece(i))
    return b"".join(out).decode("utf-8", errors="replace")

  def token_text(self, i: int) -> str:
    """The vocab entry of id `i` as stored in the GGUF (byte-level form, e.g. 'Ġthe')."""
    return self._tokens[i]

  def token_type(self, i: int) -> int:
    return self._types[i]

  def __repr__(self) -> str:
    return (f"Tokenizer(pre={self.pre!r}, vocab_size={self.vocab_size}, merges={self.n_merges}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos}, "
            f"special={len(self._special)})")


def _opt_int(v: Any) -> int | None:
  return None if v is None else int(v)
