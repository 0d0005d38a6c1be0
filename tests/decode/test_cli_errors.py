"""Every hostile input of issue 28 walked through the CLI edge: `decode.generate` turns each expected failure (a bad
file, flag or cache, a refused plan, non-finite logits) into one line `error: ...` and exit 1 before any token is
printed, while an unexpected exception keeps its traceback (decode.cli's one catch); bench.cells, bench.step,
bench.attention and configs.synth report theirs in one line too.

The generate cases run in one child process (this file is its driver: `python tests/decode/test_cli_errors.py
CASES`), each through generate's main behind decode.cli.guarded with the flags parsed anew: one compile serves the
cases that run the model, and decode.generate's flags stay out of the test process (bench.cells defines flags of
the same names). A few cases run as their own `python -m` process: real argv bytes, the traceback of a bug, and
the other CLIs.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":                           # the driver: this checkout's packages, on the CPU
  sys.path.insert(0, ROOT)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
PROMPT = ["--prompt", "Hello", "--max_new_tokens", "8", "--json"]
WANT_IDS = [733, 279, 267, 198, 266, 82, 528, 13]      # the default model's greedy ids after "Hello"


def _files(tmp: str) -> dict:
  from configs.default import default_model_path
  from tests.gguf_edit import edit_copy, move_tensor, set_block_scale, set_tensor_type, set_tensor_values, set_value
  d, nan = default_model_path(), float("nan")
  edits = {
      "nan_output_norm": [set_tensor_values("output_norm.weight", nan)],
      "inf_router": [set_tensor_values("blk.1.ffn_gate_inp.weight", float("inf"))],
      "nan_eps": [set_value("glm4moe.attention.layer_norm_rms_epsilon", nan)],
      "rope_base_0": [set_value("glm4moe.rope.freq_base", 0.0)],
      "overlap": [set_tensor_type("token_embd.weight", "F16")],
      "misaligned": [move_tensor("blk.0.attn_k.weight", 2)],
      "head_count_kv_0": [set_value("glm4moe.attention.head_count_kv", 0)],
      "expert_used_0": [set_value("glm4moe.expert_used_count", 0)],
      "expert_used_17": [set_value("glm4moe.expert_used_count", 17)],
      "nan_q_scale": [set_block_scale("blk.0.attn_q.weight", nan)],                 # every logit NaN
      "nan_embd_198": [set_block_scale("token_embd.weight", nan, block=198 * 8)],   # token 198's row (output 3)
  }
  return {k: edit_copy(d, os.path.join(tmp, f"{k}.gguf"), *e) for k, e in edits.items()}


def _cases(tmp: str) -> list[dict]:
  """name, flags, the last stderr line (prefix ...) it must give, and what the driver does first."""
  from configs.default import default_model_path
  f = _files(tmp)
  bad_utf8 = os.path.join(tmp, "bad.txt")
  with open(bad_utf8, "wb") as fh:
    fh.write(b"Hi \xc3\x28 there")
  a_file = os.path.join(tmp, "a_file")
  with open(a_file, "w") as fh:
    fh.write("x")
  locked = os.path.join(tmp, "locked.gguf")
  with open(default_model_path(), "rb") as src, open(locked, "wb") as dst:
    dst.write(src.read())
  cache = os.path.join(tmp, "cache")
  p = lambda k: f[k] + ": "  # noqa: E731
  c = [
      ("nan_output_norm", ["--gguf", f["nan_output_norm"]], p("nan_output_norm") + "tensor 'output_norm.weight' has a "
       "non-finite value (nan at flat index 0 of 256), expected finite weights"),
      ("inf_router", ["--gguf", f["inf_router"]], p("inf_router") + "tensor 'blk.1.ffn_gate_inp.weight' has a "
       "non-finite value (inf at flat index 0 of 4096), expected finite weights"),
      ("nan_eps", ["--gguf", f["nan_eps"]], p("nan_eps") + "key 'glm4moe.attention.layer_norm_rms_epsilon' is nan, "
       "expected a finite number > 0"),
      ("rope_base_0", ["--gguf", f["rope_base_0"]], p("rope_base_0") + "key 'glm4moe.rope.freq_base' is 0.0, expected "
       "a finite number > 0"),
      ("overlap", ["--gguf", f["overlap"]], p("overlap") + "tensor 'token_embd.weight' (data bytes 0..524288) overlaps "
       "tensor 'blk.0.attn_k.bias' (from 278528), expected each tensor's bytes apart"),
      ("misaligned", ["--gguf", f["misaligned"]], p("misaligned") + "tensor 'blk.0.attn_k.weight' has offset 279042, "
       "expected a multiple of general.alignment 32"),
      ("head_count_kv_0", ["--gguf", f["head_count_kv_0"]], p("head_count_kv_0") + "key "
       "'glm4moe.attention.head_count_kv' is 0, expected an int in [1, 4] (attention.head_count)"),
      ("expert_used_0", ["--gguf", f["expert_used_0"]], p("expert_used_0") + "key 'glm4moe.expert_used_count' is 0, "
       "expected an int in [1, 16] (expert_count 16)"),
      ("expert_used_17", ["--gguf", f["expert_used_17"]], p("expert_used_17") + "key 'glm4moe.expert_used_count' is "
       "17, expected an int in [1, 16] (expert_count 16)"),
      ("temperature", ["--temperature", "-1"], "--temperature: -1.0, expected a finite number >= 0"),
      ("top_p_0", ["--top_p", "0"], "--top_p: 0.0, expected a finite number in (0, 1]"),
      ("top_p_big", ["--top_p", "1.5"], "--top_p: 1.5, expected a finite number in (0, 1]"),
      ("max_new_tokens", ["--max_new_tokens", "-1"], "--max_new_tokens: -1, expected an integer >= 0"),
      ("mtp_window", ["--mtp_window", "0"], "--mtp_window: 0, expected a positive number of drafter ring entries"),
      ("mtp_draft", ["--mtp_draft", "8"], "--mtp_draft: 8, expected 1 to 7 drafts per round (k + 1 verify rows fit "
       "the ring's 8 scratch slots)"),
      ("max_new_tokens_huge", ["--max_new_tokens", "1000000000"], "memory plan: 2048.01 GiB exceeds the host's "
       "memory "),
      ("expert_cache_1", ["--expert_cache", "1"], "memory plan: 1 expert slots < top_k 2 (a token's experts must all "
       "be resident)"),
      ("kv_resident_7", ["--kv_resident", "7"], "--kv_resident 7: the ring's window is 3 tokens (7 slots less 4 "
       "scratch slots for 3 drafts), expected at least prompt 3 + max_new_tokens 8 = 11 (or give --max_context for a "
       "host tier)"),
      ("device_budget", ["--device_budget", "lots"], "--device_budget: 'lots', expected a size such as 24GiB"),
      ("gguf_dir", ["--gguf", tmp], f"{tmp}: is a directory, expected a GGUF file"),
      ("gguf_unreadable", ["--gguf", locked], f"{locked}: cannot read the file (Permission denied)"),
      ("prompt_utf8", ["--prompt", "Hi\udcff"], "--prompt: not valid UTF-8 (byte 0xff at byte offset 2)"),
      ("prompt_file_utf8", ["--prompt_file", bad_utf8], f"--prompt_file {bad_utf8}: not valid UTF-8 (byte 0xc3 at "
       "byte offset 3)"),
      ("cache_dir_file", ["--cache_dir", a_file], f"--cache_dir {a_file}: is a file, expected a directory"),
      ("nan_logits_prefill", ["--gguf", f["nan_q_scale"]], "logits: NaN or Inf at generated token 0 (the prompt's "
       "last position, position 2), so the request stops; likely cause: non-finite or overflowing weights in the "
       "model file (a damaged tensor)"),
      ("nan_logits_step_plain", ["--gguf", f["nan_embd_198"], "--draft", "none"], "logits: NaN or Inf at generated "
       "token 4 (decode step 4, position 6), so the request stops; "),
      ("nan_logits_step_mtp", ["--gguf", f["nan_embd_198"]], "logits: NaN or Inf at generated token "),
  ]
  cases = [dict(name=n, args=(PROMPT[2:] if n.startswith("prompt") else PROMPT) + a, expect=e) for n, a, e in c]
  for case in cases:
    if case["name"] == "gguf_unreadable":
      case["locked"] = locked
  # the orbax cache: an entry written, 100 bits of its largest data file flipped, read again
  cases += [dict(name="cache_write", args=PROMPT + ["--cache_dir", cache], expect=None),
            dict(name="cache_damaged", args=PROMPT + ["--cache_dir", cache], expect=None, flip=cache),
            dict(name="cache_rewritten", args=PROMPT + ["--cache_dir", cache], expect=None)]
  return cases


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp("cli"))
  cases = _cases(tmp)
  path = os.path.join(tmp, "cases.json")
  with open(path, "w") as f:
    json.dump(cases, f)
  r = subprocess.run([sys.executable, os.path.abspath(__file__), path], cwd=ROOT, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  res = json.loads(r.stdout.strip().splitlines()[-1])
  return {c["name"]: (c, res[c["name"]]) for c in cases}


FILE_AND_FLAG_CASES = ["nan_output_norm", "inf_router", "nan_eps", "rope_base_0", "overlap", "misaligned",
                       "head_count_kv_0", "expert_used_0", "expert_used_17", "temperature", "top_p_0", "top_p_big",
                       "max_new_tokens", "mtp_window", "mtp_draft", "max_new_tokens_huge", "expert_cache_1",
                       "kv_resident_7", "device_budget", "gguf_dir", "gguf_unreadable", "prompt_utf8",
                       "prompt_file_utf8", "cache_dir_file"]
LOGITS_CASES = ["nan_logits_prefill", "nan_logits_step_plain", "nan_logits_step_mtp"]


def _one_line_exit(walked, name):
  case, got = walked[name]
  assert got["code"] == 1, got
  assert "Traceback" not in got["err"], got["err"][-3000:]
  lines = [ln for ln in got["err"].splitlines() if ln.strip()]
  assert len(lines) == 1, got["err"][-3000:]            # one line, and nothing printed on stdout
  assert got["out"] == "", got["out"][-2000:]
  assert lines[0].startswith("error: " + case["expect"]), lines[0]
  return lines[0]


@pytest.mark.parametrize("name", FILE_AND_FLAG_CASES)
def test_cli_case_is_one_line(walked, name):
  _one_line_exit(walked, name)


@pytest.mark.parametrize("name", LOGITS_CASES)
def test_non_finite_logits_stop_the_request_in_one_line(walked, name):
  line = _one_line_exit(walked, name)
  if name == "nan_logits_step_mtp":                   # a verify pass may see the NaN row's effect earlier (MoE rows)
    step = int(line.split("generated token ")[1].split()[0])
    assert 1 <= step <= 4, line


def test_damaged_cache_entry_is_reported_and_reloaded_with_the_same_tokens(walked):
  outs = {}
  for name in ("cache_write", "cache_damaged", "cache_rewritten"):
    case, got = walked[name]
    assert got["code"] == 0 and "Traceback" not in got["err"], got["err"][-3000:]
    outs[name] = json.loads(got["out"].strip().splitlines()[-1])
    assert outs[name]["ids"] == WANT_IDS
  assert [outs[n]["stats"]["from_cache"] for n in outs] == [False, False, True]
  warn = walked["cache_damaged"][1]["warnings"]
  # flipped bits land in array data (the CRC-32 finds them) or in the data file's own index (orbax cannot read it)
  assert len(warn) == 1 and ("(damaged data); loading " in warn[0] or ": orbax cannot read its arrays (" in warn[0]), warn
  assert warn[0].endswith("from the GGUF again (the entry is rewritten)"), warn
  assert walked["cache_write"][1]["warnings"] == [] and walked["cache_rewritten"][1]["warnings"] == []


# -- whole processes -------------------------------------------------------------------------------------------------

def _proc(*args, **kw):
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, timeout=300, **kw)


def test_invalid_utf8_argv_bytes_are_one_line():
  r = _proc("-m", "decode.generate", "--prompt", b"Hi\xff", "--max_new_tokens", "2")
  err = r.stderr.decode()
  assert r.returncode == 1 and "Traceback" not in err, err[-3000:]
  assert err.strip().splitlines()[-1] == "error: --prompt: not valid UTF-8 (byte 0xff at byte offset 2)"


def test_a_bug_keeps_its_traceback_and_an_expected_failure_is_one_line():
  script = ("import sys\nfrom decode import cli\n"
            "def main(argv):\n  if argv[1:] == ['bug']:\n    raise RuntimeError('a bug')\n"
            "  raise FileNotFoundError(2, 'No such file or directory', 'x.gguf')\n"
            "cli.run(main)\n")
  bug = _proc("-c", script, "bug", text=True)
  assert bug.returncode == 1 and "Traceback (most recent call last)" in bug.stderr
  assert bug.stderr.strip().splitlines()[-1] == "RuntimeError: a bug"
  exp = _proc("-c", script, text=True)
  assert exp.returncode == 1 and exp.stderr == "error: [Errno 2] No such file or directory: 'x.gguf'\n", exp.stderr


@pytest.mark.parametrize("argv,expect", [
    (["-m", "bench.cells", "--arms", "bogus"], "error: --arms 'bogus': known sets are seed4, seed4k (or give "
     "--rings/--drafts/--kv/--depths)"),
    (["-m", "bench.step", "--glue", "bogus", "--preset", "tiny-qwen3moe"], "error: --glue 'bogus': "),
    (["-m", "bench.cells", "--glue", "on/x8=ptx"], "error: --glue 'on/x8=ptx': override 'x8=ptx', expected on, off"),
    (["-m", "bench.attention", "--variants", "nope"], "error: --variants: 'nope', expected dots:bk:warps:stages"),
    (["-m", "bench.kernels", "--sweep", "notjson", "--interpret"], "error: --sweep: Expecting value: "),
])
def test_other_clis_report_in_one_line(argv, expect):
  r = _proc(*argv, text=True)
  lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
  errors = [ln for ln in lines if "error" in ln.lower()]        # beside absl's info lines (bench.attention's device)
  assert errors == [lines[-1]] and lines[-1].startswith(expect), r.stderr[-3000:]


def test_synth_reports_its_own_failures_in_one_line_and_a_bug_with_its_traceback(tmp_path):
  """configs.synth keeps its own catch (configs/ does not import decode/), narrowed to its errors and OSError."""
  r = _proc("-m", "configs.synth", "--preset", "tiny-qwen3moe", "--experts", "Q9_9", "--out", str(tmp_path / "x"),
            text=True)
  assert r.returncode == 1 and r.stderr.startswith("error: synth: type 'Q9_9' is not one of "), r.stderr[-2000:]
  assert len(r.stderr.splitlines()) == 1
  script = ("from absl import app\nimport configs.synth as s\n"
            "def write(*a, **k):\n  raise ValueError('a bug')\n"
            "s.write = write\napp.run(s.main)\n")
  bug = _proc("-c", script, "--out", str(tmp_path / "y"), text=True)
  assert bug.returncode == 1 and "Traceback (most recent call last)" in bug.stderr, bug.stderr[-2000:]
  assert bug.stderr.strip().splitlines()[-1] == "ValueError: a bug"


# -- the driver (the child process of `walked`) -----------------------------------------------------------------------

def _flip_bits(cache: str) -> None:
  import glob
  big = max(glob.glob(os.path.join(cache, "*", "params", "**", "d", "*"), recursive=True), key=os.path.getsize)
  blob = bytearray(open(big, "rb").read())
  for i in np.random.default_rng(0).choice(len(blob) * 8, 100, replace=False):
    blob[i // 8] ^= 1 << (i % 8)
  with open(big, "wb") as f:
    f.write(blob)


def _walk(cases: list[dict]) -> dict:
  import builtins

  from absl import flags

  import decode.generate as generate
  try:
    from decode.cli import guarded
    main = guarded(generate.main)
  except ImportError:                                 # a checkout before decode.cli: generate's own main
    main = generate.main
  real_open = builtins.open
  warnings: list[str] = []

  class Keep(logging.Handler):
    def emit(self, record):
      if record.levelno >= logging.WARNING:
        warnings.append(record.getMessage())
  logging.getLogger("absl").addHandler(Keep())
  res = {}
  for case in cases:
    if case.get("flip"):
      _flip_bits(case["flip"])
    locked = case.get("locked")

    def guarded_open(file, *a, **k):
      if locked is not None and str(file) == locked:
        raise PermissionError(13, "Permission denied", locked)
      return real_open(file, *a, **k)
    builtins.open = guarded_open
    warnings.clear()
    out, err, code = io.StringIO(), io.StringIO(), 0
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["generate", *case["args"]])
    try:
      with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        main(["generate"])
    except SystemExit as e:
      code = e.code
    except BaseException:                             # an unexpected exception: its traceback, for the test to show
      import traceback
      err.write(traceback.format_exc())
      code = "traceback"
    finally:
      builtins.open = real_open
    res[case["name"]] = {"code": code, "out": out.getvalue(), "err": err.getvalue(), "warnings": list(warnings)}
  return res


if __name__ == "__main__":
  with open(sys.argv[1]) as f:
    result = _walk(json.load(f))
  print(json.dumps(result))
