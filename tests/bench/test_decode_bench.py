"""`python -m bench.cells` end to end on the default model (CPU): the JSONL records, the expert-cache arms sized
by slots, replay's acceptance (its drafts are the plain greedy tokens, so anything below 100 % is a defect), the
bytes-per-round model beside the measured speed-up, and the table."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_cells_table_and_records(tmp_path):
  cells = tmp_path / "cells.jsonl"
  r = subprocess.run(
      [sys.executable, "-m", "bench.cells", "--rings", "2048", "--drafts", "none,replay@2", "--expert_cache", "all,6",
       "--depths", "48", "--max_new_tokens", "12", "--seeds", "1", "--max_context", "4096", "--cells", str(cells)],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  recs = [json.loads(line) for line in cells.read_text().splitlines()]
  assert sorted(x["arm"] for x in recs) == sorted(["R2048-none-int8-D48", "R2048-none-int8-D48-X6",
                                                   "R2048-replay@2-int8-D48", "R2048-replay@2-int8-D48-X6"])
  for x in recs:
    st = x["stats"]
    assert st["generated_tokens"] == 12 and st["decode_tok_s"] > 0 and st["plan"]["items"]
    assert x["config"]["glue"] == "on"               # --glue's default, recorded
    cached = x["arm"].endswith("-X6")
    assert st["expert_slots"] == (6 if cached else None)
    if cached:   # 6 slots for 16 experts per block: some misses, counted per block
      assert sum(st["expert_cache"]["misses"]) > 0 and st["expert_cache"]["slots"] == 6
    log = open(x["log"]).read()      # the cell's own log: its request, plan table and result, as recorded
    assert x["log"] == str(tmp_path / "cells.logs" / f"{x['arm'].replace('@', '-k')}-s0.log")
    assert f"cell {x['arm']} seed 0: 48 prompt tokens" in log and "memory plan:" in log
    assert f"{st['generated_tokens']} tokens at {st['decode_tok_s']:.2f} tok/s decode" in log
    assert ("first (compiling) run" in log) and (("drafts accepted/proposed" in log) == ("replay" in x["arm"]))
    if "replay" in x["arm"]:
      assert st["acceptance"] == 1.0
      assert st["plain"]["decode_tok_s"] > 0 and st["prefill_tok_s"] > 0    # the plain request it replays
      bm = st["bytes_model"]
      assert bm["draft_bytes"] == 0 and 1.0 < bm["round_over_step"] < 3.0     # union of 3 tokens' experts
  out = r.stdout
  assert "| vs plain (bytes model) |" in out and "x (model " in out and "6 slots" in out


def test_compile_run_leaves_the_timed_runs_nothing_to_compile():
  """The bench's untimed first run of an arm generates bench.COMPILE_TOKENS tokens but compiles every function its
  timed runs call (buffers and ring sized for their max_new_tokens, the same prefill chunk), so a timed run adds
  no entry to the decode loop's compile cache; a run sized for fewer tokens does."""
  from bench import cells as bench
  from decode import engine
  from configs.default import default_model_path
  from model.loader import load_model
  bench.FLAGS(["bench", "--max_new_tokens", "20", "--max_context", "4096"])
  try:
    model = load_model(default_model_path())
    arm = bench.Arm("R2048-none", ring="2048", depth=40)
    first = bench.compile_run(model, arm)                                        # bench.main's compile run
    assert first["generated_tokens"] == bench.COMPILE_TOKENS < 20                # a few tokens, 20-token buffers
    before = engine.decode_loop._cache_size()
    st = bench.run_cell(model, arm, seed=0, max_new=bench.FLAGS.max_new_tokens)
    assert st["generated_tokens"] == 20
    assert engine.decode_loop._cache_size() == before
    shorter = bench.run_cell(model, arm, seed=0, max_new=16)                      # the old compile run's size
    assert shorter["generated_tokens"] == 16 and engine.decode_loop._cache_size() == before + 1
    from decode import speculative        # a replay arm: its plain request and its speculative loop
    drafted = bench.Arm("R2048-replay", ring="2048", depth=40, draft="replay", k=3)
    bench.compile_run(model, drafted)
    loops = (engine.decode_loop._cache_size(), speculative.spec_loop._cache_size())
    st = bench.run_cell(model, drafted, seed=0, max_new=bench.FLAGS.max_new_tokens)
    assert st["generated_tokens"] == 20 and st["acceptance"] == 1.0
    assert (engine.decode_loop._cache_size(), speculative.spec_loop._cache_size()) == loops
  finally:
    bench.FLAGS.unparse_flags()


