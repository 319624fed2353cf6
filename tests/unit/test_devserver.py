"""The development server behaves like SGLang where the project depends on it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from devserver_client import call

from specops.devserver.engine import Engine
from specops.devserver.launch import SRC_DIR, DevServerProcess, free_port, http_status
from specops.devserver.memory import MemorySaver
from specops.devserver.memory_backends import CpuBackend
from specops.devserver.protocol import RequestError, parse_generate

pytestmark = pytest.mark.slow

PROMPT_IDS = [[318, 293, 342, 11, 311], [1, 88, 86, 269, 202, 75, 76, 2, 202, 1, 68]]


def cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC_DIR)}


def greedy(ids: list[int], max_new_tokens: int = 16) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}


@pytest.fixture(scope="module")
def server(fixture_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("devserver") / "server.log"
    process = DevServerProcess(
        fixture_models.target,
        "--startup-delay",
        "2",
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--served-model-name",
        "tiny-target",
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(fixture_models.drafter),
        "--speculative-num-draft-tokens",
        "16",
        log_path=log,
    )
    try:
        process.statuses = process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def reference(fixture_models):
    """The same model loaded in the test, to compare the server's tokens with transformers' own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # as the server runs: reduction order, hence greedy ties, cannot differ
    model = AutoModelForCausalLM.from_pretrained(fixture_models.target).eval()
    return model, AutoTokenizer.from_pretrained(fixture_models.target)


def reference_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    inputs = torch.tensor([ids])
    out = model.generate(
        inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=max_new_tokens
    )
    return out[0, len(ids) :].tolist()


# -- readiness -------------------------------------------------------------------------------
def test_health_answers_503_while_starting_then_200(server):
    # -1 (nothing listening) only while the interpreter boots; from the first answer on it is 503 then 200.
    answered = [status for status in server.statuses if status != -1]
    assert server.statuses[server.statuses.index(answered[0]) :] == answered
    assert answered[0] == 503 and set(answered[:-1]) == {503}
    assert answered[-1] == 200
    assert http_status(server.url + "/health") == 200


def test_health_answers_on_the_first_whole_second_as_sglang_looks(server):
    # SGLang sleeps a second before each look for a sign of life (0.5.23 entrypoints/http_server.py:779-781):
    # a passing check never answers sooner, however fast its token came back; a 1-token /generate does.
    started = time.monotonic()
    assert http_status(server.url + "/health_generate") == 200
    assert time.monotonic() - started >= 1.0
    status, body = call(server.url, "/generate", greedy(PROMPT_IDS[0], max_new_tokens=1))
    assert status == 200 and len(body["output_ids"]) == 1


def test_generate_is_refused_with_503_while_starting(fixture_models):
    with DevServerProcess(fixture_models.target, "--startup-delay", "30") as starting:
        deadline = time.monotonic() + 60
        while http_status(starting.url + "/get_model_info") != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        status, body = call(starting.url, "/generate", greedy(PROMPT_IDS[0]))
        assert status == 503 and "starting" in body["message"]
        assert http_status(starting.url + "/health_generate") == 503


