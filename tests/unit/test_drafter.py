"""The DFlash drafter and the target head: loading z-lab checkpoints, clear errors, the forward."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from specops.score.drafter import DrafterError, load_drafter, select_target_features  # noqa: E402
from specops.score.sequential_acceptance import SequentialDrafter  # noqa: E402
from specops.score.target_head import TargetHead, TargetHeadError, load_target_head  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models: extra threads only contend on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def copy_drafter(fixture_models, tmp_path, edit_config=None, edit_tensors=None):
    out = tmp_path / "drafter"
    shutil.copytree(fixture_models.drafter, out)
    if edit_config:
        config = json.loads((out / "config.json").read_text())
        edit_config(config)
        (out / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(str(out / "model.safetensors"))
        tensors = edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out


# ---- loading ------------------------------------------------------------------------------------


def test_loads_block_size_from_the_top_level(fixture_models):
    drafter = load_drafter(fixture_models.drafter)
    config = json.loads((fixture_models.drafter / "config.json").read_text())
    assert "block_size" in config
    assert drafter.block_size == config["block_size"]
    assert drafter.mask_token_id == config["dflash_config"]["mask_token_id"]
    assert drafter.target_layer_ids == config["dflash_config"]["target_layer_ids"]
    assert drafter.config.hidden_size == config["hidden_size"]


def test_loads_block_size_from_dflash_config(fixture_models, tmp_path):
    def move(config):
        config["dflash_config"]["block_size"] = 5
        del config["block_size"]

    assert load_drafter(copy_drafter(fixture_models, tmp_path, edit_config=move)).block_size == 5


def test_loads_tensor_names_with_a_model_prefix(fixture_models, tmp_path):
    path = copy_drafter(
        fixture_models, tmp_path, edit_tensors=lambda t: {"model." + k: v for k, v in t.items()}
    )
    plain = load_drafter(fixture_models.drafter)
    prefixed = load_drafter(path)
    assert torch.equal(plain.fc.weight, prefixed.fc.weight)
    assert torch.equal(plain.layers[1].mlp.down_proj.weight, prefixed.layers[1].mlp.down_proj.weight)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.pop("dflash_config"), "no dflash_config"),
        (lambda c: c["dflash_config"].pop("target_layer_ids"), "target_layer_ids is missing"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id is missing"),
        (lambda c: c.pop("block_size"), "block_size is missing"),
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "not a DFlash drafter"),
    ],
    ids=["dflash_config", "target_layer_ids", "mask_token_id", "block_size", "architecture"],
)
def test_a_bad_config_names_what_is_missing(fixture_models, tmp_path, edit, message):
    with pytest.raises(DrafterError, match=message):
        load_drafter(copy_drafter(fixture_models, tmp_path, edit_config=edit))


def test_a_missing_tensor_is_named(fixture_models, tmp_path):
    path = copy_drafter(
        fixture_models,
        tmp_path,
        edit_tensors=lambda t: {k: v for k, v in t.items() if k != "layers.1.self_attn.k_norm.weight"},
    )
    with pytest.raises(DrafterError, match=r"missing tensors \['layers.1.self_attn.k_norm.weight'\]"):
        load_drafter(path)


def test_an_unexpected_tensor_is_named(fixture_models, tmp_path):
    path = copy_drafter(
        fixture_models, tmp_path, edit_tensors=lambda t: {**t, "embed_tokens.weight": torch.zeros(2, 2)}
    )
    with pytest.raises(DrafterError, match=r"unexpected tensors \['embed_tokens.weight'\]"):
        load_drafter(path)


def test_a_tensor_of_the_wrong_shape_is_named(fixture_models, tmp_path):
    path = copy_drafter(
        fixture_models, tmp_path, edit_tensors=lambda t: {**t, "fc.weight": t["fc.weight"][:, :10].clone()}
    )
    with pytest.raises(DrafterError, match="tensor fc.weight has shape"):
        load_drafter(path)


# ---- forward --------------------------------------------------------------------------------------


def test_many_blocks_in_one_forward_equal_one_block_at_a_time(fixture_models):
    drafter = load_drafter(fixture_models.drafter)
    head = load_target_head(fixture_models.target)
    generator = torch.Generator().manual_seed(0)
    L = 40
    features = torch.randn(2, L, 3, drafter.hidden_size, generator=generator)
    ids = torch.randint(0, head.vocab_size, (2, L), generator=generator)
    starts = torch.tensor([[3, 11, 30], [1, 20, 38]])
    with torch.inference_mode():
        embeds = drafter.block_embeddings(head.embed, ids.gather(1, starts))
        batched = drafter(embeds, starts, drafter.context_kv(features))[:, :, 1:]
        for b in range(2):
            loop = SequentialDrafter(drafter, head, features[b])
            for i, s in enumerate(starts[b].tolist()):
                single = loop.block_hidden(int(ids[b, s]), s)
                torch.testing.assert_close(batched[b, i], single, rtol=1e-5, atol=1e-5)


def test_the_last_layer_finished_later_on_some_positions_equals_the_whole_forward(fixture_models):
    drafter = load_drafter(fixture_models.drafter)
    head = load_target_head(fixture_models.target)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 40, 3, drafter.hidden_size, generator=generator)
    ids = torch.randint(0, head.vocab_size, (2, 40), generator=generator)
    starts = torch.tensor([[3, 11, 30], [1, 20, 38]])
    with torch.inference_mode():
        context = drafter.context_kv(features)
        embeds = drafter.block_embeddings(head.embed, ids.gather(1, starts))
        whole = drafter(embeds, starts, context)
        residual, mixed = drafter.trunk(embeds, starts, context)
        some = drafter.finish(residual[1, :2, 2:5], mixed[1, :2, 2:5])
    torch.testing.assert_close(some, whole[1, :2, 2:5], rtol=1e-5, atol=1e-5)


def test_a_block_ignores_the_context_at_and_after_its_start(fixture_models):
    drafter = load_drafter(fixture_models.drafter)
    head = load_target_head(fixture_models.target)
    features = torch.randn(1, 30, 3, drafter.hidden_size)
    changed = features.clone()
    changed[:, 12:] = torch.randn_like(changed[:, 12:])
    starts = torch.tensor([[12]])
    embeds = drafter.block_embeddings(head.embed, torch.tensor([[5]]))
    with torch.inference_mode():
        a = drafter(embeds, starts, drafter.context_kv(features))
        b = drafter(embeds, starts, drafter.context_kv(changed))
    torch.testing.assert_close(a, b)


def test_features_are_hf_hidden_states_shifted_by_one(fixture_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fixture_models.target, dtype=torch.float32).eval()
    captured = {}
    hooks = [
        model.model.layers[k].register_forward_hook(
            lambda _m, _i, out, k=k: captured.__setitem__(k, out[0] if isinstance(out, tuple) else out)
        )
        for k in (1, 3, 5)
    ]
    ids = torch.arange(3, 23)[None]
    with torch.inference_mode():
        hidden = model(ids, output_hidden_states=True).hidden_states
    for hook in hooks:
        hook.remove()
    features = select_target_features(hidden, [1, 3, 5])
    assert features.shape == (1, 20, 3, model.config.hidden_size)
    for column, k in enumerate((1, 3, 5)):
        torch.testing.assert_close(features[..., column, :], captured[k], rtol=0, atol=0)


def test_a_target_layer_out_of_range_is_named():
    hidden = [torch.zeros(1, 2, 4)] * 9  # embeddings + 8 layers
    with pytest.raises(DrafterError, match=r"target layer 8 out of range: the model has 8 layers \(0-7\)"):
        select_target_features(hidden, [1, 8])


# ---- target head ------------------------------------------------------------------------------------


def test_target_head_reads_the_embedding_and_lm_head(fixture_models):
    tensors = load_file(str(fixture_models.target / "model.safetensors"))
    head = load_target_head(fixture_models.target)
    assert torch.equal(head.embed_weight, tensors["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head_weight, tensors["lm_head.weight"])


def test_target_head_reads_sharded_multimodal_checkpoints(tmp_path):
    embed, lm_head = torch.randn(10, 4), torch.randn(10, 4)
    save_file(
        {"model.language_model.embed_tokens.weight": embed, "model.layers.0.x": torch.zeros(1)},
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file({"lm_head.weight": lm_head}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "model.language_model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                    "model.layers.0.x": "model-00001-of-00002.safetensors",
                    "lm_head.weight": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    head = load_target_head(tmp_path)
    assert torch.equal(head.embed_weight, embed) and torch.equal(head.lm_head_weight, lm_head)


def test_target_head_uses_the_embedding_when_tied(tmp_path):
    embed = torch.randn(10, 4)
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": True}}))
    assert torch.equal(load_target_head(tmp_path).lm_head_weight, embed)


def test_target_head_without_lm_head_and_untied_is_an_error(tmp_path):
    save_file({"model.embed_tokens.weight": torch.randn(10, 4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    with pytest.raises(TargetHeadError, match="no lm_head"):
        load_target_head(tmp_path)


def test_argmax_in_small_chunks_equals_the_full_argmax():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 16, generator=generator)
    hidden = torch.randn(3, 7, 16, generator=generator)
    head = TargetHead(weight, weight, logits_budget_bytes=3 * 1000 * 4)  # three rows per chunk
    assert torch.equal(head.argmax(hidden), (hidden @ weight.T).argmax(-1))


def test_argmax_breaks_ties_toward_the_lowest_token_id():
    weight = torch.zeros(6, 2)
    weight[2] = weight[4] = torch.tensor([1.0, 0.0])
    head = TargetHead(weight, weight)
    assert head.argmax(torch.tensor([[1.0, 0.0]])).tolist() == [2]
