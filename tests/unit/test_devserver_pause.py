"""/pause_generation and /continue_generation move requests in flight as SGLang 0.5.23 does.

Sources: sglang 0.5.23 managers/io_struct.py:1927 (PauseGenerationReqInput), managers/tokenizer_manager.py
(pause_generation, the door at 938, aborts at 3577), managers/scheduler.py (abort_request 5675,
pause_generation 5816, is_fully_idle 5337, flush_cache 5518), entrypoints/http_server.py (health 722).
"""

from __future__ import annotations

import threading
import time

import pytest
from devserver_client import call

from specops.devserver.launch import DevServerProcess, http_status
from specops.loadgen import LoadGenerator

pytestmark = pytest.mark.slow

PROMPT = [318, 293, 342, 11, 311]
HEALTH_TIMEOUT_S = 2  # SGLANG_HEALTH_CHECK_TIMEOUT for these servers: short, so the 503 comes fast
GRAMMAR_COMPILE_S = 5  # --grammar-compile-delay: a constrained request's time in the grammar queue


def long_request(max_new_tokens: int = 400, stream: bool = False) -> dict:
    body: dict = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    if stream:
        body["stream"] = True
    return body


def loads(url: str) -> tuple[int, int]:
    """(running, waiting) of the one DP rank, from 0.5.23's /v1/loads."""
    status, body = call(url, "/v1/loads")
    assert status == 200
    rank = body["loads"][0]
    return rank["num_running_reqs"], rank["num_waiting_reqs"]


def grammar_queue(url: str) -> int:
    """Constrained requests waiting for their grammar, from /v1/loads' queues section."""
    return call(url, "/v1/loads")[1]["loads"][0]["queues"]["grammar"]


def wait_until(condition, what: str, bound: float = 120.0) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {bound:g} s"
        time.sleep(0.02)


def in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    answer: dict = {}
    worker = threading.Thread(target=lambda: answer.update(result=call(url, "/generate", body, timeout=600)))
    worker.start()
    return worker, answer


