"""specops.drafter.sglang_service as a host runs it, against the development server: states and the guard.

The development server runs from .venv-ml with the memory saver; every test starts its own server
through the module's process backend, so a test never inherits another's window. The tests that leave
the server as they found it (serving, no window held, no guard) share one for each set of flags, and each
first checks that it is so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from specops.devserver.launch import free_port, http_status


def urlopen_text(url: str) -> str:
    from urllib.request import urlopen

    with urlopen(url, timeout=30) as answer:
        return answer.read().decode()


sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_service_site import FIXTURES, KEYS, ML_PYTHON, Site, module_env, wait_for, window  # noqa: E402

pytestmark = pytest.mark.skipif(not ML_PYTHON.exists(), reason="needs the ML environment (.venv-ml)")

MEMORY_SAVER = ("--enable-memory-saver", "--enable-weights-cpu-backup")
# Ctrl-C ends it whoever started the suite: a shell's background job (make test started with `&`) passes
# SIGINT on ignored, and Python then installs no handler of its own.
SLEEPER = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); time.sleep(300)",
]


@pytest.fixture(scope="module", autouse=True)
def fixture_models():
    if not (FIXTURES / "target/config.json").exists():
        subprocess.run(
            [
                str(ML_PYTHON),
                "-c",
                "import sys; from specops.fixtures import build_fixtures; "
                "build_fixtures(sys.argv[1], train_reference=False)",
                str(FIXTURES),
            ],
            check=True,
            env=dict(os.environ, PYTHONPATH="src"),
            timeout=900,
        )


@pytest.fixture
def site_factory(tmp_path):
    sites: list[Site] = []

    def make(*flags: str, argv: list[str] | None = None, **options) -> Site:
        sites.append(Site(tmp_path / f"site{len(sites)}", *flags, argv=argv, **options))
        return sites[-1]

    yield make
    for site in sites:
        site.cleanup()


@pytest.fixture
def serving(site_factory) -> Site:
    """A server with the memory saver and both keys: the window (and the guard) open its admin endpoints with
    the admin key."""
    site = site_factory(*MEMORY_SAVER, keys=KEYS)
    started = site.run("started")
    assert started["changed"] and not started["failed"], started.get("msg")
    return site


@pytest.fixture(scope="module")
def shared_site(tmp_path_factory):
    """Servers shared by the tests that leave theirs as they found it (serving, no window held, no guard):
    one for each set of flags, started by the first test that asks for it; each test that asks checks
    first that it is so."""
    sites: dict[tuple, Site] = {}

    def get(*flags: str, keys: dict | None = None) -> Site:
        key = (flags, tuple(sorted((keys or {}).items())))
        if key not in sites:
            sites[key] = Site(tmp_path_factory.mktemp("shared"), *flags, keys=keys)
            started = sites[key].run("started")
            assert started["changed"] and not started["failed"], started.get("msg")
        site = sites[key]
        assert site.pid() is not None and http_status(site.url + "/health_generate") == 200
        assert not (site.state_dir / "window.lock").exists()
        assert not (site.state_dir / "guard.json").exists()
        return site

    yield get
    for site in sites.values():
        site.cleanup()


@pytest.fixture
def steady(shared_site) -> Site:
    """The shared server with the memory saver and both keys (the window opens its admin endpoints with the
    admin key)."""
    return shared_site(*MEMORY_SAVER, keys=KEYS)


def post(url: str, body: object = None) -> tuple[int, object]:
    """POST a JSON body (GET without one): the status and the decoded answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except (urllib.error.URLError, ConnectionError) as error:
        return -1, str(error)


def warned(result: dict) -> str:
    """The module's warnings, as text (ansible-core returns them as structured summaries)."""
    return json.dumps(result.get("warnings") or [])


