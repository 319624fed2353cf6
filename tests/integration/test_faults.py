"""Faults injected into eval.yml on the local default (docs/faults.md): each ends with the service answering,
the data intact or repaired, and a message that names the stage and the cause."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def serving(served):
    """The server up, for faults the play refuses before the window: the shared finished run's site."""
    assert served.health_generate_status() == 200
    return served


@pytest.fixture(scope="module")
def refused_run_dir(serving) -> str:
    """One run directory for the refused runs: it starts with the finished run's completions, so each play
    goes straight to the extraction's plan; nothing else is written."""
    return str(serving.seed_run_dir(serving.run_dir, serving.work_dir / "run-refused"))


def said(result) -> str:
    """The play's output as one line: long messages are folded when printed."""
    return " ".join(result.output.split()).replace("''", "'")  # YAML doubles quotes inside quotes


def copy_drafter(site, tmp_path, **dflash) -> Path:
    drafter = tmp_path / "drafter"
    shutil.copytree(site.models_dir / "drafter", drafter)
    config = json.loads((drafter / "config.json").read_text())
    for key, value in dflash.items():
        (config["dflash_config"] if key == "mask_token_id" else config)[key] = value
    (drafter / "config.json").write_text(json.dumps(config))
    return drafter


def assert_refused_before_the_window(site, result, pid_before, *causes):
    assert result.rc != 0
    assert "specops stage 'extract' failed" in said(result), result.output[-4000:]
    for cause in causes:
        assert cause in said(result), result.output[-4000:]
    assert "(the service was not taken down)" in said(result)
    assert site.server_pid() == pid_before  # the window stops the server: a new process afterwards
    assert site.health_generate_status() == 200


# Every cause the extraction's plan refuses is tested in detail on the stage
# (tests/unit/test_extract_faults.py and test_extract.py); these show the play's side: refused before the
# window, the server untouched. The plan names every problem it finds at once, so one play shows four.
def test_every_problem_the_plan_finds_is_named_at_once_before_the_window(serving, refused_run_dir, tmp_path):
    drafter = copy_drafter(serving, tmp_path, mask_token_id=10**6, vocab_size=123457)
    # The reserve makes the output's file system too small for the shards, whatever its real size.
    free = shutil.disk_usage(tmp_path).free
    pid = serving.server_pid()
    result = serving.play(
        "eval.yml",
        specops_run_dir=refused_run_dir,
        specops_drafter=str(drafter),
        extract_hidden_states_require_backend="fla",
        extract_hidden_states_disk_reserve_bytes=free,
    )
    assert_refused_before_the_window(serving, result, pid, "4 problems, each to fix")
    for number, pattern in enumerate(
        (
            rf"{re.escape(str(drafter))}/config\.json: vocab_size 123457 differs from the target's",
            r"mask_token_id 1000000 is out of range",
            r"require_backend is fla",
            r"not enough disk space.*the hidden states need \d+\.\d\d [KM]iB",
        ),
        1,
    ):
        assert re.search(rf"\({number}\) [^;]*{pattern}", said(result)), result.output[-4000:]


def test_a_drafter_config_that_is_not_json_is_named_before_the_window(serving, refused_run_dir, tmp_path):
    drafter = copy_drafter(serving, tmp_path)
    (drafter / "config.json").write_text('{"dflash_config": {')
    pid = serving.server_pid()
    result = serving.play("eval.yml", specops_run_dir=refused_run_dir, specops_drafter=str(drafter))
    assert_refused_before_the_window(
        serving, result, pid, f"drafter config {drafter}/config.json is not valid JSON"
    )
    assert "the request is not JSON" not in said(result)  # the file is named, not blamed on a request


# Where the server listens and where it is checked, refused at `serve` while it serves: no stop, no guard,
# no one else's process named. 192.0.2.1 (TEST-NET-1, RFC 5737) is no interface of any host.
def unbindable_host(site):
    return {"sglang_service_host": "192.0.2.1"}, [
        "sglang_service_host 192.0.2.1: the server cannot listen there"
    ]


def url_of_another_host(site):
    url = f"http://192.0.2.1:{site.port}"
    return {"sglang_service_url": url}, [f"sglang_service_url {url} names 192.0.2.1, which is not this host"]


def url_of_another_port(site):
    # Another tenant listens there: the checks must not reach it, nor blame it.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        other = probe.getsockname()[1]
    url = f"http://127.0.0.1:{other}"
    return {"sglang_service_url": url, "tenant_port": other}, [
        f"names port {other} but the server listens on {site.port}"
    ]


