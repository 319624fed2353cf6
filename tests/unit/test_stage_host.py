"""The stage host: a stage forked from a preloaded interpreter behaves as the process it replaces.

The client is the collection's (plugins/module_utils/stages/stage_host.py, what every stage module calls); the
host is the package's (specops.stage_host). The probe stage below reports what it was given.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "collections"))
from ansible_collections.specops.drafter.plugins.module_utils.stages import stage_host  # noqa: E402

PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    what = sys.argv[1]
    if what == "sleep":
        open(os.environ["PROBE_PID_FILE"], "w").write(str(os.getpid()))
        time.sleep(600)
    umask = os.umask(0)
    print("progress of the probe", file=sys.stderr)
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "per_call": os.environ.get("PER_CALL"),
                      "umask": umask, "stdin": sys.stdin.read(), "pid": os.getpid()}))
    sys.exit(int(sys.argv[2]))
    """
)
# Generous: the host imports torch and transformers before it serves (seconds on a loaded machine).
HOST_START_LIMIT_S = 300


def wait_until(check, what, limit=HOST_START_LIMIT_S):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {limit} s: {what}")


def short_dir():
    """A directory short enough to hold a Unix socket's path (pytest's are often not)."""
    return Path(tempfile.mkdtemp(prefix="specops-test-", dir="/tmp"))


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """This module's socket directory and a working directory holding the probe stage."""
    base = short_dir()
    (base / "run").mkdir(mode=0o700)
    work = base / "work"
    work.mkdir()
    (work / "stage_probe.py").write_text(PROBE)
    return base


@pytest.fixture()
def call_env(runtime, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime / "run"))
    env = {key: value for key, value in os.environ.items() if key != "SPECOPS_WINDOW_TOKEN"}
    env["PYTHONPATH"] = str(ROOT / "src")
    return env


def served(env, work, args=("report", "0"), data=b"", module="stage_probe"):
    """The first call starts the host and runs nothing; then calls are served."""
    first = stage_host.run(sys.executable, module, list(args), data, env, cwd=str(work))
    if first is not None:
        return first
    return wait_until(
        lambda: stage_host.run(sys.executable, module, list(args), data, env, cwd=str(work)),
        "the stage host serves",
    )


def host_pids(runtime):
    found = subprocess.run(
        ["pgrep", "-f", f"specops.stage_host --socket {runtime}"], capture_output=True, text=True
    )
    return {int(pid) for pid in found.stdout.split()}


@pytest.fixture(scope="module", autouse=True)
def stop_hosts(runtime):
    yield
    for pid in host_pids(runtime):
        os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not host_pids(runtime), "the hosts ended")
    shutil.rmtree(runtime, ignore_errors=True)


def test_a_forked_stage_gets_the_callers_streams_environment_directory_umask_and_exit_status(
    runtime, call_env
):
    work = runtime / "work"
    rc, out, err = served({**call_env, "PER_CALL": "first"}, work, ("report", "3"), b'{"request": 1}')
    assert rc == 3
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["argv"] == ["report", "3"]
    assert seen["cwd"] == str(work)
    assert seen["per_call"] == "first"
    assert seen["stdin"] == '{"request": 1}'
    mine = os.umask(0)
    os.umask(mine)
    assert seen["umask"] == mine
    assert "progress of the probe" in err
    assert seen["pid"] not in host_pids(runtime)

    # A variable that import does not read may differ between calls of one host.
    rc, out, _ = stage_host.run(
        sys.executable, "stage_probe", ["report", "0"], b"", {**call_env, "PER_CALL": "second"}, cwd=str(work)
    )
    assert rc == 0
    assert json.loads(out.strip().splitlines()[-1])["per_call"] == "second"
    assert len(host_pids(runtime)) == 1
    (host,) = host_pids(runtime)
    assert "PYTHONPATH" not in Path(f"/proc/{host}/cmdline").read_text()  # values stay out of ps