# -- memory saver ----------------------------------------------------------------------------------
def test_released_then_resumed_keeps_the_pid_and_serves(steady):
    serving = steady
    pid = serving.pid()
    released = serving.run("released", window=window("w-keep"))
    assert released["changed"] and not released["failed"], released.get("msg")
    assert released["guard"]["armed"] and released["down_at"] and released["pause_mode"]

    resumed = serving.run("resumed", window=window("w-keep"))

    assert resumed["changed"] and not resumed["failed"], resumed.get("msg")
    assert serving.pid() == pid and resumed["pid"] == pid
    assert released["down_at"] < resumed["ready_at"] <= time.time()
    assert http_status(serving.url + "/health_generate") == 200
    assert (
        not (serving.state_dir / "window.lock").exists() and not (serving.state_dir / "guard.json").exists()
    )
    # The window's end is read with a 1-token /generate, not /health_generate, which SGLang answers only on
    # a whole second (the server's access log: resume, continue, then the module's one request).
    requests = re.findall(r'"(?:GET|POST) (/[a-z_]+)', serving.log.read_text())
    after_resume = requests[len(requests) - requests[::-1].index("/resume_memory_occupation") :]
    assert after_resume[:2] == ["/continue_generation", "/generate"], after_resume
    # The weights proven after the resume (/weights_checker, SGLang 0.5.23).
    assert resumed["weights_check"]["matched"] is True and resumed["weights_check"]["before"]
    # Neither key in what the module returned or left on the host (the server's own log aside: SGLang logs
    # its arguments, keys included, at start).
    files = [p for p in serving.root.rglob("*") if p.is_file() and p != serving.log]
    written = [p.read_text(errors="replace") for p in files]
    for text in [json.dumps(released), json.dumps(resumed), *written]:
        assert KEYS["api_key"] not in text and KEYS["admin_api_key"] not in text


def test_weights_without_cpu_backup_are_refused_and_weights_changed_inside_the_window_are_restarted(
    site_factory,
):
    site = site_factory("--enable-memory-saver")  # no CPU backup: weights released here come back scrambled
    assert not site.run("started")["failed"]
    pid = site.pid()

    refused = site.run("released", window=window("w-nobackup"), release="all")

    assert refused["failed"] and "--enable-weights-cpu-backup" in refused["msg"]
    assert "garbage" in refused["msg"] and "sglang_service_release: kv_cache" in refused["msg"]
    assert not (site.state_dir / "window.lock").exists() and not (site.state_dir / "released.json").exists()
    # Not paused: a paused server answers /health_generate 503.
    assert http_status(site.url + "/health_generate") == 200

    # /health_generate says 200 with garbage weights; /weights_checker does not (0.5.23 http_server.py:1599).
    released = site.run("released", window=window("w-weights"), tags=["kv_cache"])
    assert released["changed"], released.get("msg")
    # Inside the window something else releases and resumes the weights (the server is paused and idle).
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        assert post(site.url + path, {"tags": ["weights"]})[0] == 200, path

    resumed = site.run("resumed", window=window("w-weights"))

    check = resumed["weights_check"]
    assert not resumed["failed"], resumed.get("msg")
    assert check["matched"] is False and check["restarted"] is True
    assert check["after_restart"] == check["before"]
    assert site.pid() not in (None, pid) and http_status(site.url + "/health_generate") == 200
    assert "restarted to load its weights from disk" in warned(resumed)


def test_a_weight_cache_or_a_waiting_timeout_the_window_would_outlast_is_refused_before_anything(
    site_factory,
):
    # --weight-cache-mode other than off: a release including weights raises in the scheduler and the
    # server dies (0.5.23 weight_updater.py:293-307, 368-369). SGLANG_REQ_WAITING_TIMEOUT aborts the
    # requests retracted at the pause with 503 once they waited that long (0.5.23 scheduler.py:3605-3620).
    site = site_factory(
        *MEMORY_SAVER, "--weight-cache-mode", "daemon", environment={"SGLANG_REQ_WAITING_TIMEOUT": "30"}
    )
    assert not site.run("started")["failed"]

    cached = site.run("released", window=window("w-refused", planned_seconds=10))
    waiting = site.run("released", window=window("w-refused", planned_seconds=45), tags=["kv_cache"])

    assert cached["failed"] and "--weight-cache-mode daemon" in cached["msg"], cached.get("msg")
    assert "sglang_service_release: kv_cache" in cached["msg"]
    assert waiting["failed"] and "SGLANG_REQ_WAITING_TIMEOUT=30" in waiting["msg"], waiting.get("msg")
    assert "45 s" in waiting["msg"] and waiting["waiting_timeout"]["seconds"] == 30
    # Both at once: one refusal names each, numbered, so one refused run shows everything to fix.
    both = site.run("released", window=window("w-refused", planned_seconds=45))
    assert both["failed"] and both["msg"].startswith("2 problems, each to fix: (1) "), both.get("msg")
    assert re.search(
        r"\(1\) [^;]*SGLANG_REQ_WAITING_TIMEOUT=30.*; \(2\) [^;]*--weight-cache-mode daemon", both["msg"]
    )
    assert not (site.state_dir / "window.lock").exists() and not (site.state_dir / "released.json").exists()
    assert http_status(site.url + "/ready") == 200  # not paused
    # Planned within the timeout, the guard allowing more: released, with a warning that gives both figures.
    released = site.run(
        "released", window=window("w-within", planned_seconds=10, max_downtime=600), tags=["kv_cache"]
    )
    assert released["changed"] and not released["failed"], released.get("msg")
    assert "SGLANG_REQ_WAITING_TIMEOUT=30" in warned(released) and "(the guard allows 600 s)" in warned(
        released
    )
    assert not site.run("resumed", window=window("w-within"))["failed"]
    # What the first refusal spares: a release of the weights takes the whole server down.
    pid = site.pid()
    post(site.url + "/release_memory_occupation", {})
    assert wait_for(lambda: site.pid() is None, 60) and not Path(f"/proc/{pid}").exists()
    assert "weight cache" in site.log.read_text()