# -- /generate -------------------------------------------------------------------------------
@pytest.mark.parametrize("ids", PROMPT_IDS)
def test_greedy_output_ids_equal_transformers_generate(server, reference, ids):
    status, body = call(server.url, "/generate", greedy(ids, 24))
    assert status == 200
    assert body["output_ids"] == reference_greedy(reference[0], ids, 24)
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(body["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 24}


def test_text_prompt_is_tokenized_like_its_input_ids(server, reference):
    text = "def main():"
    ids = reference[1].encode(text)
    _, by_text = call(server.url, "/generate", {"text": text, "sampling_params": {"temperature": 0}})
    _, by_ids = call(server.url, "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0}})
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)
    assert by_text["text"] == reference[1].decode(by_text["output_ids"], skip_special_tokens=True)


def test_generation_stops_at_a_stop_token_and_says_so(server):
    _, first = call(server.url, "/generate", greedy(PROMPT_IDS[0], 4))
    stop_at = first["output_ids"][1]
    body = greedy(PROMPT_IDS[0], 4)
    body["sampling_params"]["stop_token_ids"] = [stop_at]
    _, stopped = call(server.url, "/generate", body)
    cut = first["output_ids"].index(stop_at) + 1
    assert stopped["output_ids"] == first["output_ids"][:cut]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_batched_input_ids_answer_one_result_per_prompt(server):
    status, body = call(
        server.url,
        "/generate",
        {
            "input_ids": PROMPT_IDS,
            "rid": ["a", "b"],
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        },
    )
    assert status == 200
    singles = [call(server.url, "/generate", greedy(ids, 8))[1]["output_ids"] for ids in PROMPT_IDS]
    assert [item["output_ids"] for item in body] == singles
    assert [item["meta_info"]["id"] for item in body] == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"text": "x", "input_ids": [1]}, "exactly one of"),
        ({"input_ids": [1], "return_logprob": True}, "return_logprob"),
        ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
        ({"input_ids": [1], "sampling_params": {"temperature": 0, "stop": ["\n"]}}, "stop_token_ids"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [100000], "sampling_params": {"temperature": 0}}, "outside the vocabulary"),
    ],
)
def test_bad_generate_requests_get_400_naming_the_problem(server, body, problem):
    status, answer = call(server.url, "/generate", body)
    assert status == 400
    assert problem in answer["message"]


# -- info endpoints --------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/get_model_info", "/model_info"])
def test_model_info_names_the_model_and_weight_version(server, fixture_models, path):
    status, info = call(server.url, path)
    assert status == 200
    assert info["model_path"] == str(fixture_models.target)
    assert info["weight_version"] == "default" and info["is_generation"] is True


def test_v1_models_lists_the_served_model_name(server):
    _, models = call(server.url, "/v1/models")
    assert [m["id"] for m in models["data"]] == ["tiny-target"]


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
def test_server_info_records_the_launch_flags(server, fixture_models, path):
    _, info = call(server.url, path)
    assert info["speculative_algorithm"] == "DFLASH"
    assert info["speculative_draft_model_path"] == str(fixture_models.drafter)
    assert info["speculative_num_draft_tokens"] == 16 and info["tp_size"] == 1
    assert info["status"] == "Up"


def pending(server) -> int:
    return call(server.url, "/get_server_info")[1]["internal_states"][0]["pending_requests"]


@contextlib.contextmanager
def long_generation(server, tokens: int) -> Iterator[dict]:
    """A greedy request of `tokens` running in the background once this enters; its answer (under
    "result") once it exits."""
    answer: dict = {}
    worker = threading.Thread(
        target=lambda: answer.update(result=call(server.url, "/generate", greedy(PROMPT_IDS[0], tokens)))
    )
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while pending(server) == 0:
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.02)
        yield answer
    finally:
        worker.join(180)


def test_health_answers_200_while_a_long_generation_holds_the_model(server):
    with long_generation(server, 300) as answer:
        assert http_status(server.url + "/health_generate") == 200
        still_running = pending(server)
    assert still_running == 1, "health must not wait for the running request to finish"
    assert answer["result"][0] == 200


def test_a_new_request_joins_the_running_batch_instead_of_waiting_for_a_long_one(server):
    # SGLang prefills a new request at the next step and merges it into the running batch (0.5.23
    # managers/scheduler.py:3894-3961): a short request is not queued behind a long one's end.
    with long_generation(server, 120) as long_answer:
        short_status, short = call(server.url, "/generate", greedy(PROMPT_IDS[1], 4))
        long_still_running = "result" not in long_answer
    assert short_status == 200 and long_still_running, "the short request waited for the long one's end"
    assert short["output_ids"] == call(server.url, "/generate", greedy(PROMPT_IDS[1], 4))[1]["output_ids"]
    status, body = long_answer["result"]
    assert status == 200 and len(body["output_ids"]) == 120, "the long request lost tokens to its turns"


def test_flush_cache_is_refused_while_a_request_is_pending(server):
    with long_generation(server, 300):
        status, body = call(server.url, "/flush_cache", {}, method="POST")
    # SGLang 0.5.23 entrypoints/http_server.py:1036: the scheduler's message, or this default.
    assert status == 400 and body == "Flush cache failed.\n"