def test_compiling_runs_in_threads_leave_the_timed_runs_nothing_to_compile(monkeypatch):
  """--compile_jobs 2: the replay arm's compiling run first, alone, then the others in two threads at once, which
  take its prefill of seed 0's prompt (one prefill for four requests); together they compile every program the
  timed runs call, a new prompt's prefill included (no compile-cache entry added after them: the NextN arm's
  prefill is the others' program, its drafter ring held out), and the timed runs' tokens are the plain greedy ones
  (replay accepts every draft); an arm whose request is refused comes back as its error, the others still
  compiled."""
  from bench import cells as bench
  from decode import engine, speculative
  from configs.default import default_model_path
  from model import api
  from model.loader import load_model
  bench.FLAGS(["bench", "--max_new_tokens", "12", "--max_context", "4096"])
  real, prefills = engine.prefill_chunked, []
  monkeypatch.setattr(engine, "prefill_chunked", lambda *a, **kw: prefills.append(len(a[1])) or real(*a, **kw))
  try:
    model = load_model(default_model_path())
    assert model.cfg.n_nextn
    arms = [bench.Arm("P", ring="2048", depth=40), bench.Arm("S", ring="2048", depth=40, draft="mtp", k=2),
            bench.Arm("R", ring="2048", depth=40, draft="replay", k=2),
            bench.Arm("X", ring="16", depth=40)]                       # 16 slots for a 40-token prompt: refused
    got = bench.compile_all(model, arms, jobs=2)
    assert list(got) == ["P", "S", "R", "X"]
    assert got["P"] > 0 and got["R"] > 0 and got["S"] > 0
    assert isinstance(got["X"], Exception) and "kv_resident" in str(got["X"])
    assert prefills == [40], prefills              # the replay arm's plain request; the other three took it
    progs = lambda: (engine.decode_loop._cache_size(), speculative.spec_loop._cache_size(),  # noqa: E731
                     api.prefill._cache_size(), api.mtp_step._cache_size())
    loops = progs()
    plain = bench.run_cell(model, arms[0], seed=1, max_new=12)           # seed 1: a new prompt, prefilled
    drafted = bench.run_cell(model, arms[2], seed=1, max_new=12)
    nextn = bench.run_cell(model, arms[1], seed=1, max_new=12)
    assert progs() == loops and len(prefills) == 5              # no cache here: the replay arm prefills twice
    assert drafted["tokens"] == plain["tokens"] == nextn["tokens"] and drafted["acceptance"] == 1.0
  finally:
    bench.FLAGS.unparse_flags()


def test_profile_traces_a_request_that_reuses_its_prefill(tmp_path):
  """bench.profile_arm: the traced request reuses the prefill of an untraced one just before (so the perfetto trace
  holds the decode), compiles nothing the timed runs did not, and emits the plain greedy tokens (replay accepts
  every draft)."""
  import glob

  from bench import cells as bench
  from decode import engine, speculative
  from configs.default import default_model_path
  from model.loader import load_model
  bench.FLAGS(["bench", "--max_new_tokens", "12", "--max_context", "4096"])
  try:
    model = load_model(default_model_path())
    arm = bench.Arm("R", ring="2048", depth=40, draft="replay", k=2)
    bench.compile_run(model, arm)
    timed = bench.run_cell(model, arm, seed=0, max_new=12)
    loops = (engine.decode_loop._cache_size(), speculative.spec_loop._cache_size())
    st = bench.profile_arm(model, arm, str(tmp_path / "R"))
    assert st["prefill_reused"] and st["acceptance"] == 1.0
    assert st["tokens"] == timed["tokens"][:len(st["tokens"])] and len(st["tokens"]) == 12
    assert (engine.decode_loop._cache_size(), speculative.spec_loop._cache_size()) == loops
    assert glob.glob(str(tmp_path / "R" / "**" / "perfetto_trace.json.gz"), recursive=True)
  finally:
    bench.FLAGS.unparse_flags()


