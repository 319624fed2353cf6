"""The expected-speedup model: tau over the cost of a drafter step plus a verify step."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from specops import speedup as spd


def test_speedup_is_tau_over_the_cycle_cost_in_decode_steps():
    assert spd.expected_speedup(4.0, draft_cost=0.25, verify_cost=1.0) == pytest.approx(3.2)
    assert spd.expected_speedup(None, 0.1, 1.0) is None


def test_weight_bytes_read_the_headers_dtypes_and_shapes(tmp_path):
    save_file(
        {
            "lm_head.weight": torch.zeros(10, 4, dtype=torch.bfloat16),
            "layers.0.w": torch.zeros(3, 4, dtype=torch.float32),
        },
        str(tmp_path / "model.safetensors"),
    )
    assert spd.weight_bytes(tmp_path) == 10 * 4 * 2 + 3 * 4 * 4
    assert spd.weight_bytes(tmp_path, "lm_head.weight") == 80


def test_estimated_draft_cost_is_the_drafter_and_head_bytes_over_the_targets(tmp_path):
    target, drafter = tmp_path / "t", tmp_path / "d"
    target.mkdir(), drafter.mkdir()
    save_file(
        {
            "lm_head.weight": torch.zeros(100, dtype=torch.bfloat16),
            "body.weight": torch.zeros(900, dtype=torch.bfloat16),
        },
        str(target / "model.safetensors"),
    )
    save_file({"fc.weight": torch.zeros(50, dtype=torch.bfloat16)}, str(drafter / "model.safetensors"))
    assert spd.estimated_costs(target, drafter) == {"draft_cost": pytest.approx(0.15), "verify_cost": 1.0}


def test_the_model_states_its_assumptions_and_where_the_costs_came_from():
    estimated = spd.model_description("estimated")
    assert estimated["formula"] == "expected speedup = tau / (draft_cost + verify_cost)"
    assert any("memory-bound" in line for line in estimated["assumptions"])
    measured = spd.model_description("measured", {"draft_cost": 0.2, "verify_cost": 1.1})
    assert any("speedup_h200.py" in line for line in measured["assumptions"])