def test_under_0_5_4_a_release_is_refused_unless_drained_or_the_abort_risk_is_accepted(shared_site):
    # sglang 0.5.4 tokenizer_manager.py:1090-1093: the pause aborts every request, also one admitted after
    # /get_load read 0 (scheduler.py:2363-2385 counts only what the scheduler holds). Also the server of
    # test_each_sglang_version_releases_its_own_tags_that_keep_the_weights for 0.5.4.
    site = shared_site(*MEMORY_SAVER, "--device-memory-gib", "24", "--sglang-version", "0.5.4")
    pid = site.pid()

    refused = site.run("released", window=window("w-054"))

    assert refused["failed"] and "0.5.4" in refused["msg"], refused.get("msg")
    assert "sglang_service_accept_abort_pause" in refused["msg"] and "router" in refused["msg"]
    assert not (site.state_dir / "window.lock").exists() and http_status(site.url + "/health_generate") == 200
    accepted = site.run("released", window=window("w-054"), accept_abort_pause=True)
    assert accepted["changed"] and accepted["pause_mode"] == "drain then abort", accepted.get("msg")
    assert "accepted" in accepted["abort_pause"]
    resumed = site.run("resumed", window=window("w-054"))
    assert not resumed["failed"] and "weights_check" not in resumed, resumed  # 0.5.4 has no /weights_checker
    assert site.pid() == pid and not (site.state_dir / "window.lock").exists()


def test_a_constrained_request_in_the_grammar_queue_at_the_pause_is_let_through_not_released_under(
    site_factory,
):
    # The grammar queue drains only while scheduling (0.5.23 scheduler.py:4084-4088) and a release with it
    # not empty kills the server (:5369-5372): the window continues, lets it through, and pauses again.
    compile_s = 8  # a margin for the module to reach its pause while the grammar compiles
    site = site_factory(*MEMORY_SAVER, "--grammar-compile-delay", str(compile_s))
    assert not site.run("started")["failed"]
    pid = site.pid()
    body = {
        "input_ids": [318, 293, 342],
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "json_schema": "{}"},
    }
    answer: dict = {}
    request = threading.Thread(target=lambda: answer.update(result=post(site.url + "/generate", body)))
    request.start()
    assert wait_for(lambda: post(site.url + "/v1/loads")[1]["loads"][0]["queues"]["grammar"] == 1, 60)
    sent = time.monotonic()

    released = site.run("released", window=window("w-grammar"), drain_timeout=120)

    assert released["changed"] and not released["failed"], released.get("msg")
    assert site.pid() == pid
    log = site.log.read_text()
    assert log.count("POST /pause_generation") == 2, "paused after the grammar compiled: " + log[-3000:]
    assert log.index("POST /continue_generation") > log.index("POST /pause_generation")
    assert time.monotonic() - sent >= compile_s - 1
    assert not site.run("resumed", window=window("w-grammar"))["failed"]
    request.join(120)
    status, result = answer["result"]
    assert status == 200 and len(result["output_ids"]) == 6