def test_only_runs_a_subset_of_a_named_set():
  """--only splits seed4 over processes: the named arms, in set order; an unknown name is a one-line error."""
  import pytest
  from absl import app
  from bench import cells as bench
  try:
    bench.FLAGS(["bench", "--arms", "seed4", "--only", "BR,AR"])
    arms, _ = bench._arms()
    assert [a.name for a in arms] == ["AR", "BR"] and [a.ring for a in arms] == ["32768", "49152"]
    bench.FLAGS.unparse_flags()
    bench.FLAGS(["bench", "--arms", "seed4", "--only", "AR,ZZ"])
    with pytest.raises(app.UsageError, match="--only ZZ: not arms of seed4"):
      bench._arms()
  finally:
    bench.FLAGS.unparse_flags()


def test_text_prompts_have_the_cell_depth_or_are_refused():
  """--prompt_source text gives exactly `depth` tokens (deep cells draw on all documentation topics), and a depth
  beyond the text is refused with a message naming it, never cut short."""
  import pytest

  from bench import cells as bench
  from configs.default import default_model_path
  from model.loader import load_model
  m = load_model(default_model_path())
  for n in (1024, 40000):
    ids = bench._text_tokens(m, n, seed=2)
    assert len(ids) == n and all(0 <= t < m.cfg.vocab_size for t in ids)
  assert bench._text_tokens(m, 1024, seed=2) != bench._text_tokens(m, 1024, seed=3)
  with pytest.raises(ValueError, match="depth 1000000 exceeds"):
    bench._text_tokens(m, 1_000_000, seed=0)


def test_seed4_speed_bars_hold_at_1k_and_deep_cells_report_the_ratio():
  """Pre-declared bars: decode tok/s within 3 % across rings at 1K (a 4 % gap FAILs); at a deeper cell the ratio is
  reported without a bar (the rings differ there by design); acceptance must be identical at any depth."""
  from bench import cells as bench
  rec = lambda arm, tps, acc: {"arm": arm, "stats": {"decode_tok_s": tps, "drafts_accepted": acc}}  # noqa: E731
  records = [rec("AS", 100.0, [3, 2]), rec("BS", 104.0, [3, 2]), rec("AN", 50.0, [1, 0]), rec("BN", 50.0, [1, 1])]
  shallow = bench._verdicts(records, bench.SEED4_BARS)
  assert "|BS-AS|/AS = 4.0% (bar < 3%): FAIL" in shallow
  assert "|BN-AN|/AN = 0.0% (bar < 3%): PASS" in shallow
  assert any(v.startswith("drafts accepted AN") and v.endswith("FAIL") for v in shallow)
  # over several seeds, a gap inside an arm's own spread is no measured difference: INCONCLUSIVE, not FAIL
  noisy = [rec("AR", v, [1]) for v in (396.0, 401.5, 398.2)] + [rec("BR", v, [1]) for v in (388.1, 374.2, 364.4)]
  assert ("|BR-AR|/AR = 6.0% (bar < 3%; seeds' spread AR 1.4%, BR 6.3%): INCONCLUSIVE (inside the seeds' spread)"
          in bench._verdicts(noisy, bench.SEED4_BARS))
  steady = [rec("AR", v, [1]) for v in (396.0, 397.0, 398.0)] + [rec("BR", v, [1]) for v in (370.0, 371.0, 372.0)]
  assert ("|BR-AR|/AR = 6.5% (bar < 3%; seeds' spread AR 0.5%, BR 0.5%): FAIL"
          in bench._verdicts(steady, bench.SEED4_BARS))
  deep = bench._verdicts(records, [(a, b, None if w == "decode tok/s" else t, w) for a, b, t, w in bench.SEED4_BARS])
  assert "BS/AS decode tok/s = 1.040 (deep cell: reported, no bar)" in deep
  assert any(v.startswith("drafts accepted AS") and v.endswith("PASS") for v in deep)


