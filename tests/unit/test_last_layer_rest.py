"""LastLayerRest: the drafter's last steps for a head pass's rows, the same values as DFlashDrafter.finish."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from specops.score import drafter_ops  # noqa: E402
from specops.score.drafter import load_drafter  # noqa: E402
from specops.score.last_layer_rest import LastLayerRest  # noqa: E402
from specops.score.target_head import load_target_head  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trunk_outputs(fixture_models, dtype=torch.float32):
    drafter = load_drafter(fixture_models.drafter).to(dtype)
    head = load_target_head(fixture_models.target, dtype=dtype)
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(3, 40, 3, drafter.hidden_size, generator=generator).to(dtype)
    ids = torch.randint(0, head.vocab_size, (3, 40), generator=generator)
    starts = torch.tensor([[3], [17], [30]])
    with torch.inference_mode():
        embeds = drafter.block_embeddings(head.embed, ids.gather(1, starts))
        residual, mixed = drafter.trunk(embeds, starts, drafter.context_kv(features))
    return drafter, residual.flatten(0, 1)[:, 1:], mixed.flatten(0, 1)[:, 1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rows_of_a_pass_get_finish_s_states_exactly(fixture_models, dtype):
    drafter, residual, mixed = trunk_outputs(fixture_models, dtype)
    rows = torch.tensor([2, 0])
    with torch.inference_mode():
        rest = LastLayerRest(drafter)
        assert rest.weights is not None  # the fast path, not a hand-over
        got = rest(residual[:, 4:7].index_select(0, rows), mixed[:, 4:7].index_select(0, rows))
        expected = drafter.finish(residual[rows, 4:7], mixed[rows, 4:7])
    assert got.shape == expected.shape == (2, 3, drafter.hidden_size)
    assert torch.equal(got, expected)


def test_it_hands_over_to_finish_where_its_fast_path_does_not_apply(fixture_models, monkeypatch):
    drafter, residual, mixed = trunk_outputs(fixture_models)
    with torch.inference_mode():
        expected = drafter.finish(residual[:, :3], mixed[:, :3])
        # Sums apart from the products: the modules' own steps run.
        monkeypatch.setattr(drafter_ops, "SUM_IN_PRODUCT", False)
        apart = LastLayerRest(drafter)
        assert apart.weights is None
        torch.testing.assert_close(apart(residual[:, :3].clone(), mixed[:, :3]), expected)
        monkeypatch.setattr(drafter_ops, "SUM_IN_PRODUCT", True)
    # Gate and up no longer fused (an assignment broke the views): the separate products run.
    mlp = drafter.layers[-1].mlp
    mlp.gate_proj.weight = torch.nn.Parameter(mlp.gate_proj.weight.detach().clone())
    with torch.inference_mode():
        unfused = LastLayerRest(drafter)
        assert unfused.weights is None
        torch.testing.assert_close(unfused(residual[:, :3].clone(), mixed[:, :3]), expected)
    # Built where gradients are wanted: the modules' path, with a graph to differentiate.
    rest = LastLayerRest(drafter)
    assert rest.weights is None
    states = rest(residual[:, :3].clone().requires_grad_(True), mixed[:, :3].clone())
    assert states.requires_grad