# -- the memory plan: what the release frees ---------------------------------------------------------
# The extraction of a target of about 2 GiB: room on a simulated 24 GiB device beside the weights, none
# on a 2 GiB one (its KV pool of 1.7 GiB is all a KV release frees).
EXTRACTION = {"copy_bytes": 2 << 30, "body_bytes": 2 << 30, "reserve_bytes": 1 << 30}


def test_the_weights_stay_on_the_gpu_where_the_extraction_fits_beside_them(shared_site):
    # Also the server of test_each_sglang_version_releases_its_own_tags_that_keep_the_weights for 0.5.23.
    site = shared_site(*MEMORY_SAVER, "--device-memory-gib", "24", "--sglang-version", "0.5.23")

    released = site.run("released", window=window("w-kv"), extraction_gpu=EXTRACTION, gpu_reserve_mib=512)

    assert released["changed"] and not released["failed"], released.get("msg")
    plan = released["memory_plan"]
    assert plan["choice"] == "kv_cache" and released["released_tags"] == ["kv_cache", "cuda_graph"]
    assert plan["fits_beside_weights"] and "weights stay on the GPU" in plan["reason"]
    # The server's own accounting, as SGLang 0.5.23 reports it (weights, KV pool, graphs, free).
    assert plan["server"]["kv_cache_mib"] > 20000 and "available_mib" in plan["server"]
    info = json.loads(urlopen_text(site.url + "/server_info"))
    assert info["internal_states"][0]["released_memory_tags"] == ["cuda_graph", "kv_cache"]
    resumed = site.run("resumed", window=window("w-kv"))
    assert resumed["changed"] and not resumed["failed"], resumed.get("msg")
    assert not (site.state_dir / "window.lock").exists()


@pytest.mark.parametrize(
    "end",
    ["result written", "result read and removed", "extraction finished", "play lost after the work ended"],
)
def test_the_guard_resumes_the_moment_the_windows_work_has_ended_and_the_play_finds_it_serving(
    serving, tmp_path, end
):
    """One step on the host: the release tells the waiting work to go, the guard resumes when its job's
    result appears (or, read by the play's wait first, is gone), or when the extraction says finished
    while its process still exits; the play's resume finds the server serving and reports the guard's
    first 200. A play lost after the work ended never takes the window back: the next run that brings the
    server up finds the window on its record as an outage."""
    go, job = tmp_path / "extract.start", tmp_path / "job.json"
    state = tmp_path / "extract.start.state"
    go.write_text(json.dumps({"signal": "wait", "until": time.time() + 600}))
    job.write_text(json.dumps({"started": 1, "finished": 0}))
    state.write_text(json.dumps({"state": "waiting", "pid": 1}))
    released = serving.run(
        "released", window=window("w-done"), go_file=str(go), resume_when_done=[str(job), str(state)]
    )
    assert not released["failed"], released.get("msg")
    assert json.loads(go.read_text())["signal"] == "go" and released["go_at"] >= released["released_at"]
    assert http_status(serving.url + "/health_generate", timeout=5) != 200  # paused and released

    if end in ("result written", "play lost after the work ended"):
        # The work's end, as the async job writes it.
        job.write_text(json.dumps({"changed": True, "finished": 1}))
    elif end == "result read and removed":
        job.unlink()  # job_wait's cleanup, when it read the end before the guard looked
    else:
        # Outputs written, device memory given back; the job runs on while the process exits.
        state.write_text(json.dumps({"state": "finished", "finished_at": time.time(), "pid": 1}))
    assert wait_for(lambda: (serving.state_dir / "guard.result.json").exists(), 120)
    assert http_status(serving.url + "/health_generate") == 200
    if end == "play lost after the work ended":
        rerun = serving.run("started")
        (outage,) = rerun["earlier_outages"]
        assert "end of the window's work" in outage["cause"] and "never took it back" in outage["cause"]
        assert outage["down_at"] <= outage["ready_at"] and not outage["failed"]
    resumed = serving.run("resumed", window=window("w-done"))

    assert not resumed["failed"], resumed.get("msg")
    # The play took its window back: the guard's record of it as an outage is gone.
    assert resumed["earlier_outages"] == [] and not list((serving.state_dir / "outages").glob("*.json"))
    assert resumed["resumed_by"] == "guard, at the end of the window's work"
    assert released["go_at"] <= resumed["resume_started_at"] <= resumed["ready_at"]
    assert not (serving.state_dir / "window.lock").exists()
    assert not (serving.state_dir / "released.json").exists()