def test_arms_compare_their_generated_tokens_seed_by_seed():
  """Each record keeps its generated tokens; the verdicts say, per seed, whether a ring pair generated the same
  ones or where they first differ (deeper than the smaller ring, the tier's merge may flip a near-tie)."""
  from bench import cells as bench
  rec = lambda arm, seed, toks: {"arm": arm, "seed": seed, "stats": {"decode_tok_s": 1.0, "drafts_accepted": [0],  # noqa: E731
                                                                    "tokens": toks}}
  records = [rec("AN", 0, [5, 6, 7]), rec("AN", 1, [1, 2, 3]), rec("BN", 0, [5, 6, 7]), rec("BN", 1, [1, 9, 3])]
  got = bench._verdicts(records, [("AN", "BN", 0.0, "drafts accepted")])
  assert got[-1] == ("generated tokens AN vs BN (reported: beyond the smaller ring's window): seed 0 identical, "
                     "seed 1 differ from token 1 of 3"), got
  # where both rings hold the request (invariant 1) it is a bar
  for r in records:
    r["config"] = {"depth": 1024, "max_new_tokens": 3, "ring": "32768" if r["arm"] == "AN" else "49152"}
  got = bench._verdicts(records, [("AN", "BN", 0.0, "drafts accepted")])
  assert got[-1].startswith("generated tokens AN vs BN (bar: identical, both rings hold the request)")
  assert got[-1].endswith(": FAIL")
  records[-1]["stats"]["tokens"] = [1, 2, 3]
  assert bench._verdicts(records, [("AN", "BN", 0.0, "drafts accepted")])[-1].endswith("seed 1 identical: PASS")


def test_acceptance_bar_pairs_seeds_and_names_the_unpaired():
  """A call cut short leaves one arm with fewer seeds: the acceptance bar compares the seeds both arms ran and names
  the others (a missing seed is no difference); a paired seed that differs FAILs."""
  from bench import cells as bench
  rec = lambda arm, seed, acc: {"arm": arm, "seed": seed, "stats": {"decode_tok_s": 1.0, "drafts_accepted": acc}}  # noqa: E731
  bar = [("AR", "BR", 0.0, "drafts accepted")]
  records = [rec("AR", 0, [64, 64]), rec("BR", 0, [64, 64]), rec("BR", 1, [64, 64])]
  assert bench._verdicts(records, bar)[0] == ("drafts accepted AR [[64, 64]] vs BR [[64, 64]] (bar: identical; "
                                              "unpaired, not compared: BR seed 1): PASS")
  records.append(rec("AR", 1, [64, 63]))
  assert bench._verdicts(records, bar)[0] == ("drafts accepted AR [[64, 64], [64, 63]] vs BR [[64, 64], [64, 64]] "
                                              "(bar: identical): FAIL")
  assert bench._verdicts([rec("AR", 2, [1]), rec("BR", 0, [1])], bar)[0] == (
      "drafts accepted AR vs BR (bar: identical): no seed run by both (AR seed 2, BR seed 0)")


