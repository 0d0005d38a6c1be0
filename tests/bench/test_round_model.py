"""decode/round_model: the expected union of routed experts against a Monte Carlo count, and the byte groups
against the params' own sizes on the default model."""
import numpy as np
import pytest

from bench import round_model


@pytest.mark.parametrize("E,K,T", [(128, 8, 4), (512, 10, 4), (16, 2, 3), (8, 8, 2)])
def test_expected_distinct_matches_simulation(E, K, T):
  rng = np.random.default_rng(E * 100 + K * 10 + T)
  n = 20000
  got = np.mean([len(set(np.concatenate([rng.choice(E, K, replace=False) for _ in range(T)]))) for _ in range(n)])
  assert abs(round_model.expected_distinct(E, K, T) - got) < 0.05 * K


def test_bytes_model_on_default_model():
  from decode.kv_plan import param_bytes
  from configs.default import default_model_path
  from model.loader import load_model
  m = load_model(default_model_path())
  g = round_model.weight_groups(m.params, m.cfg)
  total, experts = param_bytes(m.params)
  n_moe = m.cfg.n_layers - m.cfg.n_dense_lead
  embed = g["embed_row"] * m.cfg.vocab_size
  nextn_exps = g["nextn_expert"] * m.cfg.n_experts
  # every byte is in exactly one group: main + embedding + NextN + experts (main and NextN) = all params
  assert g["main"] + embed + g["nextn"] + nextn_exps + g["expert_per_layer_sum"] * m.cfg.n_experts == total
  assert g["expert_per_layer_sum"] * m.cfg.n_experts + nextn_exps == experts
  assert g["head"] == m.params["output"].nbytes and n_moe > 0
  b = round_model.bytes_model(m.params, m.cfg, k=3, drafter="replay")
  assert b["draft_bytes"] == 0 and b["step_bytes"] < b["round_bytes"]
  # a verify round's experts are the union of 4 tokens' picks: between 1x and 4x one token's
  K = m.cfg.top_k
  assert K * g["expert_per_layer_sum"] < b["verify_bytes"] - g["main"] - 4 * g["embed_row"] < 4 * K * g["expert_per_layer_sum"]
  mtp = round_model.bytes_model(m.params, m.cfg, k=3, drafter="mtp")
  assert mtp["draft_bytes"] == pytest.approx(3 * (g["nextn"] + K * g["nextn_expert"] + g["head"] + g["embed_row"]))
  assert mtp["predicted_speedup"][4] == pytest.approx(4 * mtp["step_bytes"] / mtp["round_bytes"])
  # k = 6: the verify in passes of 4 and 3 tokens (decode.speculative.VERIFY_ROWS), each reading the weights
  six = round_model.bytes_model(m.params, m.cfg, k=6, drafter="replay")
  E, X = m.cfg.n_experts, g["expert_per_layer_sum"]
  want = sum(g["main"] + round_model.expected_distinct(E, K, n) * X + n * g["embed_row"] for n in (4, 3))
  assert six["verify_bytes"] == pytest.approx(want) and six["verify_bytes"] > 2 * g["main"]