def test_flush_cache_succeeds_when_idle(server):
    assert call(server.url, "/flush_cache", {}, method="POST")[0] == 200


# -- memory release --------------------------------------------------------------------------
def test_release_makes_generation_unavailable_until_resume(server):
    before = call(server.url, "/generate", greedy(PROMPT_IDS[0]))[1]["output_ids"]
    # SGLang 0.5.23 http_server.py:1577: the endpoints return nothing, i.e. 200 with `null`.
    assert call(server.url, "/release_memory_occupation", {"tags": []}) == (200, None)
    try:
        released = call(server.url, "/server_info")[1]["internal_states"][0]["released_memory_tags"]
        assert released == ["cuda_graph", "kv_cache", "weights"]
        assert call(server.url, "/generate", greedy(PROMPT_IDS[0]))[0] == 503
        assert http_status(server.url + "/health_generate") == 503
    finally:
        resumed = call(server.url, "/resume_memory_occupation", {"tags": []})
    assert resumed == (200, None)
    assert call(server.url, "/generate", greedy(PROMPT_IDS[0]))[1]["output_ids"] == before
    assert http_status(server.url + "/health_generate") == 200


def test_release_drops_the_live_model_and_resume_brings_back_the_same_tensors():
    engine = Engine("unused")
    engine.status = engine.status.UP
    sentinel = type("Model", (), {"to": lambda self, device: self})()
    engine.model = sentinel
    saver = MemorySaver(engine, enabled=True, cpu_backup=True)
    saver.release({"weights"})
    assert engine.model is None and engine.released_tags == {"weights"}
    saver.resume({"weights"})
    assert engine.model is sentinel and not engine.released_tags


def test_forgiving_memory_release_needs_enable_memory_saver():
    saver = MemorySaver(Engine("unused"), enabled=False, cpu_backup=False, strict=False)
    with pytest.raises(RequestError, match="--enable-memory-saver") as error:
        saver.release({"weights"})
    assert error.value.status == 400


def test_strict_release_without_memory_saver_answers_success_and_frees_nothing():
    engine = Engine("unused")
    engine.status = engine.status.UP
    engine.model = sentinel = object()
    answer = MemorySaver(engine, enabled=False, cpu_backup=False).release({"weights"})
    assert answer is None and engine.model is sentinel and not engine.released_tags


class SchedulerCrashed(Exception):
    pass


@pytest.fixture
def crash(monkeypatch):
    """Record the scheduler crash instead of ending the test process."""

    def crashed(reason: str) -> None:
        raise SchedulerCrashed(reason)

    monkeypatch.setattr("specops.devserver.memory.scheduler_crash", crashed)


def test_strict_release_while_a_request_is_pending_crashes_the_scheduler(crash):
    engine = Engine("unused")
    engine.status = engine.status.UP
    engine.model = object()
    with engine.track(), pytest.raises(SchedulerCrashed, match="only when server is idle"):
        MemorySaver(engine, enabled=True, cpu_backup=True).release({"kv_cache"})


def test_strict_resume_of_a_tag_that_is_not_released_crashes_the_scheduler(crash):
    engine = Engine("unused")
    engine.status = engine.status.UP
    saver = MemorySaver(engine, enabled=True, cpu_backup=True)
    saver.release({"kv_cache"})
    with pytest.raises(SchedulerCrashed, match="KeyError: 'weights'"):
        saver.resume({"kv_cache", "weights"})