def test_the_window_in_one_step_releases_lets_the_work_go_hears_its_end_and_returns_serving(
    serving, tmp_path
):
    """State window: one module call releases, tells the waiting work go, hears the work's "finished" (no
    task of the play in between), lets the guard resume at that moment, proves the server serves, gives the
    window back and returns each stage's seconds on the host's clock."""
    go, job = tmp_path / "extract.start", tmp_path / "job.json"
    state = tmp_path / "extract.start.state"
    go.write_text(json.dumps({"signal": "wait", "until": time.time() + 600}))
    job.write_text(json.dumps({"started": 1, "finished": 0}))
    state.write_text(json.dumps({"state": "waiting", "pid": 1}))
    finished_at = []

    def work() -> None:
        # The prestarted work: it waits for go, runs a moment, says finished (atomically, as it does).
        assert wait_for(lambda: json.loads(go.read_text())["signal"] == "go", 300, step=0.05)
        time.sleep(0.5)
        finished_at.append(time.time())
        partial = state.with_name(state.name + ".tmp")
        partial.write_text(json.dumps({"state": "finished", "at": finished_at[0], "pid": 1}))
        os.replace(partial, state)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    result = serving.run(
        "window", window=window("w-one"), go_file=str(go), resume_when_done=[str(job), str(state)]
    )
    worker.join(timeout=60)

    assert not result["failed"], result.get("msg")
    assert result["resumed_by"] == "guard, at the end of the window's work"
    assert result["work_finished_at"] == finished_at[0]
    assert result["down_at"] <= result["released_at"] <= result["go_at"] <= finished_at[0]
    assert finished_at[0] <= result["resume_started_at"] <= result["ready_at"]
    stages = result["stages"]
    assert stages["work_s"] >= 0.5 and set(stages) == {
        "pause_and_release_s",
        "memory_check_to_go_s",
        "work_s",
        "heard_to_resume_s",
        "resume_to_ready_s",
        "downtime_s",
    }, stages
    assert abs(sum(v for k, v in stages.items() if k != "downtime_s") - stages["downtime_s"]) < 0.01, stages
    assert http_status(serving.url + "/health_generate") == 200
    assert not (serving.state_dir / "window.lock").exists()
    assert not (serving.state_dir / "released.json").exists()
    assert not (serving.state_dir / "guard.armed").exists()


def test_the_window_in_one_step_without_its_works_end_is_refused_before_the_pause(steady):
    """Without resume_when_done nothing would say when to resume: refused while the server serves."""
    result = steady.run("window", window=window("w-no-end"))
    assert result["failed"] and "state window needs resume_when_done" in result["msg"], result
    assert http_status(steady.url + "/health_generate") == 200
    assert (
        not (steady.state_dir / "window.lock").exists() and not (steady.state_dir / "released.json").exists()
    )


def test_a_device_too_small_for_weights_and_extraction_releases_every_tag_and_says_why(shared_site):
    site = shared_site(*MEMORY_SAVER, "--device-memory-gib", "2")
    pid = site.pid()

    released = site.run("released", window=window("w-all"), extraction_gpu=EXTRACTION, gpu_reserve_mib=512)

    assert released["changed"] and not released["failed"], released.get("msg")
    plan = released["memory_plan"]
    assert plan["choice"] == "all" and released["released_tags"] == []
    assert "does not fit beside the weights" in plan["reason"]
    assert not site.run("resumed", window=window("w-all"))["failed"]
    assert site.pid() == pid and not (site.state_dir / "window.lock").exists()


def test_a_forced_kv_release_that_cannot_fit_is_refused_before_the_pause(shared_site):
    site = shared_site(*MEMORY_SAVER, "--device-memory-gib", "2")

    refused = site.run(
        "released",
        window=window("w-forced"),
        extraction_gpu=EXTRACTION,
        gpu_reserve_mib=512,
        release="kv_cache",
    )

    assert refused["failed"] and "sglang_service_release=kv_cache cannot work" in refused["msg"]
    assert "MiB" in refused["msg"] and refused["memory_plan"]["fits_beside_weights"] is False
    assert not (site.state_dir / "window.lock").exists() and not (site.state_dir / "released.json").exists()
    assert http_status(site.url + "/health_generate") == 200


