"""The strict development server fails where SGLang fails: crashes, garbage weights, refusals.

Sources: sglang 0.5.23 managers/scheduler_components/weight_updater.py:337 (release asserts
idleness), managers/scheduler.py (an exception ends the scheduler and SIGQUITs the launcher),
utils/auth.py (the API key), entrypoints/http_server.py (bodies and status codes); sglang 0.5.4
managers/scheduler_update_weights_mixin.py:101, managers/scheduler.py:2341 and http_server.py:609.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
from pathlib import Path

import pytest
from devserver_client import call

from specops.devserver.launch import DevServerProcess, http_status

pytestmark = pytest.mark.slow

PROMPT = [318, 293, 342, 11, 311]
API_KEY = "test-key"
ADMIN_KEY = "test-admin-key"
BEARER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
WAITING_TIMEOUT_S = 3  # SGLANG_REQ_WAITING_TIMEOUT of the keyed server


def request(max_new_tokens: int) -> dict:
    return {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }


def wait_until(condition, what: str, bound: float = 120.0) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {bound:g} s"
        time.sleep(0.02)


def in_background(url: str, body: dict, headers: dict | None = None) -> tuple[threading.Thread, dict]:
    answer: dict = {}

    def send() -> None:
        try:
            answer["result"] = call(url, "/generate", body, timeout=600, headers=headers)
        except (urllib.error.URLError, ConnectionError) as error:
            answer["error"] = error

    worker = threading.Thread(target=send)
    worker.start()
    return worker, answer


@pytest.fixture(scope="module")
def old_server(fixture_models, tmp_path_factory):
    """A server imitating SGLang 0.5.4."""
    log = tmp_path_factory.mktemp("devserver-054") / "server.log"
    with DevServerProcess(
        fixture_models.target,
        "--sglang-version",
        "0.5.4",
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--grammar-compile-delay",
        "3",
        log_path=log,
    ) as process:
        process.wait_ready()
        yield process


@pytest.fixture(scope="module")
def keyed_server(fixture_models, tmp_path_factory):
    """--api-key and --admin-api-key, the memory saver without --enable-weights-cpu-backup, and
    SGLANG_REQ_WAITING_TIMEOUT in its environment."""
    log = tmp_path_factory.mktemp("devserver-keyed") / "server.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SGLANG_REQ_WAITING_TIMEOUT", str(WAITING_TIMEOUT_S))
        process = DevServerProcess(
            fixture_models.target,
            "--api-key",
            API_KEY,
            "--admin-api-key",
            ADMIN_KEY,
            "--enable-memory-saver",
            log_path=log,
        )
    with process:
        process.wait_ready()
        yield process


def running(url: str, headers: dict | None = None) -> int:
    status, body = call(url, "/v1/loads", headers=headers)
    assert status == 200
    return body["loads"][0]["num_running_reqs"]


def children_of(pid: int) -> list[int]:
    found = []
    for entry in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def test_a_release_during_a_running_forward_pass_kills_the_whole_tree(fixture_models, tmp_path):
    # 0.5.23 asserts is_fully_idle before a release: the scheduler dies and SIGQUITs the launcher, which
    # SIGKILLs every child and itself (managers/scheduler.py:6370-6373, utils/common.py:2507-2554).
    log = tmp_path / "server.log"
    with DevServerProcess(
        fixture_models.target,
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--tp-size",
        "2",
        log_path=log,
    ) as server:
        server.wait_ready()
        children = children_of(server.process.pid)
        worker, answer = in_background(server.url, request(2000))
        wait_until(lambda: running(server.url) == 1, "the request running")
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            call(server.url, "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert server.process.wait(60) == -signal.SIGKILL
        worker.join(60)
    assert "result" not in answer, "the request in flight must be lost with the server"
    assert "Scheduler hit an exception" in log.read_text()
    assert len(children) == 3 and not any(alive(pid) for pid in children)


def test_the_tree_holds_one_device_per_scheduler_and_a_childs_death_takes_it_all(fixture_models, tmp_path):
    # --tp-size 2: sglang::scheduler_TP0/TP1, each holding its own device, and sglang::detokenizer, all
    # under the launcher (which holds none). A scheduler killed from outside is seen by the launcher's
    # watchdog (utils/watchdog.py:211-221), whose SIGQUIT ends the tree: signal 9, not 131.
    devices = tmp_path / "devices"
    devices.mkdir()
    with DevServerProcess(
        fixture_models.target,
        "--tp-size",
        "2",
        "--device-file",
        str(devices / "nvidia{rank}"),
        log_path=tmp_path / "server.log",
    ) as server:
        server.wait_ready()
        launcher = server.process.pid
        titles = {}
        for pid in children_of(launcher):
            titles[Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()] = pid
        assert sorted(titles) == ["sglang::detokenizer", "sglang::scheduler_TP0", "sglang::scheduler_TP1"]

        def held(pid: int) -> set[str]:
            return {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")} & {
                str(devices / "nvidia0"),
                str(devices / "nvidia1"),
            }

        assert held(titles["sglang::scheduler_TP0"]) == {str(devices / "nvidia0")}
        assert held(titles["sglang::scheduler_TP1"]) == {str(devices / "nvidia1")}
        assert not held(launcher) and not held(titles["sglang::detokenizer"])
        os.kill(titles["sglang::scheduler_TP1"], signal.SIGKILL)
        assert server.process.wait(60) == -signal.SIGKILL
    assert not any(alive(pid) for pid in titles.values())


def test_under_0_5_4_a_release_during_a_forward_pass_waits_for_the_step_and_the_request_completes(old_server):
    # 0.5.4 has no idleness assert: the release happens between two steps; after the resume the
    # running request continues to its full length.
    url = old_server.url
    worker, answer = in_background(url, request(300))
    wait_until(lambda: call(url, "/get_load")[1][0]["num_reqs"] == 1, "the request in flight")
    assert call(url, "/release_memory_occupation", {"tags": []}) == (200, None)
    assert old_server.process.poll() is None
    assert call(url, "/resume_memory_occupation", {"tags": []}) == (200, None)
    worker.join(600)
    status, body = answer["result"]
    assert status == 200 and len(body["output_ids"]) == 300


def test_under_0_5_4_flush_cache_when_busy_answers_400_with_the_success_text(old_server):
    url = old_server.url
    worker, _ = in_background(url, request(300))
    wait_until(lambda: call(url, "/get_load")[1][0]["num_reqs"] == 1, "the request in flight")
    status, text = call(url, "/flush_cache", {})
    worker.join(600)
    assert status == 400 and text.startswith("Cache flushed.")


def test_under_0_5_4_pause_takes_no_mode_and_aborts_the_request_in_flight(old_server):
    url = old_server.url
    worker, answer = in_background(url, request(2000))
    wait_until(lambda: call(url, "/get_load")[1][0]["num_reqs"] == 1, "the request in flight")
    try:
        assert call(url, "/pause_generation", {"mode": "retract"})[0] == 200
        worker.join(300)
    finally:
        call(url, "/continue_generation", {})
    assert answer["result"][1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_under_0_5_4_flush_cache_does_not_wait_for_the_grammar_queue(old_server):
    # 0.5.4 scheduler.py:2305-2311: flush looks at the waiting queue and the running batch only (0.5.23
    # also requires an empty grammar queue, scheduler.py:5369-5372).
    url = old_server.url
    body = {**request(4), "sampling_params": {**request(4)["sampling_params"], "regex": "[a-z]+"}}
    worker, answer = in_background(url, body)

    def in_grammar_queue() -> bool:
        state = call(url, "/get_server_info")[1]["internal_states"][0]
        return state["pending_requests"] == 1 and state["waiting_requests"] == state["running_requests"] == 0

    wait_until(in_grammar_queue, "the request in the grammar queue")
    assert call(url, "/flush_cache", {})[0] == 200
    worker.join(120)
    assert answer["result"][0] == 200 and len(answer["result"][1]["output_ids"]) == 4


def test_under_0_5_4_get_load_counts_requests_and_server_info_says_0_5_4(old_server):
    # 0.5.4 GetLoadReqOutput: num_reqs = running + waiting; only /get_server_info exists.
    url = old_server.url
    assert call(url, "/get_load") == (
        200,
        [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}],
    )
    assert call(url, "/get_server_info")[1]["version"] == "0.5.4"
    assert call(url, "/server_info")[0] == 404 and call(url, "/v1/loads")[0] == 404


def test_server_info_reports_the_version_and_the_memory_saver_flags(keyed_server):
    status, info = call(keyed_server.url, "/server_info", headers=BEARER)
    assert status == 200 and info["version"] == "0.5.23"
    assert info["enable_memory_saver"] is True and info["enable_weights_cpu_backup"] is False
    assert info["memory_saver_backend"] == "cpu"
    # Every server argument, both keys included, as SGLang 0.5.23 answers (server_args.py:316-333).
    assert info["api_key"] == API_KEY and info["admin_api_key"] == ADMIN_KEY


def test_weights_released_without_cpu_backup_come_back_different_and_health_stays_200(keyed_server):
    # torch_memory_saver throws away a region without a CPU backup: the resumed server serves
    # garbage and its 1-token health check still passes.
    url = keyed_server.url
    before = call(url, "/generate", request(16), headers=BEARER)[1]["output_ids"]
    checked = call(url, "/weights_checker", {"action": "checksum"}, headers=ADMIN)
    assert call(url, "/release_memory_occupation", {"tags": ["weights"]}, headers=ADMIN) == (200, None)
    assert call(url, "/resume_memory_occupation", {"tags": ["weights"]}, headers=ADMIN) == (200, None)
    status, after = call(url, "/generate", request(16), headers=BEARER)
    assert status == 200 and after["output_ids"] != before
    assert http_status(url + "/health_generate") == 200
    # Only /weights_checker tells (0.5.23 entrypoints/http_server.py:1599-1620).
    rechecked = call(url, "/weights_checker", {"action": "checksum"}, headers=ADMIN)
    assert checked[0] == rechecked[0] == 200 and checked[1]["success"] and rechecked[1]["success"]
    assert checked[1]["per_engine_checksum"] != rechecked[1]["per_engine_checksum"]
    assert call(url, "/weights_checker", {"action": "checksum"}, headers=ADMIN) == rechecked


def test_api_key_is_required_everywhere_but_health(keyed_server):
    # utils/auth.py (0.5.23): 401 {"error": "Unauthorized"}; /health*, /ready*, /metrics* stay open.
    url = keyed_server.url
    assert call(url, "/generate", request(2)) == (401, {"error": "Unauthorized"})
    wrong = {"Authorization": "Bearer nope"}
    assert call(url, "/generate", request(2), headers=wrong) == (401, {"error": "Unauthorized"})
    for path in ("/server_info", "/v1/loads", "/v1/models", "/flush_cache", "/no_such_path"):
        assert call(url, path)[0] == 401, path
    assert call(url, "/generate", request(2), headers=BEARER)[0] == 200
    assert call(url, "/generate", request(2), headers={"Authorization": f"bearer {API_KEY}"})[0] == 200
    assert http_status(url + "/health_generate") == 200 and http_status(url + "/health") == 200
    assert http_status(url + "/ready") == 200


def test_with_an_admin_key_only_it_opens_the_admin_endpoints_and_the_api_key_the_others(keyed_server):
    # utils/auth.py:133-151 (0.5.23): ADMIN_OPTIONAL endpoints take only the admin key when it is set;
    # normal endpoints take only the api key.
    url = keyed_server.url
    for path, body in (
        ("/flush_cache", {}),
        ("/pause_generation", {"mode": "retract"}),
        ("/continue_generation", {}),
        ("/weights_checker", {"action": "checksum"}),
    ):
        assert call(url, path, body, headers=BEARER) == (401, {"error": "Unauthorized"}), path
    assert call(url, "/release_memory_occupation", {"tags": ["kv_cache"]}, headers=BEARER)[0] == 401
    assert call(url, "/generate", request(2), headers=ADMIN)[0] == 401
    assert call(url, "/server_info", headers=ADMIN)[0] == 401
    assert call(url, "/flush_cache", {}, headers=ADMIN)[0] == 200
    assert call(url, "/weights_checker", {"action": "checksum"}, headers=ADMIN)[1]["success"] is True


def test_a_request_retracted_to_the_queue_longer_than_the_waiting_timeout_is_aborted_with_503(keyed_server):
    # SGLANG_REQ_WAITING_TIMEOUT (0.5.23 managers/scheduler.py:3605-3620): a request in the waiting
    # queue longer than that is aborted with status 503, also while the scheduler is paused.
    url = keyed_server.url
    worker, answer = in_background(url, request(2000), headers=BEARER)
    wait_until(lambda: running(url, BEARER) == 1, "the request running")
    assert call(url, "/pause_generation", {"mode": "retract"}, headers=ADMIN)[0] == 200
    began = time.monotonic()
    try:
        worker.join(120)
    finally:
        assert call(url, "/continue_generation", {}, headers=ADMIN)[0] == 200
    status, body = answer["result"]
    assert status == 503 and "Request waiting timeout reached." in body["message"]
    assert time.monotonic() - began >= WAITING_TIMEOUT_S - 0.5


def test_under_0_5_4_there_is_no_admin_key_and_no_weight_cache_mode(fixture_models, tmp_path):
    # Flags 0.5.4's argument parser does not know: the server does not start.
    for flags in (("--admin-api-key", "k"), ("--weight-cache-mode", "daemon")):
        with DevServerProcess(fixture_models.target, "--sglang-version", "0.5.4", *flags) as server:
            assert server.process.wait(60) == 2, flags
