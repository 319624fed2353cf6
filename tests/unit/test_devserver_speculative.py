"""The development server speculates with a DFlash drafter: greedy tokens unchanged, SGLang's counts,
and the online figures equal the offline walk's once the prefill's token is counted as SGLang does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from specops import diagnostics as diag  # noqa: E402
from specops import report as rep  # noqa: E402
from specops.devserver.engine import Engine  # noqa: E402
from specops.devserver.launch import SRC_DIR, free_port  # noqa: E402
from specops.devserver.protocol import parse_generate  # noqa: E402
from specops.score.acceptance import SequenceInput, offline_acceptance  # noqa: E402
from specops.score.drafter import load_drafter, select_target_features  # noqa: E402
from specops.score.sequential_acceptance import sequential_acceptance  # noqa: E402
from specops.score.target_head import load_target_head  # noqa: E402

pytestmark = pytest.mark.slow

NEW_TOKENS = 40


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models: extra threads only contend; one thread also fixes the reduction order.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained_drafter(trained_fixture_models):
    """A drafter trained on the target's greedy outputs, so most verify steps accept several drafts."""
    return trained_fixture_models.reference_drafter


def make_engine(target, drafter, num_draft_tokens=None) -> Engine:
    engine = Engine(str(target), draft_model_path=str(drafter), num_draft_tokens=num_draft_tokens)
    engine.load()
    engine.mark_up()
    return engine


@pytest.fixture(scope="module")
def engine(fixture_models, trained_drafter):
    return make_engine(fixture_models.target, trained_drafter)


@pytest.fixture(scope="module")
def target(fixture_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(fixture_models.target).eval()


@pytest.fixture(scope="module")
def prompts(fixture_models, engine) -> list[list[int]]:
    records = [json.loads(line) for line in fixture_models.prompts.read_text().splitlines() if line.strip()]
    texts = [r.get("prompt") or " ".join(m["content"] for m in r["messages"]) for r in records[:4]]
    return [engine.tokenizer(text).input_ids for text in texts]


def generate(engine: Engine, ids: list[int], **params) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, **params}}
    return engine.generate(parse_generate(body).items)[0]


@pytest.fixture(scope="module")
def answers(engine, prompts) -> list[dict]:
    return [generate(engine, ids) for ids in prompts]