def fake_nvidia_smi(bin_dir: Path, total_mib: int, used_mib: int) -> dict:
    """An environment whose nvidia-smi reports one GPU (0.5.4 reports no free memory of its own)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--query-gpu=index,memory.total,memory.used*) '
        f'echo "0, {total_mib}, {used_mib}"; exit 0;; esac\nexit 9\n'
    )
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.mark.parametrize(
    ("version", "tags"), [("0.5.23", ["kv_cache", "cuda_graph"]), ("0.5.4", ["kv_cache"])]
)
def test_each_sglang_version_releases_its_own_tags_that_keep_the_weights(
    shared_site, tmp_path, version, tags
):
    # Check mode changes nothing: the servers of the weights staying on the GPU (0.5.23) and of the
    # abort-only pause (0.5.4).
    site = shared_site(*MEMORY_SAVER, "--device-memory-gib", "24", "--sglang-version", version)
    gpu = fake_nvidia_smi(tmp_path / "bin", 24576, 23000)

    # 0.5.4's abort-only pause is refused unless the operator accepts it or the host was drained.
    accept = {"accept_abort_pause": True} if version == "0.5.4" else {}
    answer = site.run(
        "released", check=True, env=gpu, extraction_gpu=EXTRACTION, gpu_reserve_mib=512, **accept
    )
    plan = answer["memory_plan"]

    assert plan["choice"] == "kv_cache" and plan["tags"] == tags, plan
    assert plan["gpus"] == [{"index": "0", "total_mib": 24576, "used_mib": 23000}]
    assert plan["source"].startswith("nvidia-smi")


class FakeSglang(BaseHTTPRequestHandler):
    """SGLang 0.5.23 as far as a release goes, with a pause that fails; records every call."""

    calls: list[tuple[str, object]] = []

    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.calls.append((self.path, None))
        if self.path in ("/server_info", "/get_server_info"):
            self._answer(
                200, {"version": "0.5.23", "enable_memory_saver": True, "enable_weights_cpu_backup": True}
            )
        else:
            self._answer(200, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        self.calls.append((self.path, body))
        self._answer(500 if self.path == "/pause_generation" else 200, {"error": "scheduler is gone"})


def test_a_pause_that_fails_is_continued_and_the_window_given_back(site_factory):
    FakeSglang.calls = []
    server = HTTPServer(("127.0.0.1", free_port()), FakeSglang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    site = site_factory(argv=SLEEPER)
    try:
        failed = site.run("released", url=f"http://127.0.0.1:{server.server_port}", window=window("w-pause"))
    finally:
        server.shutdown()

    posts = [(path, body) for path, body in FakeSglang.calls if body is not None]
    # The weights' checksum is asked for while the server still serves, before the pause.
    assert posts[0] == ("/weights_checker", {"action": "checksum"})
    posts = posts[1:]
    assert (
        failed["failed"] and "pause_generation" in failed["msg"] and "generation continued" in failed["msg"]
    )
    assert posts[0] == ("/pause_generation", {"mode": "retract"})
    assert ("/continue_generation", {}) in posts and not any("release" in path for path, _ in posts)
    assert not (site.state_dir / "window.lock").exists() and not (site.state_dir / "released.json").exists()


# -- the window lock -------------------------------------------------------------------------------
def test_a_second_runs_window_is_refused_naming_the_holder(steady):
    serving = steady
    pid = serving.pid()
    first = serving.run("released", window=window("w-first"))
    assert first["changed"] and not first["failed"], first.get("msg")

    second = serving.run("stopped", window=window("w-second"))

    assert second["failed"] and "test run w-first" in second["msg"]
    assert second["window_holder"]["token"] == "w-first"
    assert serving.pid() == pid
    assert not serving.run("resumed", window=window("w-first"))["failed"]
    assert serving.pid() == pid and not (serving.state_dir / "window.lock").exists()


# -- the guard -------------------------------------------------------------------------------------
def test_the_guard_fires_after_the_operators_max_downtime_when_it_is_shorter_than_planned(serving):
    before = serving.pid()
    armed = time.monotonic()
    stopped = serving.run("stopped", window=window("w-bound", guard_after=600, max_downtime=2))
    assert stopped["changed"] and stopped["guard"]["fires_in"] == 2

    # Bounds, not expectations, well short of the planned 600 s: the operator's 2 s is what fired it.
    assert wait_for(lambda: serving.pid() not in (None, before), 300), serving.guard_log()
    assert time.monotonic() - armed < 300
    assert "max_downtime" in serving.guard_log()
    assert wait_for(lambda: http_status(serving.url + "/health_generate") == 200, 600)
    assert not (serving.state_dir / "window.lock").exists()


def test_the_guards_resume_after_the_server_was_killed_starts_it(serving):
    released = serving.run("released", window=window("w-killed", max_downtime=8))
    assert released["changed"], released.get("msg")
    killed = serving.pid()
    os.killpg(killed, signal.SIGKILL)

    assert wait_for(lambda: serving.pid() not in (None, killed), 300), serving.guard_log()
    assert wait_for(lambda: http_status(serving.url + "/health_generate") == 200, 600)
    assert "started_pid" in serving.guard_log() and not (serving.state_dir / "released.json").exists()


def test_exactly_one_resume_when_the_play_and_the_guard_race(serving):
    pid = serving.pid()
    released = serving.run("released", window=window("w-race", max_downtime=1))
    assert released["changed"], released.get("msg")

    resumed = serving.run("resumed", window=window("w-race"))

    assert not resumed["failed"], resumed.get("msg")
    assert wait_for(
        lambda: "guard" in serving.guard_log() or not (serving.state_dir / "guard.json").exists(), 120
    )
    time.sleep(2)
    assert serving.pid() == pid, (
        "a second resume would have crashed the scheduler:\n" + serving.log.read_text()
    )
    assert http_status(serving.url + "/health_generate") == 200


def test_the_guard_fires_soon_after_the_windows_work_is_gone(serving):
    token = "w-work"
    work = subprocess.Popen(SLEEPER, env={**os.environ, "SPECOPS_WINDOW_TOKEN": token})
    # Planned downtime and the operator's bound an hour away: only the work's end can make it fire.
    stopped = serving.run(
        "stopped",
        window=window(token, guard_grace=1, guard_after=3600, max_downtime=3600),
        env=module_env(SPECOPS_WINDOW_TOKEN=token),
    )
    assert stopped["changed"], stopped.get("msg")
    time.sleep(3)
    assert serving.pid() is None, "the guard must wait while the window's work runs"

    work.send_signal(signal.SIGINT)
    work.wait(120)

    # Bounds, not expectations: a loaded machine stretches the guard's look and the server's launch.
    assert wait_for(lambda: serving.pid() is not None, 600), serving.guard_log()
    assert "window's work is gone" in serving.guard_log()


def test_a_windows_start_that_fails_arms_the_guard_again(serving):
    stopped = serving.run("stopped", window=window("w-again", max_downtime=600))
    assert stopped["changed"] and serving.pid() is None
    crashing = dict(serving.args("started")["spec"], argv=[sys.executable, "-c", "import sys; sys.exit(3)"])

    failed = serving.run("started", window=window("w-again", max_downtime=600), spec=crashing)

    assert failed["failed"] and "the guard is armed again" in failed["msg"], failed.get("msg")
    guard = failed["guard"]["pid"]
    assert Path(f"/proc/{guard}").exists() and _state(guard) != "Z"
    assert json.loads((serving.state_dir / "window.lock").read_text())["token"] == "w-again"
    # The play's next start (its rerun) takes over from that guard and ends the window.
    started = serving.run("started", window=window("w-again"))
    assert not started["failed"] and started["guard"]["disarmed"] is True, started.get("msg")
    assert not (serving.state_dir / "window.lock").exists()


def test_a_disarmed_guard_never_acts(serving):
    stopped = serving.run("stopped", window=window("w-disarm", max_downtime=600))
    assert stopped["changed"] and serving.pid() is None
    guard = stopped["guard"]["pid"]

    started = serving.run("started", window=window("w-disarm"))

    assert started["guard"]["disarmed"] is True
    # The window's own start finds the server down by design: nothing to announce.
    assert started["found_down"] is False
    assert wait_for(lambda: not Path(f"/proc/{guard}").exists() or _state(guard) == "Z", 120)
    assert "fired" not in serving.guard_log()
    assert not (serving.state_dir / "window.lock").exists()


# -- check mode ------------------------------------------------------------------------------------
def _files(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under a directory with its size and modification time."""
    if not directory.exists():
        return {}
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*") if p.is_file()}