def test_a_stage_whose_caller_is_killed_goes_with_it_and_a_signal_to_the_caller_reaches_it(
    runtime, call_env, tmp_path
):
    work = runtime / "work"
    served(call_env, work)  # a host is up
    caller = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT / "collections")!r})
        from ansible_collections.specops.drafter.plugins.module_utils.stages import stage_host
        print(stage_host.run(sys.executable, "stage_probe", ["sleep"], b"", dict(__import__("os").environ),
                             cwd={str(work)!r})[0], flush=True)
        """
    )
    for how in (signal.SIGKILL, signal.SIGTERM):
        pid_file = tmp_path / f"stage-{how}.pid"
        env = {**call_env, "PROBE_PID_FILE": str(pid_file)}
        proc = subprocess.Popen([sys.executable, "-c", caller], env=env, stdout=subprocess.PIPE, text=True)
        stage = int(wait_until(lambda f=pid_file: f.is_file() and f.read_text(), "the stage started"))
        os.kill(proc.pid, how)
        wait_until(
            lambda p=stage: not Path(f"/proc/{p}").exists() or _zombie(p), "the stage ended with its caller"
        )
        out, _ = proc.communicate()
        if how == signal.SIGTERM:
            # The caller forwarded the signal and reports the stage's end as run_command would.
            assert out.strip() == str(-signal.SIGTERM)


def _zombie(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_windows_work_forked_by_the_host_is_found_by_its_callers_token_and_stopped_with_it(
    runtime, call_env, tmp_path
):
    """The guard, job_wait and the window lock know the window's work by SPECOPS_WINDOW_TOKEN in
    /proc/<pid>/environ; a forked stage shows its host's there, so it is found through its caller."""
    from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
    from ansible_collections.specops.drafter.plugins.module_utils.service.service_process import (
        stop_processes,
    )

    work = runtime / "work"
    served(call_env, work)  # a host is up
    caller = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(ROOT / "collections")!r})
        from ansible_collections.specops.drafter.plugins.module_utils.stages import stage_host
        env = dict(os.environ)
        print(stage_host.run(sys.executable, "stage_probe", ["sleep"], b"", env, cwd={str(work)!r}))
        """
    )
    token = f"window-{os.getpid()}-{time.monotonic_ns()}"
    started = {}
    for name, extra in (("window", {"SPECOPS_WINDOW_TOKEN": token}), ("other", {})):
        pid_file = tmp_path / f"{name}.pid"
        env = {**call_env, **extra, "PROBE_PID_FILE": str(pid_file)}
        proc = subprocess.Popen([sys.executable, "-c", caller], env=env, stdout=subprocess.PIPE, text=True)
        stage = int(wait_until(lambda f=pid_file: f.is_file() and f.read_text(), f"the {name} stage started"))
        started[name] = (proc, stage)
    (window_caller, window_stage), (other_caller, other_stage) = started["window"], started["other"]
    try:
        # Both stages are the host's children: forked, not started anew.
        assert procfs.read_stat(window_stage).ppid == procfs.read_stat(other_stage).ppid in host_pids(runtime)
        assert procfs.token_processes(token) == [window_caller.pid]  # the environ alone misses the stage
        assert procfs.window_processes(token) == [window_caller.pid, window_stage]  # the other call is not it
        stop_processes(procfs.window_processes(token), grace=30)
        wait_until(lambda: _gone(window_stage) and window_caller.poll() is not None, "the work stopped")
        assert not _gone(other_stage) and other_caller.poll() is None
        assert procfs.window_processes(token) == []
    finally:
        for proc, _stage in started.values():
            proc.kill()
            proc.wait()
        wait_until(lambda: _gone(other_stage), "the other stage ended with its caller")


def _gone(pid):
    return not Path(f"/proc/{pid}").exists() or _zombie(pid)


def test_a_disabled_host_and_another_environment_never_share_a_host(call_env):
    assert stage_host.usable_for(call_env)
    assert stage_host.usable_for({**call_env, "SPECOPS_WINDOW_TOKEN": "abc"})  # found through its caller
    assert not stage_host.usable_for({**call_env, "SPECOPS_STAGE_HOST": "0"})
    key = stage_host.host_key(sys.executable, call_env)
    assert stage_host.host_key(sys.executable, {**call_env, "PATH": "/elsewhere"}) == key
    assert stage_host.host_key(sys.executable, {**call_env, "OMP_NUM_THREADS": "7"}) != key
    assert stage_host.host_key(sys.executable, {**call_env, "PYTHONPATH": "/other"}) != key
    assert stage_host.host_key("/opt/other-venv/bin/python", call_env) != key
    host_env = stage_host.host_environment({**call_env, "SPECOPS_RUN_LOCK": "x", "SPECOPS_WINDOW_TOKEN": "y"})
    assert "SPECOPS_RUN_LOCK" not in host_env and "SPECOPS_WINDOW_TOKEN" not in host_env


def test_a_socket_directory_others_can_open_or_too_long_a_path_is_not_used(tmp_path, monkeypatch):
    (tmp_path / ("deep" * 30)).mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / ("deep" * 30)))
    assert stage_host.socket_path("key") is None
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert stage_host.socket_dir() == str(tmp_path / f"specops-stage-host-{os.getuid()}")
    os.chmod(stage_host.socket_dir(), 0o755)
    assert stage_host.socket_dir() is None
    assert stage_host.run(sys.executable, "stage_probe", ["report", "0"], b"", dict(os.environ)) is None


def test_a_host_whose_imported_files_changed_refuses_and_goes(monkeypatch):
    """A reinstalled environment or an edited checkout: the stage runs anew, never from old code."""
    tmp_path = short_dir()
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "specops", src / "specops", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "run").mkdir(mode=0o700)
    work = tmp_path / "work"
    work.mkdir()
    (work / "stage_probe.py").write_text(PROBE)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    env = {**os.environ, "PYTHONPATH": str(src)}
    env.pop("SPECOPS_WINDOW_TOKEN", None)
    assert served(env, work)[0] == 0
    stage_file = src / "specops" / "stage.py"
    os.utime(stage_file, ns=(stage_file.stat().st_atime_ns, stage_file.stat().st_mtime_ns + 10**9))
    assert stage_host.run(sys.executable, "stage_probe", ["report", "0"], b"", env, cwd=str(work)) is None
    socket = Path(
        stage_host.socket_path(
            hashlib.sha256(
                stage_host.host_key(sys.executable, stage_host.call_environment(env)).encode()
            ).hexdigest()
        )
    )
    wait_until(lambda: not socket.exists(), "the refusing host took its socket away")
    wait_until(lambda: not host_pids(tmp_path), "the refusing host ended")
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_host_that_finds_the_cuda_driver_loaded_after_its_imports_does_not_serve(tmp_path):
    """A CUDA runtime initialized before the fork cannot be used by the forked stages."""
    from specops.stage_host import preload

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.1\n")
    assert not preload.cuda_driver_loaded(str(maps))
    maps.write_text("7f00-7f10 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04\n")
    assert preload.cuda_driver_loaded(str(maps))


def test_a_host_killed_under_its_stage_takes_the_stage_with_it_and_the_caller_says_so(monkeypatch):
    """The stage dies with its host (PR_SET_PDEATHSIG): no orphan keeps the GPU; the module reports a
    stage killed by signal 9, with the reason in its error output."""
    base = short_dir()
    (base / "run").mkdir(mode=0o700)
    work = base / "work"
    work.mkdir()
    (work / "stage_probe.py").write_text(PROBE)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base / "run"))
    pid_file = base / "stage.pid"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PROBE_PID_FILE": str(pid_file)}
    env.pop("SPECOPS_WINDOW_TOKEN", None)
    served(env, work)  # a host is up
    (host,) = host_pids(base)
    caller = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "collections")!r})
        from ansible_collections.specops.drafter.plugins.module_utils.stages import stage_host
        env = dict(__import__("os").environ)
        rc, out, err = stage_host.run(sys.executable, "stage_probe", ["sleep"], b"", env, cwd={str(work)!r})
        print(json.dumps([rc, err[-200:]]), flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", caller], env=env, stdout=subprocess.PIPE, text=True)
    stage = int(wait_until(lambda: pid_file.is_file() and pid_file.read_text(), "the stage started"))
    os.kill(host, signal.SIGKILL)
    out, _ = proc.communicate(timeout=HOST_START_LIMIT_S)
    rc, err = json.loads(out)
    assert rc == -signal.SIGKILL
    assert "the stage host ended before the stage did" in err
    wait_until(lambda: not Path(f"/proc/{stage}").exists() or _zombie(stage), "the stage ended with its host")
    shutil.rmtree(base, ignore_errors=True)


def test_a_host_that_failed_to_start_is_not_tried_again_for_a_while(tmp_path):
    path = str(tmp_path / "host.sock")
    assert stage_host.host_may_start(path)
    failed = tmp_path / "host.sock.failed"
    failed.write_text("RuntimeError: CUDA was initialized while preloading\n")
    assert not stage_host.host_may_start(path)
    long_ago = time.time() - stage_host.FAILED_RETRY_S - 1
    os.utime(failed, (long_ago, long_ago))
    assert stage_host.host_may_start(path)