def test_reuse_prefill_shares_one_prefill_per_prompt_and_k(tmp_path):
  """--reuse_prefill: seeds run outermost, each arm's compiling run takes seed 0's prompt, and arms with the same
  ring and k share a prefill (NextN and lookup at k = 3): only the first arm's seed-1 run prefills by itself."""
  cells = tmp_path / "cells.jsonl"
  r = subprocess.run(
      [sys.executable, "-m", "bench.cells", "--rings", "2048", "--drafts", "mtp,lookup", "--depths", "48",
       "--max_new_tokens", "8", "--seeds", "2", "--reuse_prefill", "--cells", str(cells)],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  recs = [json.loads(line) for line in cells.read_text().splitlines()]
  got = [(x["arm"].split("-")[1], x["seed"], x["stats"]["prefill_reused"]) for x in recs]
  assert got == [("mtp", 0, True), ("lookup", 0, True), ("mtp", 1, False), ("lookup", 1, True)], got
  assert all(x["config"]["reuse_prefill"] and x["stats"]["ttft_s"] > 0 for x in recs)
  # a reused prefill's TTFT is another run's: such a run reports no prefill speed, and the table says so
  assert [x["stats"]["prefill_tok_s"] is None for x in recs] == [True, True, False, True]
  assert all(len(x["stats"]["tokens"]) == 8 for x in recs) and "| reused |" in r.stdout
  # --first_seed: a cell's seeds split over calls; the compiling run then prefills the first seed's prompt, and the
  # tokens are that seed's in the first call's records
  later = tmp_path / "later.jsonl"
  r = subprocess.run(
      [sys.executable, "-m", "bench.cells", "--rings", "2048", "--drafts", "lookup", "--depths", "48",
       "--max_new_tokens", "8", "--seeds", "1", "--first_seed", "1", "--reuse_prefill", "--cells", str(later)],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  (one,) = [json.loads(line) for line in later.read_text().splitlines()]
  assert one["seed"] == 1 and one["stats"]["prefill_reused"]
  assert one["stats"]["tokens"] == recs[3]["stats"]["tokens"]


def test_random_params_are_the_loaded_files_params_on_any_thread_count(tmp_path):
  """bench's in-memory models (model.writer.random_params): the tensors, types, shapes and layout that write_gguf
  + load_model give for the same shape and type policy, and the same values whatever the number of threads
  that build them."""
  import jax
  import numpy as np

  from configs.presets import TINY_QWEN3MOE
  from configs.vocab import load_vocab
  from model.api import fuse_qkv
  from model.loader import load_model
  from model.writer import quant_policy, random_params, write_gguf
  from ops.qtensor import QTensor

  types = quant_policy("IQ3_S", "Q8_0")
  one, three = (random_params(TINY_QWEN3MOE, types=types, seed=5, workers=w) for w in (1, 3))
  leaf = lambda t: isinstance(t, QTensor)  # noqa: E731
  assert jax.tree.structure(one, is_leaf=leaf) == jax.tree.structure(three, is_leaf=leaf)
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(three)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  loaded = load_model(write_gguf(tmp_path / "r.gguf", TINY_QWEN3MOE, load_vocab(1024), types=types, seed=5)).params
  shapes = lambda p: jax.tree.map(lambda t: (t.qtype, t.shape, tuple(x.shape for x in t.planes)) if leaf(t)  # noqa: E731
                                  else (str(t.dtype), t.shape), p, is_leaf=leaf)
  assert shapes(fuse_qkv(one)) == shapes(loaded)
  assert not np.array_equal(np.asarray(jax.tree.leaves(one)[0]),
                            np.asarray(jax.tree.leaves(random_params(TINY_QWEN3MOE, types=types, seed=6))[0]))


def test_report_joins_records_of_separate_runs(tmp_path):
  """--report: the seed4 arms of one depth, measured one ring per process, make one table and one set of verdicts;
  records of other depths are left out, and a later record of the same arm and seed replaces an earlier one."""
  from bench import cells as bench
  def rec(arm, ring, seed, tps, acc, toks, depth=32768):
    return {"arm": arm, "seed": seed, "commit": "abc", "device": "gpu",
            "config": {"depth": depth, "max_new_tokens": 3, "ring": ring, "draft": "lookup"},
            "stats": {"decode_tok_s": tps, "prefill_tok_s": None, "drafts_accepted": acc, "drafts_proposed": [4],
                      "tokens": toks, "rounds": 4, "mean_accepted_len": 0.0,
                      "bytes_model": {"step_bytes": 1.0, "round_bytes": 1.5}}}
  a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
  a.write_text("\n".join(json.dumps(r) for r in [rec("AN", "32768", 0, 50.0, [0], [1, 2, 3]),
                                                 rec("AN", "32768", 0, 60.0, [1], [1, 2, 3], depth=1024)]) + "\n")
  b.write_text("\n".join(json.dumps(r) for r in [rec("BN", "49152", 0, 10.0, [0], [1, 2, 4]),
                                                 rec("BN", "49152", 0, 100.0, [0], [1, 2, 3])]) + "\n")
  try:
    bench.FLAGS(["bench", "--arms", "seed4", "--only", "AN,BN", "--depths", "32768"])
    out = bench.report([str(a), str(b)])
    assert out.startswith("2 records from 2 files; commit/device: abc on gpu"), out
    assert "BN/AN decode tok/s = 2.000 (deep cell: reported, no bar)" in out      # 100 replaced 10; 60 is at 1K
    assert "drafts accepted AN [[0]] vs BN [[0]] (bar: identical): PASS" in out
    assert "generated tokens AN vs BN (reported: beyond the smaller ring's window): seed 0 identical" in out
    bench.FLAGS.unparse_flags()
    bench.FLAGS(["bench", "--arms", "seed4", "--only", "AS,BS", "--depths", "32768"])
    with pytest.raises(ValueError, match="no record of the arms"):
      bench.report([str(a)])
  finally:
    bench.FLAGS.unparse_flags()
  for bad, why in ((tmp_path / "missing.jsonl", "No such file"), (tmp_path / "broken.jsonl", "broken.jsonl:1: not a JSON")):
    if "broken" in bad.name:
      bad.write_text("{not json\n")
    r = subprocess.run([sys.executable, "-m", "bench.cells", "--arms", "seed4", "--depths", "32768", "--report",
                        str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and why in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_replay_without_a_plain_arm_compares_with_its_own_plain_requests():
  """A replay run makes the plain request it drafts from: where no plain arm ran (seed4's AR/BR), the speed-up is
  measured against those requests, and a replay run whose drafted request reused the plain one's prefill reports
  the plain one's prefill speed."""
  from bench import cells as bench
  arms = [bench.Arm("AR", "32768", "replay", "int8", 1024, 3, "all")]
  st = lambda tps, plain: {"decode_tok_s": tps, "plain": {"decode_tok_s": plain}, "rounds": 4,  # noqa: E731
                           "drafts_proposed": [4, 4, 4], "mean_accepted_len": 3.0,
                           "bytes_model": {"step_bytes": 1.0, "round_bytes": 1.5}}
  recs = [{"arm": "AR", "seed": s, "stats": st(t, p)} for s, (t, p) in enumerate([(300.0, 100.0), (330.0, 110.0),
                                                                                    (280.0, 120.0)])]
  assert bench._speedups(recs, arms, arms[0]) == "2.73x (its plain requests) (model 2.67x)"   # 300 / 110


def test_bench_step_cells_pass_their_choices_as_options():
  """`bench.step --glue` and a cell's attention field become model Options (no module global is set); a cell's
  StepTimer runs repeat plain greedy steps from the cell's state whatever runs between them (--interleave); the
  overrides land in the Tunings the kernels take, retired and malformed values are one-line usage errors, and a
  decode step of a tiny model run under a variant's Options (glue kernels and the decode attention kernel in
  interpret mode, tuned) gives the logits of the plain XLA path. (Its own process: bench.step and bench.cells
  define the same absl flags.)"""
  code = """
import jax, jax.numpy as jnp, numpy as np
from absl import app
from bench import glue, step
from configs.presets import preset
from model import api
from model.api import fuse_qkv
from model.kv_ring import KVRing
from model.writer import quant_policy, random_params
from ops import attention_pallas, qmatmul_pallas
from ops.qtensor import with_kernels
from ops.tuning import FUSIONS
on, t = glue.glue_options("on/rope=1/router=64:2048:8:1/xnat=Q4_K:4")
assert on and t.rope_write.q_programs == 1 and t.router.programs == 64 and t.router.route_warps == 1
assert t.pick("qmatmul", "Q4_K").natural_b == 4 and t.pick("qmatmul", "Q8_0").natural_b == 0
assert t.pick("moe", "Q4_K").down.natural_b == 4 and t.pick("moe", "IQ3_S").gateup.natural_b == 0
t = glue.glue_options("on/xnat=Q4_K:4/qmm=256")[1]
assert t.pick("qmatmul", "Q8_0").programs == 256 and t.pick("qmatmul", "Q4_K").natural_b == 4
t = glue.glue_options("on/xnat=Q4_K:4/x8=dp4a")[1]
assert t.pick("moe", "Q4_K").gateup.x8 == "dp4a" and t.pick("moe", "Q4_K").gateup.natural_b == 4
assert t.pick("moe", "Q4_K").down == qmatmul_pallas.Tuning(natural_b=4) and t.pick("qmatmul", "Q8_0").x8 is None
assert t.pick("moe", "IQ3_S").gateup.x8 == "dp4a" and t.pick("moe", "Q6_K").gateup.x8 is None
t = glue.glue_options("on/x8=dp4a/dx8=int")[1].pick("moe", "IQ3_S")
assert t.gateup == qmatmul_pallas.Tuning(BN=32, programs=0, x8="dp4a") and t.down == qmatmul_pallas.Tuning(x8="int")
t = glue.glue_options("on/px8=int")[1]
assert t.pick("qmatmul", "Q8_0").x8 == "int" and t.pick("qmatmul", "Q6_K").x8 is None and t.moe is None
assert glue.glue_options("on/tier=16384")[1].tier_block == 16384 and glue.glue_options("on")[1].tier_block is None
assert glue.glue_options("on/tier=4096/span=4096")[1].tier_span == 4096
assert glue.glue_options("on/fuse=residual+topk")[1].fuse == ("residual", "topk")
assert glue.glue_options("on")[1].fuse == FUSIONS and glue.glue_options("on/fuse=none")[1].fuse == ()
assert glue.glue_options("on/norm=8")[1].rmsnorm.num_warps == 8
o = step.cell_options("on", "bf16x2/16/4/1")
assert o.tunings.attention_impl == "pallas"
assert o.tunings.attention == attention_pallas.Tuning(bk=16, num_warps=4, num_stages=1, dots="bf16x2")
assert step.cell_options("on", "auto", "tf32x3").tunings.attention == attention_pallas.Tuning(dots="tf32x3")
assert step.cell_options("off", "ref").glue is False and hash(o) == hash(step.cell_options("on", "bf16x2/16/4/1"))
for bad in ("old", "on/gatherq=0", "on/ksum=1", "on/grid16=1", "off/rope=1", "on/xnat=Q9_9:4", "on/qmm=-1",
            "on/tier=3000", "on/tier=0", "on/span=100", "on/x8=ptx", "on/dx8=1", "on/fuse=norm", "on/norm=0"):
  try:
    glue.glue_options(bad); raise SystemExit(bad + " accepted")
  except app.UsageError as e:
    assert "expected on, off" in str(e), e
cfg = preset("tiny-qwen3moe")
params = fuse_qkv(random_params(cfg, types=quant_policy("Q4_K", "Q8_0")))
ring = lambda: step.fill_ring(KVRing.create(cfg.n_layers, 256, cfg.n_kv_heads, cfg.head_dim, "int8", block=32), 40)
opts = step.cell_options("on/rope=1/xnat=Q4_K:4+Q8_0:4/qmm=64/fuse=residual+router+topk", "bf16x2/16/4/1")
opts = opts.replace(tunings=opts.tunings.replace(attention_impl="interpret"))
run = lambda p, o: np.asarray(api.decode_step(p, jnp.int32(7), api.ModelState(ring()), cfg=cfg, options=o)[0])
got = run(with_kernels(params, "interpret"), opts)
with jax.default_matmul_precision("highest"):
  ref = run(with_kernels(params, "xla"), step.cell_options("off", "ref"))
assert got.argmax() == ref.argmax() and np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-4, np.linalg.norm(got - ref)
# StepTimer (--interleave: two cells' runs taking turns): every run starts from its cell's state rewound and emits
# the tokens of plain greedy steps from that state
xp, o = with_kernels(params, "xla"), step.cell_options("off", "ref")
st, tok, want = api.ModelState(ring()), jnp.int32(1), []
for _ in range(3):
  lg, _, st = api.decode_step(xp, tok, st, cfg=cfg, options=o)
  tok = jnp.argmax(lg).astype(jnp.int32)
  want.append(int(tok))
timers = [step.StepTimer(xp, cfg, ring(), 3, options=o) for _ in range(2)]
for _ in range(3):
  for t in timers:
    assert t.run() > 0 and [int(v) for v in np.asarray(t.ls.out)[1:4]] == want, (np.asarray(t.ls.out), want)
print("ok")
"""
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]