@pytest.mark.parametrize(
    "fault", [unbindable_host, url_of_another_host, url_of_another_port], ids=lambda fault: fault.__name__
)
def test_where_the_server_listens_and_is_checked_is_refused_before_it_is_touched(
    serving, refused_run_dir, fault
):
    extra_vars, patterns = fault(serving)
    tenant_port = extra_vars.pop("tenant_port", None)
    tenant = None
    if tenant_port is not None:
        tenant = subprocess.Popen(
            [sys.executable, "-c", FOREIGN_LISTENER, str(tenant_port)], stdout=subprocess.PIPE, text=True
        )
        assert tenant.stdout.readline().strip() == "listening"
    try:
        pid = serving.server_pid()
        # The stages up to `serve` (its tag): the refusal comes there.
        result = serving.play(
            "eval.yml", specops_run_dir=refused_run_dir, args=("--tags", "prefetch"), **extra_vars
        )
        assert result.rc != 0
        assert "specops stage 'serve' failed" in said(result), result.output[-4000:]
        for pattern in patterns:
            assert pattern in said(result), result.output[-4000:]
        assert "(the service was not taken down)" in said(result)
        assert "held by pid" not in said(result)  # no other process is blamed
        assert serving.server_pid() == pid and serving.health_generate_status() == 200
        assert (
            guard_processes(serving) == [] and not (serving.work_dir / "sglang.pid.d" / "guard.json").exists()
        )
        if tenant is not None:
            assert tenant.poll() is None
    finally:
        if tenant is not None:
            tenant.terminate()
            tenant.wait(timeout=30)


def test_a_max_downtime_shorter_than_the_extraction_is_refused_before_the_window(serving, refused_run_dir):
    pid = serving.server_pid()
    result = serving.play("eval.yml", specops_run_dir=refused_run_dir, sglang_service_max_downtime=5)
    assert_refused_before_the_window(serving, result, pid, "guard would restart the server after 5 s")


def test_a_second_run_on_a_locked_run_directory_fails_at_once_naming_the_holder(serving, tmp_path):
    run_dir = tmp_path / "run"
    lock = run_dir / ".specops.lock"
    # The first run's lock, taken as eval.yml takes it.
    holder = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible"),
            "localhost",
            "-m",
            "specops.drafter.run_lock",
            "-a",
            json.dumps({"path": str(lock), "owner": {"playbook": "the first run"}}),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_LOCALHOST_WARNING": "false"},
    )
    assert holder.returncode == 0, holder.stdout + holder.stderr
    recorded = json.loads(lock.read_text())
    try:
        pid = serving.server_pid()
        result = serving.play("eval.yml", specops_run_dir=str(run_dir))
        assert result.rc != 0
        assert "specops stage 'lock' failed" in said(result)
        holder = f"pid {recorded['pid']} on host {recorded['host']} since {recorded['started']}"
        assert holder in said(result)
        assert "playbook the first run" in said(result)
        assert "(the service was not taken down)" in said(result)
        assert serving.server_pid() == pid and serving.health_generate_status() == 200
        assert sorted(p.name for p in run_dir.iterdir()) == [".specops.lock"]  # nothing else was touched
    finally:
        os.kill(recorded["pid"], signal.SIGTERM)


def test_completions_refetched_with_the_same_tokens_keep_the_service_up(served):
    # Without its manifest the prefetch fetches everything again: other latencies and request ids.
    completions = served.run_dir / "completions"
    before = (completions / "completions.jsonl").read_bytes()
    (completions / "manifest.json").unlink()
    pid = served.server_pid()
    # Up to the extraction's plan, which finds the hidden states still up to date: the next test's full
    # run scores again on the refetched completions.
    result = served.play("eval.yml", args=("--tags", "prefetch,extract"))
    assert result.rc == 0, result.output[-6000:]
    assert (completions / "completions.jsonl").read_bytes() != before
    assert served.server_pid() == pid and served.health_generate_status() == 200


def test_an_edited_token_id_is_refetched_and_the_report_rebuilt_on_the_fetched_tokens(served):
    path = served.run_dir / "completions" / "completions.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    fetched = json.loads(lines[0])
    record = dict(fetched)
    token = record["output_ids"][0]
    record["output_ids"] = [token - token % 10 + (token + 1) % 10, *record["output_ids"][1:]]
    lines[0] = json.dumps(record, sort_keys=True) + "\n"
    path.write_text("".join(lines))
    pid = served.server_pid()
    result = served.play("eval.yml")
    assert result.rc == 0, result.output[-6000:]
    assert f"{path} line 1 (id {fetched['id']!r}) is damaged or edited" in said(result)
    assert json.loads(path.read_text().splitlines()[0])["output_ids"] == fetched["output_ids"]
    assert served.server_pid() == pid and served.health_generate_status() == 200