def test_check_mode_writes_nothing(steady):
    serving = steady
    # The serving server's state (its process tree, from the real start) stays exactly as it was.
    before = _files(serving.state_dir)
    for state in ("released", "stopped", "restarted"):
        planned = serving.run(state, check=True, window=window("w-check"))
        assert planned["changed"] and not planned["failed"], planned.get("msg")
    assert _files(serving.state_dir) == before
    assert http_status(serving.url + "/health_generate") == 200


# -- the process, readiness and the port -----------------------------------------------------------
def test_a_second_start_with_the_same_spec_changes_nothing(steady):
    serving = steady
    pid = serving.pid()
    again = serving.run("started")
    assert again["changed"] is False and again["pid"] == pid and again["found_down"] is False


def test_a_server_found_dead_outside_a_window_is_started_and_said_to_be_found_down(serving):
    killed = serving.pid()
    os.killpg(killed, signal.SIGKILL)
    assert wait_for(lambda: serving.pid() is None, 60)

    planned = serving.run("started", check=True)
    started = serving.run("started")

    assert planned["changed"] and planned["found_down"] and planned["pid"] is None
    assert started["changed"] and started["found_down"] and not started["failed"], started.get("msg")
    assert started["pid"] not in (None, killed) and http_status(serving.url + "/health_generate") == 200