@pytest.fixture(scope="module")
def server(fixture_models, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", str(HEALTH_TIMEOUT_S))
    log = tmp_path_factory.mktemp("devserver-pause") / "server.log"
    process = DevServerProcess(
        fixture_models.target,
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--grammar-compile-delay",
        str(GRAMMAR_COMPILE_S),
        # A batch of one: a second request waits in the queue, where an abort finds it (scheduler.py:4121).
        "--max-running-requests",
        "1",
        log_path=log,
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture
def continued(server):
    """Whatever a test paused is continued after it, so the next test finds a serving server."""
    yield server
    call(server.url, "/continue_generation", {})


@pytest.fixture(scope="module")
def undisturbed(server) -> list[int]:
    status, body = call(server.url, "/generate", long_request(), timeout=600)
    assert status == 200 and len(body["output_ids"]) == 400
    return body["output_ids"]


def test_abort_mode_aborts_the_request_in_flight_with_its_partial_output(continued):
    # An empty body is mode "abort": the running request answers 200 with what it decoded and
    # finish_reason {"type": "abort", "message": "Aborted", ...} (scheduler.py:5811).
    url = continued.url
    worker, answer = in_background(url, long_request(2000))
    wait_until(lambda: loads(url)[0] == 1, "the request running")
    assert call(url, "/pause_generation", {})[0] == 200
    worker.join(300)
    status, body = answer["result"]
    assert status == 200
    assert body["meta_info"]["finish_reason"]["type"] == "abort"
    assert body["meta_info"]["finish_reason"]["message"] == "Aborted"
    assert 0 < len(body["output_ids"]) < 2000 and body["meta_info"]["completion_tokens"] == len(
        body["output_ids"]
    )


def test_abort_mode_aborts_a_queued_request_with_no_output(continued):
    # tokenizer_manager.py:3596: a request still in the waiting queue ends with "Abort in waiting queue".
    url = continued.url
    running, _ = in_background(url, long_request(2000))
    wait_until(lambda: loads(url)[0] == 1, "the first request running")
    queued, answer = in_background(url, long_request(8))
    wait_until(lambda: loads(url) == (1, 1), "the second request queued")
    assert call(url, "/pause_generation", {"mode": "abort"})[0] == 200
    queued.join(300)
    running.join(300)
    status, body = answer["result"]
    assert status == 200 and body["output_ids"] == []
    assert body["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}


def test_retract_lets_a_release_through_and_the_request_completes_as_if_undisturbed(continued, undisturbed):
    # retract: running requests go back to waiting and the scheduler is paused, so the release's
    # is_fully_idle(ignore_waiting=True) passes (weight_updater.py:339); after resume and continue
    # the request recomputes its prefix and greedy decoding gives the same tokens.
    url = continued.url
    worker, answer = in_background(url, long_request())
    wait_until(lambda: loads(url)[0] == 1, "the request running")
    assert call(url, "/pause_generation", {"mode": "retract"})[0] == 200
    assert loads(url) == (0, 1), "the pause came after the request finished: nothing was retracted"
    assert call(url, "/release_memory_occupation", {"tags": []}) == (200, None)
    assert call(url, "/resume_memory_occupation", {"tags": []}) == (200, None)
    assert answer == {}, "a retracted request must wait for /continue_generation"
    assert call(url, "/continue_generation", {})[0] == 200
    worker.join(600)
    status, body = answer["result"]
    assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "length"
    assert body["output_ids"] == undisturbed


def test_streams_and_requests_in_flight_complete_across_a_retract_pause(continued):
    # A stream's last chunk carries the full count and the stream ends with data: [DONE]
    # (http_server.py:951), also when a retract pause cut it in two.
    url = continued.url
    generator = LoadGenerator(
        url,
        concurrency=3,
        max_requests=6,
        max_seconds=600,
        max_new_tokens=4,
        timeout=600,
        stop_file=None,
        kinds=("stream", "long", "short"),
        long_max_new_tokens=300,
    )
    rows: list[dict] = []
    worker = threading.Thread(target=lambda: rows.extend(generator.run()))
    worker.start()
    wait_until(lambda: sum(loads(url)) >= 2, "two requests in flight")
    paused_at = time.time()
    assert call(url, "/pause_generation", {"mode": "retract"})[0] == 200
    assert call(url, "/release_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)
    assert call(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)
    assert call(url, "/continue_generation", {})[0] == 200
    worker.join(900)
    cut = [r for r in rows if r["start"] < paused_at < r["start"] + r["latency_s"]]
    assert len(rows) == 6 and {"stream", "long"} <= {r["kind"] for r in cut}
    assert [r for r in rows if not r["complete"]] == []


def test_in_place_keeps_the_request_running_so_flush_cache_fails(continued):
    # in_place freezes running requests with their KV (io_struct.py:1932): flush_cache fails while
    # they run (scheduler.py:5520) and the request completes after /continue_generation.
    url = continued.url
    worker, answer = in_background(url, long_request(300))
    wait_until(lambda: loads(url)[0] == 1, "the request running")
    assert call(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    assert loads(url) == (1, 0)
    assert call(url, "/flush_cache", {}) == (400, "Flush cache failed.\n")
    assert call(url, "/continue_generation", {})[0] == 200
    worker.join(600)
    assert answer["result"][0] == 200 and len(answer["result"][1]["output_ids"]) == 300


def test_health_while_paused_waits_the_health_check_timeout_and_answers_503(continued):
    # The health request waits at the paused door; with no scheduler answer in
    # SGLANG_HEALTH_CHECK_TIMEOUT seconds the answer is 503 and the server is marked unhealthy
    # (http_server.py:779-798). /v1/loads reads a snapshot and a pause is not answered by the
    # scheduler: polling them meanwhile is no sign of life. /ready answers 503 while paused and while
    # unhealthy (tokenizer_manager.py:729-734), until a health check passes again.
    url = continued.url
    assert http_status(url + "/ready") == 200
    assert call(url, "/pause_generation", {"mode": "retract"})[0] == 200
    assert http_status(url + "/ready") == 503
    polling = threading.Event()

    def poll_loads() -> None:
        while not polling.is_set():
            loads(url)
            call(url, "/pause_generation", {"mode": "retract"})
            time.sleep(0.1)

    poller = threading.Thread(target=poll_loads)
    poller.start()
    began = time.monotonic()
    try:
        status = http_status(url + "/health_generate", timeout=120)
    finally:
        polling.set()
        poller.join()
    waited = time.monotonic() - began
    assert status == 503 and waited >= HEALTH_TIMEOUT_S
    assert call(url, "/server_info")[1]["status"] == "UnHealthy"
    assert call(url, "/continue_generation", {})[0] == 200
    assert http_status(url + "/ready") == 503  # still marked unhealthy
    assert http_status(url + "/health_generate", timeout=120) == 200
    assert http_status(url + "/ready") == 200


def test_a_constrained_request_stays_in_the_grammar_queue_while_paused_and_flush_fails(continued):
    # The grammar queue drains only while scheduling (scheduler.py:4084-4088) and idleness requires it
    # empty (scheduler.py:5369-5372): paused with a constrained request there, /flush_cache fails (and a
    # release would kill 0.5.23); after the continue it completes.
    url = continued.url
    body = {**long_request(8), "sampling_params": {**long_request(8)["sampling_params"], "regex": "[a-z ]+"}}
    sent = time.monotonic()
    worker, answer = in_background(url, body)
    try:
        wait_until(lambda: grammar_queue(url) == 1, "the request in the grammar queue")
        assert call(url, "/pause_generation", {"mode": "retract"})[0] == 200
        assert time.monotonic() - sent < GRAMMAR_COMPILE_S, "paused after the grammar was compiled"
        time.sleep(GRAMMAR_COMPILE_S - (time.monotonic() - sent) + 0.2)  # compiled by now
        assert grammar_queue(url) == 1
        assert call(url, "/flush_cache", {}) == (400, "Flush cache failed.\n")
    finally:
        call(url, "/continue_generation", {})
    worker.join(120)
    status, result = answer["result"]
    assert status == 200 and len(result["output_ids"]) == 8 and grammar_queue(url) == 0


def test_get_load_counts_running_then_waiting_then_none(continued):
    # 0.5.23 reports load at /v1/loads (entrypoints/v1_loads.py:96), per DP rank; there is no /get_load.
    url = continued.url
    assert call(url, "/get_load")[0] == 404
    worker, _ = in_background(url, long_request(2000))
    wait_until(lambda: loads(url) == (1, 0), "the request running")
    assert call(url, "/pause_generation", {"mode": "retract"})[0] == 200
    assert loads(url) == (0, 1)
    assert call(url, "/pause_generation", {"mode": "abort"})[0] == 200
    worker.join(300)
    wait_until(lambda: loads(url) == (0, 0), "the aborted request leaving")