def test_a_flipped_shard_byte_is_named_and_the_shard_redone(served):
    shard = served.run_dir / "hidden_states" / "shard-00000.safetensors"
    original = shard.read_bytes()
    damaged = bytearray(original)
    damaged[-1] ^= 0x01
    shard.write_bytes(bytes(damaged))
    # The stages up to the extraction: the shard redone is the one that was, so the scores stand.
    result = served.play("eval.yml", args=("--tags", "prefetch,extract"))
    assert result.rc == 0, result.output[-6000:]
    assert f"{shard} does not match the sha256" in said(result)
    assert shard.read_bytes() == original
    assert served.health_generate_status() == 200


FOREIGN_LISTENER = """
import sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

class Answer200(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

deadline = time.monotonic() + 120
while True:
    try:
        server = HTTPServer(("127.0.0.1", int(sys.argv[1])), Answer200)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
print("listening", flush=True)
server.serve_forever()
"""


def guard_processes(site) -> list[int]:
    """The window guards of this site (they carry its config file on their command line)."""
    spec = str(site.work_dir / "sglang.pid.d" / "guard.json").encode()
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b".guard") for arg in argv) and spec in argv:
            found.append(pid)
    return found


def test_a_port_taken_inside_the_window_fails_start_server_disarms_the_guard_and_a_rerun_restores(
    served, tmp_path
):
    site = served
    run_dir = site.seed_run_dir(site.run_dir, site.work_dir / "run-port-taken")  # only the window is new
    extra = site.extra_vars(specops_run_dir=str(run_dir))
    play = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            str(REPO / "playbooks" / "eval.yml"),
            "-e",
            json.dumps(extra),
            # The environment is the shared run's: the stages up to and through the window.
            "--tags",
            "prefetch,extract",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
    )
    foreign = None
    output = ""
    try:
        for line in play.stdout:
            output += line
            # Our server stopped and its port was released: another process takes the port.
            if foreign is None and "TASK [Stage release-gpus:" in line:
                foreign = subprocess.Popen(
                    [sys.executable, "-c", FOREIGN_LISTENER, str(site.port)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert foreign.stdout.readline().strip() == "listening"
        play.wait(timeout=600)
        assert foreign is not None, output[-4000:]
        result = SimpleNamespace(output=output)
        assert play.returncode != 0
        assert "specops stage 'start-server' failed" in said(result), output[-4000:]
        assert f"port {site.port} is held by pid {foreign.pid}" in said(result)
        assert "the guard was disarmed" in said(result) and "the play is rerun" in said(result)
        # Not armed against the foreign process: no guard config, the guard gone (it looks at its config
        # every second), and nothing started after the play.
        assert not (site.work_dir / "sglang.pid.d" / "guard.json").exists()
        log = site.work_dir / "sglang.log"
        launches = log.read_text().count(" starting: ")
        deadline = time.monotonic() + 30
        while guard_processes(site) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert guard_processes(site) == []
        time.sleep(3)
        assert log.read_text().count(" starting: ") == launches
        assert foreign.poll() is None and site.server_pid() is None
    finally:
        if play.poll() is None:
            play.kill()
            play.wait()
        if foreign is not None:
            foreign.terminate()
            foreign.wait(timeout=30)

    extracted = (run_dir / "hidden_states" / "manifest.json").read_bytes()
    launches = log.read_text().count(" starting: ")
    # The rerun's stages up to the window: `serve` brings the service back, and the extraction kept is
    # up to date, so no window opens (scoring is the finished run's business).
    rerun = site.play("eval.yml", specops_run_dir=str(run_dir), args=("--tags", "prefetch,extract"))
    assert rerun.rc == 0, rerun.output[-6000:]
    assert site.health_generate_status() == 200 and site.server_pid() is not None
    assert log.read_text().count(" starting: ") == launches + 1  # `serve` only: no window
    assert (run_dir / "hidden_states" / "manifest.json").read_bytes() == extracted
    # The server the rerun found down is on the run's record, for its report.
    outages = json.loads((run_dir / "hidden_states" / "outages.json").read_text())
    assert [o["kind"] for o in outages] == ["found_down"]
    assert f"pid {site.server_pid()}" in outages[0]["cause"]


def test_a_server_killed_inside_a_memory_saver_window_is_started_again_and_the_play_says_so(
    memory_saver_site, tmp_path
):
    """SIGKILL of the server once its memory is released (an OOM kill, an operator's kill -9): there is
    nothing to resume, so the resume starts a server and the play says what happened."""
    site = memory_saver_site
    run_dir = site.work_dir / "run-killed"
    pid_before = site.server_pid()
    # Two prompts, short completions: the window is what the test is about, not the work inside it.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((REPO / "prompts" / "coding.jsonl").read_text().splitlines(keepends=True)[:2]))
    settings = site.extra_vars(
        specops_run_dir=str(run_dir), specops_prompts=str(prompts), specops_max_new_tokens=32
    )
    # Scoring is the finished run's business: the stages up to and through the window.
    play = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            str(REPO / "playbooks" / "eval.yml"),
            "-e",
            json.dumps(settings),
            "--tags",
            "prefetch,extract",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
    )
    children: list[int] = []
    killed = threading.Event()
    start_signal = run_dir / "extract.start"

    def kill_at_go() -> None:
        # The window is one module call: the release has answered and the memory is free once the waiting
        # extraction is told go; the server is paused with its memory released then.
        while play.poll() is None:
            try:
                if json.loads(start_signal.read_text()).get("signal") == "go":
                    children.extend(_tree(pid_before))
                    os.kill(pid_before, signal.SIGKILL)
                    killed.set()
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.02)

    killer = threading.Thread(target=kill_at_go, daemon=True)
    killer.start()
    output = ""
    try:
        for line in play.stdout:
            output += line
        play.wait(timeout=600)
    finally:
        if play.poll() is None:
            play.kill()
            play.wait()
    killer.join(timeout=60)
    result = SimpleNamespace(output=output)
    assert killed.is_set(), output[-4000:]
    assert play.returncode == 0, output[-6000:]
    assert "was gone when its GPU memory was to be resumed (its process died" in said(result)
    assert "a new server was started instead" in said(result)
    assert site.server_pid() not in (None, pid_before)
    assert site.health_generate_status() == 200
    # The scheduler ranks and the detokenizer die with their launcher (PR_SET_PDEATHSIG), as SGLang's do.
    assert len(children) == 3 and not any(_alive(pid) for pid in children)
    # The extraction finished in the window, and its record says the server was started again.
    assert (run_dir / "hidden_states" / "manifest.json").is_file()
    record = json.loads((run_dir / "hidden_states" / "window.json").read_text())
    assert record["mode"] == "memory_saver" and record["started_instead"] is True