def test_stop_ends_every_process_of_the_servers_tree_and_records_it(site_factory):
    forker = [
        sys.executable,
        "-c",
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)",
    ]
    site = site_factory(argv=forker)
    site.argv = forker
    spec = site.args("started")["spec"]
    from ansible_collections.specops.drafter.plugins.module_utils.service.service_process import ProcessServer

    server = ProcessServer(spec)
    pid = server.launch()
    time.sleep(1)
    stopped = site.run("stopped", window=window("w-tree"), guard=False)

    recorded = json.loads(Path(stopped["recorded_tree"]).read_text())
    assert stopped["changed"] and len(recorded) == 2 and recorded[0]["pid"] == pid
    assert all(
        not Path(f"/proc/{entry['pid']}").exists() or _state(entry["pid"]) == "Z" for entry in recorded
    )


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_started_refuses_an_answer_from_a_process_that_is_not_ours_and_names_the_port_holder(site_factory):
    site = site_factory(*MEMORY_SAVER)
    with subprocess.Popen(
        [
            str(ML_PYTHON),
            "-m",
            "specops.devserver",
            "--model-path",
            str(FIXTURES / "target"),
            "--port",
            str(site.port),
        ],
        env=dict(os.environ, PYTHONPATH="src"),
    ) as stranger:
        try:
            assert wait_for(lambda: http_status(site.url + "/health_generate") == 200, 120)
            refused = site.run("started")
        finally:
            stranger.terminate()
    assert refused["failed"] and refused["port_holder"] == stranger.pid
    assert f"pid {stranger.pid}" in refused["msg"] and site.pid() is None


def test_a_start_with_settings_that_cannot_start_names_the_setting(site_factory, tmp_path):
    site = site_factory(
        argv=[sys.executable, "-m", "json.tool", "--model-path", str(tmp_path / "Qwen3.6-27b")]
    )
    refused = site.run("started")
    assert (
        refused["failed"]
        and "sglang_service_model_path" in refused["msg"]
        and "does not exist" in refused["msg"]
    )


def test_the_guard_waits_for_the_windows_work_to_leave_the_gpu(tmp_path, monkeypatch):
    """A killed CUDA process is listed by nvidia-smi until the driver has freed its memory: the guard's
    resume waits for that (a resume that cannot allocate kills SGLang), and gives up at its bound."""
    from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
    from ansible_collections.specops.drafter.plugins.module_utils.window.guard import wait_work_memory_freed

    work = subprocess.Popen(SLEEPER)
    known = [(work.pid, procfs.start_time(work.pid))]
    listed = tmp_path / "listed"
    listed.write_text("")
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\n[ -e {listed} ] && echo {work.pid}\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    work.kill()
    work.wait()

    assert wait_work_memory_freed(known, 0.5)["holding_gpu"] == [work.pid]
    threading.Timer(1.5, listed.unlink).start()
    began = time.monotonic()
    freed = wait_work_memory_freed(known, 120)
    assert freed["freed"] and freed["gpu_checked"] and time.monotonic() - began >= 1.5