def plain_greedy(target, ids: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    inputs = torch.tensor([ids])
    out = target.generate(
        inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=max_new_tokens
    )
    return out[0, len(ids) :].tolist()


def offline_walk(target, drafter_dir, target_dir, ids: list[int], output_ids: list[int]):
    """The scorer's oracle on the completion: features from one forward over prompt + output."""
    drafter = load_drafter(drafter_dir)
    sequence = torch.tensor(ids + output_ids)
    with torch.inference_mode():
        hidden = target(sequence[None], output_hidden_states=True).hidden_states
    features = select_target_features([h[0] for h in hidden], drafter.target_layer_ids)
    seq = SequenceInput("p", sequence, features, len(ids))
    head = load_target_head(target_dir)
    return drafter, head, seq, sequential_acceptance(drafter, head, seq)


FIGURES = ("spec_verify_ct", "completion_tokens", "spec_accept_length", "spec_accept_rate")


def spec_figures(meta: dict) -> dict:
    return {k: meta[k] for k in FIGURES}


# ---- decoding ----------------------------------------------------------------------------------------


def test_speculative_output_ids_equal_plain_greedy_generation(answers, prompts, target):
    for answer, ids in zip(answers, prompts, strict=True):
        assert answer["output_ids"] == plain_greedy(target, ids)


def test_the_trained_drafter_accepts_several_tokens_per_verify_step(answers):
    for answer in answers:
        assert answer["meta_info"]["spec_accept_length"] > 2.0


def test_meta_info_follows_sglangs_definitions(answers, engine):
    n = engine.speculator.num_draft_tokens
    for answer in answers:
        meta = answer["meta_info"]
        assert meta["completion_tokens"] == len(answer["output_ids"])
        assert meta["spec_accept_length"] == meta["completion_tokens"] / meta["spec_verify_ct"]
        assert meta["spec_draft_token_num"] == meta["spec_verify_ct"] * (n - 1)
        assert meta["spec_accept_rate"] == meta["spec_accept_token_num"] / meta["spec_draft_token_num"]
        # Each step appends its accepted drafts and one target token; the prefill adds the first.
        assert meta["spec_accept_token_num"] + meta["spec_verify_ct"] + 1 == meta["completion_tokens"]


# ---- online equals offline ---------------------------------------------------------------------------


def test_online_figures_equal_the_offline_walk_with_the_prefill_token_counted(
    answers, prompts, target, trained_drafter, fixture_models, engine
):
    n = engine.speculator.num_draft_tokens
    for answer, ids in zip(answers, prompts, strict=True):
        walked = offline_walk(target, trained_drafter, fixture_models.target, ids, answer["output_ids"])[3]
        assert spec_figures(answer["meta_info"]) == rep.online_from_offline(walked.accept_lengths, n)
        # The documented adjustment: SGLang's length is the offline tau plus 1 / verify steps.
        assert answer["meta_info"]["spec_accept_length"] == pytest.approx(
            walked.tau + 1 / walked.steps, abs=1e-12
        )


def test_the_batched_offline_engine_agrees_with_the_server_too(
    answers, prompts, target, trained_drafter, fixture_models
):
    answer, ids = answers[0], prompts[0]
    drafter, head, seq, _ = offline_walk(
        target, trained_drafter, fixture_models.target, ids, answer["output_ids"]
    )
    (batched,) = offline_acceptance(drafter, head, [seq])
    assert spec_figures(answer["meta_info"]) == rep.online_from_offline(
        batched.accept_lengths, drafter.block_size
    )


def test_a_completion_ending_at_a_stop_token_is_counted_up_to_it(
    engine, prompts, target, trained_drafter, fixture_models
):
    ids = prompts[1]
    full = plain_greedy(target, ids)
    stop = full[len(full) // 2]  # a token the greedy output reaches mid-way
    answer = generate(engine, ids, stop_token_ids=[stop])
    expected = full[: full.index(stop) + 1]
    assert answer["output_ids"] == expected
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    _, _, _, walked = offline_walk(target, trained_drafter, fixture_models.target, ids, expected)
    assert spec_figures(answer["meta_info"]) == rep.online_from_offline(
        walked.accept_lengths, engine.speculator.num_draft_tokens
    )


def test_the_server_and_offline_scores_pass_the_online_agreement_diagnostic(
    answers, prompts, target, trained_drafter, fixture_models
):
    online, sequences = {}, []
    for i, (answer, ids) in enumerate(zip(answers, prompts, strict=True)):
        meta = answer["meta_info"]
        online[f"p{i}"] = {
            "tau": meta["spec_accept_length"],
            "verify_ct": meta["spec_verify_ct"],
            "completion_tokens": meta["completion_tokens"],
        }
        walked = offline_walk(target, trained_drafter, fixture_models.target, ids, answer["output_ids"])[3]
        sequences.append({"id": f"p{i}", "accept_lengths": walked.accept_lengths})
    comparison = rep.online_comparison(online, {"block_size": 8, "sequences": sequences}, "reference")
    finding = diag.online_agreement_check(comparison, "reference")
    assert finding["status"] == "ok", finding["message"]
    assert comparison["online_tau"] != comparison["offline_tau"]  # the prefill token does count


# ---- the edges --------------------------------------------------------------------------------------


def test_a_request_ended_by_the_prefill_token_has_no_verify_step(engine, prompts):
    meta = generate(engine, prompts[0], max_new_tokens=1)["meta_info"]
    assert spec_figures(meta) == {
        "spec_verify_ct": 0,
        "completion_tokens": 1,
        "spec_accept_length": 0,
        "spec_accept_rate": 0.0,
    }


def test_sampled_requests_do_not_speculate_and_carry_no_spec_figures(engine, prompts):
    answer = generate(engine, prompts[0], temperature=0.8, sampling_seed=1)
    assert not any(key.startswith("spec_") for key in answer["meta_info"])


def test_num_draft_tokens_sets_the_block_size_as_in_sglang(fixture_models, trained_drafter, prompts, target):
    engine = make_engine(fixture_models.target, trained_drafter, num_draft_tokens=4)
    answer = generate(engine, prompts[0])
    meta = answer["meta_info"]
    assert answer["output_ids"] == plain_greedy(target, prompts[0])
    assert meta["spec_draft_token_num"] == meta["spec_verify_ct"] * 3


def test_online_from_offline_adds_the_prefill_token_to_the_tokens_not_the_steps():
    assert rep.online_from_offline([3, 1, 4], num_draft_tokens=8) == {
        "spec_verify_ct": 3,
        "completion_tokens": 9,
        "spec_accept_length": 3.0,
        "spec_accept_rate": (8 - 3) / (3 * 7),
    }


# ---- startup ----------------------------------------------------------------------------------------


def run_server(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "specops.devserver", "--port", str(free_port()), *args]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC_DIR), "PATH": "/usr/bin:/bin"},
    )


def test_a_drafter_that_cannot_load_stops_the_server_naming_it(fixture_models, tmp_path):
    broken = tmp_path / "broken_drafter"
    broken.mkdir()
    (broken / "config.json").write_text((fixture_models.drafter / "config.json").read_text())
    done = run_server(
        "--model-path",
        str(fixture_models.target),
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(broken),
    )
    assert done.returncode == 1
    assert f"cannot load the DFlash drafter {broken}" in done.stderr and "no .safetensors" in done.stderr


def test_dflash_without_a_draft_model_path_exits_2(fixture_models):
    done = run_server("--model-path", str(fixture_models.target), "--speculative-algorithm", "DFLASH")
    assert done.returncode == 2 and "needs --speculative-draft-model-path" in done.stderr