# -- a server that fails inside its release or resume (memory_saver_site runs SGLang's process tree) -------
def _tree(pid: int) -> list[int]:
    """pid's children, as /proc shows them."""
    found = []
    for entry in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _window_is_over(site) -> bool:
    state_dir = site.work_dir / "sglang.pid.d"
    return not any((state_dir / name).exists() for name in ("window.lock", "released.json", "guard.armed"))


def _release_with_fault(site, fault: str):
    fault_file = site.work_dir / "release-fault"
    fault_file.write_text(fault)
    try:
        return site.play("service.yml", sglang_service_state="released")
    finally:
        fault_file.write_text("")


def _hold(path: Path) -> subprocess.Popen:
    """A process outside the server that holds a device file: the device's memory is not free."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; f = open(sys.argv[1]); print('held', flush=True); time.sleep(3600)",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_server_that_dies_of_its_release_is_started_again_and_the_play_says_so(memory_saver_site):
    """A release that finds the scheduler busy kills SGLang 0.5.23's whole tree: the module does not end the
    window there (that would disarm the guard and leave the server dead) but starts the server again."""
    site = memory_saver_site
    pid_before = site.server_pid()
    children = _tree(pid_before)
    log = site.work_dir / "sglang.log"
    crashes = log.read_text().count("Scheduler hit an exception")

    result = _release_with_fault(site, "busy")

    assert result.rc != 0
    text = said(result)
    assert "was not released" in text and "it was started again from disk and serves" in text, text[-3000:]
    assert log.read_text().count("Scheduler hit an exception") == crashes + 1
    assert len(children) == 3 and not any(_alive(pid) for pid in children), "the old tree died with it"
    assert site.server_pid() not in (None, pid_before) and site.health_generate_status() == 200
    assert _window_is_over(site)


def test_an_unanswered_release_is_not_taken_as_not_released_the_server_is_started_again(memory_saver_site):
    """The release happened but its answer was lost: continuing would leave the server serving from released
    memory, and had it not happened a resume would kill the server (test_devserver.py::
    test_a_second_resume_takes_the_whole_server_down), so it is started again, never resumed blindly."""
    site = memory_saver_site
    pid_before = site.server_pid()
    log = site.work_dir / "sglang.log"
    crashes = log.read_text().count("Scheduler hit an exception")

    result = _release_with_fault(site, "unanswered")

    assert result.rc != 0
    text = said(result)
    assert "the release was not answered" in text and "it was started again from disk" in text, text[-3000:]
    assert log.read_text().count("Scheduler hit an exception") == crashes, "nothing was resumed blindly"
    assert site.server_pid() not in (None, pid_before) and site.health_generate_status() == 200
    assert _window_is_over(site)


def test_a_resume_that_cannot_allocate_kills_the_server_and_the_play_starts_it_again(memory_saver_site):
    """A resume whose allocation fails (the memory is still taken: here another process holds rank 1's
    device) kills the tree; the play's resume sees the server not answering and starts it again."""
    site = memory_saver_site
    released = site.play("service.yml", sglang_service_state="released")
    assert released.rc == 0, released.output[-3000:]
    pid_before = site.server_pid()
    holder = _hold(site.work_dir / "devices" / "nvidia1")
    try:
        resumed = site.play("service.yml", sglang_service_state="resumed")
    finally:
        holder.kill()
        holder.wait()

    assert resumed.rc == 0, resumed.output[-3000:]
    assert "did not serve after its GPU memory was resumed" in said(resumed), said(resumed)[-3000:]
    assert "CUDA out of memory" in (site.work_dir / "sglang.log").read_text()
    assert site.server_pid() not in (None, pid_before) and site.health_generate_status() == 200
    assert _window_is_over(site)