def test_a_second_resume_takes_the_whole_server_down(fixture_models, tmp_path):
    log = tmp_path / "server.log"
    with DevServerProcess(
        fixture_models.target, "--enable-memory-saver", "--enable-weights-cpu-backup", log_path=log
    ) as server:
        server.wait_ready()
        assert call(server.url, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        assert call(server.url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            call(server.url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        # The launcher SIGKILLs its tree and itself (sglang 0.5.23 utils/common.py:2548-2554): signal 9.
        assert server.process.wait(30) == -signal.SIGKILL
    assert "Scheduler hit an exception" in log.read_text()


def test_strict_server_that_fails_to_load_never_opens_its_port(tmp_path):
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text("{}")
    seen = []
    with DevServerProcess(model) as server:
        while server.process.poll() is None:
            seen.append(http_status(server.url + "/health", timeout=2))
            time.sleep(0.05)
    assert server.process.returncode == 1 and set(seen) <= {-1}


def test_pause_holds_new_requests_until_continue(server):
    assert call(server.url, "/pause_generation", {})[0] == 200
    answers: list[object] = []
    worker = threading.Thread(
        target=lambda: answers.append(call(server.url, "/generate", greedy(PROMPT_IDS[0], 2)))
    )
    worker.start()
    try:
        time.sleep(1.0)
        assert not answers and call(server.url, "/flush_cache", {}, method="POST")[0] == 200
    finally:
        assert call(server.url, "/continue_generation", {})[0] == 200
        worker.join(60)
    assert answers and answers[0][0] == 200


def test_forgiving_release_is_refused_while_requests_are_pending():
    engine = Engine("unused")
    engine.status = engine.status.UP
    engine.model = object()
    with engine.track(), pytest.raises(RequestError, match="1 waiting request") as error:
        MemorySaver(engine, enabled=True, cpu_backup=True, strict=False).release({"kv_cache"})
    assert error.value.status == 400


def test_forgiving_release_of_weights_without_cpu_backup_is_refused():
    engine = Engine("unused")
    engine.status = engine.status.UP
    with pytest.raises(RequestError, match="--enable-weights-cpu-backup"):
        MemorySaver(engine, enabled=True, cpu_backup=False, strict=False).release({"weights"})


def test_generate_body_with_one_text_is_not_batched():
    request = parse_generate({"text": "hi", "sampling_params": {"temperature": 0, "max_new_tokens": 3}})
    assert (
        not request.batched and request.items[0].params.greedy and request.items[0].params.max_new_tokens == 3
    )


# -- process lifecycle -----------------------------------------------------------------------
def test_sigterm_lets_the_in_flight_request_finish_then_exits_0(fixture_models):
    process = DevServerProcess(fixture_models.target)
    try:
        process.wait_ready()
        answer: dict = {}
        worker = threading.Thread(
            target=lambda: answer.update(result=call(process.url, "/generate", greedy(PROMPT_IDS[0], 200)))
        )
        worker.start()
        deadline = time.monotonic() + 30
        while call(process.url, "/get_server_info")[1]["internal_states"][0]["pending_requests"] == 0:
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.02)
        process.process.terminate()
        time.sleep(0.2)
        health_while_stopping = http_status(process.url + "/health_generate")
        worker.join(180)
        rc = process.process.wait(180)
    finally:
        process.stop()
    assert health_while_stopping == 503
    assert answer["result"][0] == 200 and len(answer["result"][1]["output_ids"]) == 200
    assert rc == 0


def test_a_port_in_use_exits_at_once_naming_the_port(fixture_models):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "specops.devserver",
                "--model-path",
                str(fixture_models.target),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=cli_env(),
        )
    assert done.returncode != 0
    assert f"port {port}" in done.stderr and "already in use" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_model_path_without_config_exits_2(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "specops.devserver",
            "--model-path",
            str(tmp_path),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert done.returncode == 2 and "config.json" in done.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_on_a_gpu_release_frees_the_weights_into_pinned_host_memory_and_resume_restores_them():
    engine = Engine("unused", device="cuda")
    engine.status = engine.status.UP
    model = torch.nn.Linear(64, 64).to("cuda")
    weight = model.weight.detach().clone()
    engine.model = model
    saver = MemorySaver(engine, enabled=True, cpu_backup=True, backend=CpuBackend("cuda", cpu_backup=True))
    for _ in range(2):  # the pinned buffers are made once and serve the next release too
        saver.release({"weights"})
        assert model.weight.numel() == 0 and saver.backend._host["weight"].is_pinned()
        saver.resume({"weights"})
        assert engine.model is model and torch.equal(model.weight, weight)