def test_the_guards_resume_that_kills_the_server_is_followed_by_a_start(memory_saver_site):
    """The guard resumes (the play is gone) while the memory is still taken: the server dies of it, and the
    guard, which checks the server after its resume, starts it again."""
    site = memory_saver_site
    holder = _hold(site.work_dir / "devices" / "nvidia0")
    try:
        # The guard fires 8 s after it is armed, once the release is done and the play has ended.
        released = site.play("service.yml", sglang_service_state="released", sglang_service_max_downtime=8)
        assert released.rc == 0, released.output[-3000:]
        pid_before = site.server_pid()
        guard_log = site.work_dir / "sglang.pid.d" / "guard.log"
        deadline = time.monotonic() + 600  # a bound, not an expectation
        while site.server_pid() in (None, pid_before) and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        holder.kill()
        holder.wait()
    while site.health_generate_status() != 200 and time.monotonic() < deadline:
        time.sleep(1)
    assert site.health_generate_status() == 200, guard_log.read_text()[-3000:]
    assert site.server_pid() not in (None, pid_before)
    # The guard's result is its last JSON line (an outage line may follow it once the server answers).
    lines = guard_log.read_text().splitlines()
    results = [line.split("guard: ", 1)[1] for line in lines if "guard: {" in line]
    assert results, guard_log.read_text()[-3000:]
    last = json.loads(results[-1])
    assert "not_serving" in last and last["started_pid"] == site.server_pid(), last
    assert "CUDA out of memory" in (site.work_dir / "sglang.log").read_text()
    assert _window_is_over(site)


def test_a_full_disk_at_the_score_stage_names_the_file_and_the_fix(served, tmp_path):
    """The score stage's output on a file system with no space left (a 64 KiB tmpfs, filled): the play
    fails naming the stage, the file and what to do, not with a traceback; the server is not touched."""
    site = served
    run_dir = site.seed_run_dir(site.run_dir, tmp_path / "run", stages=("completions", "hidden_states"))
    score_dir = run_dir / "score"
    score_dir.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(score_dir)], check=False)
    if mounted.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        filler = os.open(score_dir / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(filler, b"\0" * 4096):
                pass
        except OSError:  # full: what the test wants
            pass
        finally:
            os.close(filler)
        pid = site.server_pid()
        result = site.play("eval.yml", specops_run_dir=str(run_dir), args=("--tags", "score"))
    finally:
        subprocess.run(["umount", "-l", str(score_dir)], check=False)
    assert result.rc != 0
    assert "specops stage 'score' failed" in said(result), result.output[-4000:]
    assert "no space left to write" in said(result) and str(score_dir) in said(result), result.output[-4000:]
    assert "free space on that file system" in said(result)
    assert "Traceback" not in result.output
    assert site.server_pid() == pid and site.health_generate_status() == 200
