"""gpu_release: frees exactly our GPU holders, proves it, and leaves every other process alone.

Real processes hold files named like GPU devices under a temporary directory (`<tmp>/nvidia*`),
and the module is pointed at that glob, so nothing outside this test can ever match. Every
process a test starts is killed at teardown, even when the test fails.

Orphans: a holder is double-forked from a matched launcher, then its intermediate parent exits.
On this machine PID 1 is not systemd and nothing between it and the test is a child subreaper,
so the orphan is re-parented to PID 1; the test checks that it is re-parented (its parent is
neither the launcher nor the dead intermediate) and records which pid adopted it, so on a host
with a subreaper it still shows what it proves.
"""

import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from module_call import call_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
UTILS_PATH = ROOT / "collections/ansible_collections/specops/drafter/plugins/module_utils/gpus/gpu_release.py"


def _load_utils():
    # gpu_release imports its sibling module_utils by their collection path, as Ansible ships them.
    sys.path.insert(0, str(ROOT / "collections"))
    spec = importlib.util.spec_from_file_location("gpu_release_utils", UTILS_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gr = _load_utils()
from ansible_collections.specops.drafter.plugins.module_utils.service.service_process import ProcessServer  # noqa: E402

# argv: mode marker [files...]; mode is term (default SIGTERM), stubborn (ignores SIGTERM),
# launcher (holds nothing; double-forks an orphan holder: argv after the marker is
# orphan_marker files...). Each holder prints "ready <pid>" once its files are open.
CHILD = r"""
import os, signal, sys, time
mode, marker, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "launcher":
    middle = os.fork()
    if middle == 0:
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", CODE, "term"] + rest)
        os._exit(0)
    print("intermediate %d" % middle, flush=True)
    os.waitpid(middle, 0)
    os.write(1, b"launcher %d\n" % os.getpid())
else:
    handles = [open(path) for path in rest]
    print("ready %d" % os.getpid(), flush=True)
while True:
    time.sleep(1)
"""
CHILD = f"CODE = {CHILD!r}\n{CHILD}"


def _starttime(pid):
    stat = gr.read_stat(pid)
    return None if stat is None else stat[4]


def alive(pid, starttime):
    stat = gr.read_stat(pid)
    return stat is not None and stat[4] == starttime and stat[0] not in ("Z", "X")


class Procs:
    """Starts test processes and guarantees they are all gone afterwards."""

    def __init__(self):
        self.popens = []
        self.extra = []  # (pid, starttime) of processes that are not our children (orphans)

    def start(self, mode, marker, files, argv0=None, executable=None, lines=1):
        """Start a child; return (popen, {label: pid}) once it reported `lines` lines."""
        exe = executable or sys.executable
        argv = [argv0 or exe, "-c", CHILD, mode, marker] + [str(f) for f in files]
        popen = subprocess.Popen(argv, executable=exe, stdout=subprocess.PIPE, start_new_session=True)
        self.popens.append(popen)
        seen = {}
        deadline = time.monotonic() + 20
        buffer = b""
        while len(seen) < lines:
            ready, _, _ = select.select([popen.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"child {argv[3:5]} did not report ready in 20 s (exit {popen.poll()})")
            chunk = os.read(popen.stdout.fileno(), 4096)
            if not chunk:
                raise AssertionError(f"child {argv[3:5]} exited early (exit {popen.wait()})")
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                label, pid = line.decode().split()
                seen[label] = int(pid)
                if label == "ready" and int(pid) != popen.pid:
                    self.extra.append((int(pid), _starttime(int(pid))))
        return popen, seen

    def cleanup(self):
        for pid, start in self.extra:
            if start is not None and alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        for popen in self.popens:
            if popen.poll() is None:
                popen.kill()
            popen.wait()
            popen.stdout.close()


@pytest.fixture
def procs():
    registry = Procs()
    try:
        yield registry
    finally:
        registry.cleanup()


@pytest.fixture
def devices(tmp_path):
    paths = [tmp_path / "nvidia0", tmp_path / "nvidia1", tmp_path / "nvidiactl"]
    for path in paths:
        path.write_text("")
    return {"dir": tmp_path, "pattern": str(tmp_path / "nvidia*"), "paths": paths}


@pytest.fixture
def token():
    return uuid.uuid4().hex[:12]


def run_module(args, tmp_path, check=False):
    """Run the real module as a host runs it (module_call); its JSON result and `failed`."""
    return call_module("gpu_release", args, check=check, timeout=120)


def base_args(devices, token, **extra):
    args = {
        "patterns": [f"ours-{token}"],
        "device_pattern": devices["pattern"],
        "nvml": "false",
        "grace": 1.0,
        "timeout": 10,
    }
    args.update(extra)
    return args


def pinned(pid):
    return pid, _starttime(pid)


@pytest.fixture
def scene(procs, devices, token):
    """Ours: a holder that exits on SIGTERM, one that ignores it, an orphan of a matched launcher.
    Not ours: a decoy holder whose command line does not match."""
    d0, d1, ctl = devices["paths"]
    term, _ = procs.start("term", f"ours-{token}", [d0, ctl])
    stubborn, _ = procs.start("stubborn", f"ours-{token}", [d1, ctl])
    launcher, seen = procs.start("launcher", f"ours-{token}", [f"orphan-{token}", d1], lines=3)
    decoy, _ = procs.start("term", f"decoy-{token}", [d0, ctl])
    return {
        "term": pinned(term.pid),
        "stubborn": pinned(stubborn.pid),
        "launcher": pinned(launcher.pid),
        "intermediate": seen["intermediate"],
        "orphan": pinned(seen["ready"]),
        "decoy": pinned(decoy.pid),
    }


def wait_dead(pid_start, seconds=5.0):
    deadline = time.monotonic() + seconds
    while alive(*pid_start) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(*pid_start)


# --- the module, end to end ---------------------------------------------------------------------


def test_orphan_is_reparented_away_from_its_launcher(scene):
    orphan = gr.read_proc(scene["orphan"][0])
    assert orphan.ppid not in (scene["launcher"][0], scene["intermediate"])
    # Where it went (PID 1 on this machine; a subreaper elsewhere) is what the orphan rule handles.
    assert gr.is_reparented(orphan, {p: gr.read_proc(p) for p in gr.list_pids() if gr.read_proc(p)})
    assert orphan.pgid == scene["launcher"][0]
    print(f"orphan {orphan.pid} adopted by pid {orphan.ppid}")


def test_release_kills_exactly_ours_and_spares_the_decoy(scene, devices, token, tmp_path):
    result = run_module(base_args(devices, token, allow_foreign=True), tmp_path)

    assert result["failed"] is False, result.get("msg")
    assert result["changed"] is True
    killed = {entry["pid"]: entry for entry in result["killed"]}
    assert set(killed) == {scene["term"][0], scene["stubborn"][0], scene["orphan"][0]}
    assert killed[scene["term"][0]]["signal"] == "SIGTERM"
    assert killed[scene["stubborn"][0]]["signal"] == "SIGKILL"
    assert killed[scene["orphan"][0]]["signal"] == "SIGTERM"
    assert "orphan" in killed[scene["orphan"][0]]["reason"]
    for name in ("term", "stubborn", "orphan"):
        assert wait_dead(scene[name]), f"{name} should have died"
    assert alive(*scene["decoy"]), "the decoy is not ours and must survive"
    assert [f["pid"] for f in result["foreign"]] == [scene["decoy"][0]]
    assert result["timeline"]["sigkill_s"] >= 1.0


def test_a_matching_process_that_holds_no_gpu_is_left_alone(scene, devices, token, tmp_path):
    run_module(base_args(devices, token, allow_foreign=True), tmp_path)
    assert alive(*scene["launcher"])


def test_foreign_holder_fails_the_module_and_nothing_is_signalled(scene, devices, token, tmp_path):
    result = run_module(base_args(devices, token), tmp_path)

    assert result["failed"] is True and result["changed"] is False
    assert f"pid {scene['decoy'][0]}" in result["msg"]
    assert f"decoy-{token}" in result["msg"]
    assert "allow_foreign" in result["msg"]
    for name in ("term", "stubborn", "orphan", "decoy"):
        assert alive(*scene[name]), f"{name} must not be signalled when a foreign holder fails the run"


def test_check_mode_reports_targets_and_kills_nothing(scene, devices, token, tmp_path):
    result = run_module(base_args(devices, token, allow_foreign=True), tmp_path, check=True)

    assert result["changed"] is False and result["would_signal"] == 3
    assert result["killed"] == []
    assert {t["pid"] for t in result["targets"]} == {
        scene["term"][0],
        scene["stubborn"][0],
        scene["orphan"][0],
    }
    for name in ("term", "stubborn", "orphan", "decoy"):
        assert alive(*scene[name])


def test_without_orphans_the_orphan_is_foreign_and_survives(scene, devices, token, tmp_path):
    result = run_module(base_args(devices, token, allow_foreign=True, orphans=False), tmp_path)

    assert {f["pid"] for f in result["foreign"]} == {scene["orphan"][0], scene["decoy"][0]}
    assert alive(*scene["orphan"])
    assert wait_dead(scene["term"])


def test_nothing_to_release_is_not_a_change(procs, devices, token, tmp_path):
    decoy, _ = procs.start("term", f"decoy-{token}", [devices["paths"][0]])
    result = run_module(base_args(devices, token, allow_foreign=True), tmp_path)

    assert result["changed"] is False
    assert result["killed"] == [] and result["targets"] == []
    assert decoy.poll() is None


def test_protected_daemon_is_never_signalled_even_when_it_matches(procs, devices, token, tmp_path):
    # A process whose executable is called nvidia-persistenced: comm is what the kernel reports.
    exe = tmp_path / "nvidia-persistenced"
    exe.symlink_to(os.path.realpath(sys.executable))
    daemon, _ = procs.start(
        "term", f"ours-{token}", [devices["paths"][2]], argv0=str(exe), executable=str(exe)
    )
    result = run_module(base_args(devices, token), tmp_path)

    assert result["failed"] is False, result.get("msg")
    assert result["changed"] is False
    assert [p["pid"] for p in result["protected"]] == [daemon.pid]
    assert daemon.poll() is None


def test_a_spared_pid_is_never_signalled_even_when_it_matches(procs, devices, token, tmp_path):
    waiter, _ = procs.start("term", f"ours-{token}", [devices["paths"][2]])
    result = run_module({**base_args(devices, token), "spare_pids": [waiter.pid]}, tmp_path)

    assert result["failed"] is False, result.get("msg")
    assert [p["pid"] for p in result["protected"]] == [waiter.pid]
    assert waiter.poll() is None


def test_unknown_unit_without_systemd_names_the_unit_and_pid_1(devices, tmp_path):
    result = run_module(
        {"unit": "sglang-qwen", "device_pattern": devices["pattern"], "nvml": "false"}, tmp_path
    )

    assert result["failed"] is True
    assert "sglang-qwen.service" in result["msg"]
    assert "systemd is not PID 1" in result["msg"]
    assert gr._pid1_name() in result["msg"]


def test_empty_patterns_without_unit_is_a_clear_error(devices, tmp_path):
    result = run_module({"patterns": [], "device_pattern": devices["pattern"]}, tmp_path)

    assert result["failed"] is True
    assert "'patterns' is empty and no 'unit' or 'tree_file' is given" in result["msg"]


def test_invalid_regex_is_named(devices, tmp_path):
    result = run_module({"patterns": ["sglang(("], "device_pattern": devices["pattern"]}, tmp_path)

    assert result["failed"] is True
    assert "'sglang(('" in result["msg"] and "not a valid regular expression" in result["msg"]


def test_docs_render_with_every_option():
    out = subprocess.run(
        [str(ROOT / ".venv/bin/ansible-doc"), "--json", "specops.drafter.gpu_release"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    doc = json.loads(out)["specops.drafter.gpu_release"]["doc"]
    assert set(doc["options"]) == {
        "unit",
        "tree_file",
        "patterns",
        "device_pattern",
        "protected",
        "allow_foreign",
        "orphans",
        "grace",
        "timeout",
        "memory_threshold_mb",
        "nvml",
        "spare_pids",
    }
    assert doc["options"]["patterns"]["default"] == list(gr.DEFAULT_PATTERNS)
    assert doc["options"]["protected"]["default"] == list(gr.DEFAULT_PROTECTED)


def test_role_frees_ours_through_its_variables(scene, devices, token, tmp_path):
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        "- hosts: localhost\n  gather_facts: false\n  roles:\n    - gpu_release\n"
        "  post_tasks:\n    - ansible.builtin.copy:\n        content: '{{ gpu_release_result | to_json }}'\n"
        "        dest: %s\n" % (tmp_path / "result.json")
    )
    extra = tmp_path / "vars.json"
    extra.write_text(
        json.dumps(
            {
                "gpu_release_patterns": [f"ours-{token}"],
                "gpu_release_device_pattern": devices["pattern"],
                "gpu_release_nvml": "false",
                "gpu_release_grace": 1,
                "gpu_release_timeout": 10,
                "gpu_release_allow_foreign": True,
                "gpu_release_become": False,
            }
        )
    )
    proc = subprocess.run(
        [str(ROOT / ".venv/bin/ansible-playbook"), str(playbook), "-e", f"@{extra}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert {k["pid"] for k in result["killed"]} == {
        scene["term"][0],
        scene["stubborn"][0],
        scene["orphan"][0],
    }
    assert alive(*scene["decoy"])


# --- module_utils, directly -----------------------------------------------------------------------


def test_fd_scan_finds_holders_of_matching_files_only(procs, devices, token, tmp_path):
    other = tmp_path / "other0"
    other.write_text("")
    holder, _ = procs.start("term", f"x-{token}", [devices["paths"][0]])
    bystander, _ = procs.start("term", f"y-{token}", [other])

    holders, _ = gr.scan_fd_holders(devices["pattern"])

    assert holders == {holder.pid: {str(devices["paths"][0])}}
    assert bystander.pid not in holders


def test_read_proc_survives_a_comm_with_spaces_and_parentheses(procs, devices, token, tmp_path):
    exe = tmp_path / "a) (b c"
    exe.symlink_to(os.path.realpath(sys.executable))
    child, _ = procs.start("term", f"z-{token}", [devices["paths"][0]], executable=str(exe))

    proc = gr.read_proc(child.pid)

    assert proc.comm == "a) (b c"
    assert proc.ppid == os.getpid()
    assert proc.pgid == child.pid and proc.sid == child.pid
    assert (f"z-{token}") in proc.cmdline


def test_own_tree_holds_ancestors_and_descendants_not_siblings(procs, devices, token):
    child, _ = procs.start("term", f"t-{token}", [devices["paths"][0]])
    all_procs = {p: gr.read_proc(p) for p in gr.list_pids()}
    all_procs = {p: v for p, v in all_procs.items() if v is not None}

    tree = gr.own_tree(all_procs)
    assert {os.getpid(), os.getppid(), child.pid} <= tree

    # Seen from the child, the test process is an ancestor but its other children are not.
    sibling, _ = procs.start("term", f"s-{token}", [devices["paths"][0]])
    all_procs[sibling.pid] = gr.read_proc(sibling.pid)
    assert sibling.pid not in gr.own_tree(all_procs, child.pid)


def test_own_process_is_never_a_target_even_when_it_holds_and_matches(devices):
    me = gr.read_proc(os.getpid())
    params = {
        "patterns": [re.escape(me.cmdline)],
        "device_pattern": devices["pattern"],
        "nvml": "false",
        "allow_foreign": False,
    }
    with open(devices["paths"][0]):
        result = gr.release(params, check_mode=True)

    assert result["targets"] == []
    assert [p["pid"] for p in result["own_tree"]] == [os.getpid()]


def test_target_refuses_to_signal_a_recycled_pid(procs, devices, token):
    child, _ = procs.start("term", f"r-{token}", [devices["paths"][0]])
    proc = gr.read_proc(child.pid)
    proc.starttime -= 1  # as if the pid had been reused since the scan
    target = gr.Target(proc, "test")

    assert target.send(signal.SIGKILL) is False
    target.close()
    assert child.poll() is None


def test_terminate_escalates_to_sigkill_only_for_the_stubborn(procs, devices, token):
    polite, _ = procs.start("term", f"p-{token}", [devices["paths"][0]])
    stubborn, _ = procs.start("stubborn", f"q-{token}", [devices["paths"][0]])
    targets = [gr.Target(gr.read_proc(p.pid), "test") for p in (polite, stubborn)]

    t0 = time.monotonic()
    timeline, stuck = gr.terminate(targets, grace=0.5, timeout=5, t0=t0)
    for target in targets:
        target.close()

    assert stuck == []
    assert [t.signal for t in targets] == ["SIGTERM", "SIGKILL"]
    assert targets[0].exited_s < 0.5 <= targets[1].exited_s
    assert timeline["sigkill_s"] >= 0.5


def test_unit_cgroup_names_the_unit_when_systemd_is_not_pid_1():
    if gr._pid1_name() == "systemd":
        pytest.skip("this host runs systemd as PID 1")

    def never(cmd):
        raise AssertionError("systemctl must not run without systemd")

    with pytest.raises(gr.GpuReleaseError) as err:
        gr.unit_cgroup("sglang-qwen", never)
    assert "'sglang-qwen.service'" in err.value.msg and "PID 1 is" in err.value.msg


def _proc_root_with_systemd(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "comm").write_text("systemd\n")
    return str(tmp_path)


def test_unit_cgroup_names_a_unit_that_does_not_exist(tmp_path):
    def systemctl(cmd):
        return 0, "LoadState=not-found\nControlGroup=\nSlice=\n", ""

    with pytest.raises(gr.GpuReleaseError) as err:
        gr.unit_cgroup("nope", systemctl, proc_root=_proc_root_with_systemd(tmp_path))
    assert "'nope.service' does not exist" in err.value.msg


def test_unit_cgroup_of_a_stopped_unit_is_derived_from_its_slice(tmp_path):
    def systemctl(cmd):
        assert cmd[-1] == "sglang-qwen.service"
        return 0, "LoadState=loaded\nControlGroup=\nSlice=system.slice\n", ""

    cgroup = gr.unit_cgroup("sglang-qwen", systemctl, proc_root=_proc_root_with_systemd(tmp_path))
    assert cgroup == "/system.slice/sglang-qwen.service"


def test_slice_path_nests_dashed_slices():
    assert gr._slice_path("system.slice") == "/system.slice"
    assert gr._slice_path("user-1000.slice") == "/user.slice/user-1000.slice"
    assert gr._slice_path("-.slice") == ""


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"patterns": [], "device_pattern": "/dev/nvidia*"}, "'patterns' is empty"),
        ({"patterns": ["x"], "device_pattern": ""}, "'device_pattern' is empty"),
        ({"patterns": ["x"], "device_pattern": "/dev/nvidia*", "grace": -1}, "'grace' is -1"),
        ({"patterns": ["x"], "device_pattern": "/dev/nvidia*", "nvml": "maybe"}, "'nvml' is 'maybe'"),
    ],
)
def test_validate_rejects_bad_parameters_with_the_fix(params, fragment):
    with pytest.raises(gr.GpuReleaseError) as err:
        gr.validate(params)
    assert fragment in err.value.msg


def test_no_process_is_ours_by_its_title_alone_by_default():
    assert gr.DEFAULT_PATTERNS == ()


def test_sglang_patterns_match_sglang_processes_only():
    patterns = gr.compile_patterns(gr.SGLANG_PATTERNS)

    def ours(cmdline):
        return any(regex.search(cmdline) for _, regex in patterns)

    assert ours("/usr/bin/python3 -m sglang.launch_server --model-path Qwen/Qwen3.6-27B --port 30000")
    assert ours("/opt/venv/bin/sglang serve --model-path m")
    assert ours("sglang::scheduler_TP0")
    assert ours("sglang::scheduler_DP1_TP3")
    assert ours("sglang::detokenizer")
    assert ours("sglang::data_parallel_controller")
    assert not ours("python train.py --notes sglang")
    assert not ours("nvidia-smi")


class FakeNvml:
    """NVML's view, scripted: each read() returns the next (gpus, procs) snapshot."""

    def __init__(self, snapshots):
        self.snapshots = list(snapshots)

    def read(self):
        gpus, procs = self.snapshots[0] if len(self.snapshots) == 1 else self.snapshots.pop(0)
        return [dict(g) for g in gpus], procs


def _gpu(used):
    return {"index": 0, "uuid": "GPU-x", "name": "test", "used_mb": used, "total_mb": 140000}


def test_wait_memory_succeeds_once_used_memory_falls_under_the_threshold():
    nvml = FakeNvml([([_gpu(47000)], {}), ([_gpu(20000)], {}), ([_gpu(500)], {})])
    ok, gpus, _ = gr.wait_memory(nvml, 1024, time.monotonic() + 5, spared_pids=set())
    assert ok and gpus[0]["used_mb"] == 500


def test_wait_memory_does_not_count_memory_of_processes_left_alone():
    # A foreign tenant holds 30 GiB; ours is gone once only that remains.
    nvml = FakeNvml([([_gpu(30900)], {777: [(0, 30000)]})])
    ok, gpus, _ = gr.wait_memory(nvml, 1024, time.monotonic() + 1, spared_pids={777})
    assert ok and gpus[0]["ours_mb"] == 900


def test_wait_memory_gives_up_at_the_deadline():
    nvml = FakeNvml([([_gpu(47000)], {})])
    started = time.monotonic()
    ok, _, _ = gr.wait_memory(nvml, 1024, started + 0.3, spared_pids=set())
    assert not ok and 0.3 <= time.monotonic() - started < 2


class _Cgroups:
    def __init__(self, *paths):
        self.cgroups = list(paths)


UNIT = "/system.slice/sglang-qwen.service"


def test_in_cgroup_matches_a_container_path_seen_from_the_host_namespace():
    # nspawn without a cgroup namespace: /proc shows the host's path, systemctl the container's.
    assert gr.in_cgroup(_Cgroups("/payload" + UNIT), UNIT)
    assert gr.in_cgroup(_Cgroups(UNIT + "/init.scope"), UNIT)


def test_in_cgroup_refuses_a_sibling_whose_name_shares_a_suffix():
    assert not gr.in_cgroup(_Cgroups("/system.slice/xsglang-qwen.service"), UNIT)
    assert not gr.in_cgroup(_Cgroups(UNIT + "2"), UNIT)
    assert not gr.in_cgroup(_Cgroups("/"), UNIT)


# --- two SGLang trees on one host: ours and another tenant's ----------------------------------------

# A stand-in for `python -m sglang.launch_server --port P`: holds a device and forks a worker that
# leaves the process group (as a leaked sglang::scheduler can), so stopping the group misses it.
FAKE_SGLANG = r"""
import os, sys, time
files = sys.argv[2:]
if os.fork() == 0:
    os.setsid()
    handles = [open(path) for path in files]
    os.write(1, b"worker %d\n" % os.getpid())  # one write: the two processes share the output
else:
    handles = [open(path) for path in files]
    os.write(1, b"launcher %d\n" % os.getpid())
while True:
    time.sleep(1)
"""


@pytest.fixture
def two_tenants(procs, devices, tmp_path):
    """Ours started and stopped by the sglang_service process backend (its worker survives the stop); another
    tenant's server with the same command line in its own session, on another port."""
    run = tmp_path / "run"
    log = run / "server.log"
    tree_file = run / "server.tree.json"
    run.mkdir()
    argv = [sys.executable, "-c", FAKE_SGLANG, "sglang.launch_server --port 31001", str(devices["paths"][0])]
    server = ProcessServer({"argv": argv, "pid_file": str(run / "server.pid"), "log_file": str(log)})
    server.launch()
    deadline = time.monotonic() + 20
    # The launcher logs before its worker has started: wait for the worker's own line.
    while not (found := re.search(r"worker (\d+)", log.read_text())):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    worker = int(found.group(1))
    procs.extra.append(pinned(worker))
    tenant = subprocess.Popen(
        [sys.executable, "-c", FAKE_SGLANG, "sglang.launch_server --port 31002", str(devices["paths"][1])],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    procs.popens.append(tenant)
    tenant_pids = [int(tenant.stdout.readline().split()[1]) for _ in range(2)]
    procs.extra.extend(pinned(pid) for pid in tenant_pids)
    stopped = server.stop(5, str(tree_file))
    assert stopped["changed"] is True and alive(*pinned(worker)), "the worker must outlive the stop"
    tenants = [pinned(p) for p in tenant_pids]
    return {"tree_file": str(tree_file), "ours": pinned(worker), "tenant": tenants}


def test_only_our_recorded_leftover_dies_and_the_other_tenants_sglang_lives(two_tenants, devices, tmp_path):
    result = run_module(
        {
            "tree_file": two_tenants["tree_file"],
            "device_pattern": devices["pattern"],
            "nvml": "false",
            "grace": 1.0,
            "timeout": 10,
            "allow_foreign": True,
        },
        tmp_path,
    )

    assert result["failed"] is False, result.get("msg")
    assert [k["pid"] for k in result["killed"]] == [two_tenants["ours"][0]]
    assert "recorded" in result["killed"][0]["reason"]
    assert wait_dead(two_tenants["ours"])
    for tenant in two_tenants["tenant"]:
        assert alive(*tenant), "another tenant's SGLang must never be signalled"
    assert {f["pid"] for f in result["foreign"]} == {p for p, _ in two_tenants["tenant"]}


def test_another_tenants_sglang_refuses_the_release_without_a_change(two_tenants, devices, tmp_path):
    result = run_module(
        {"tree_file": two_tenants["tree_file"], "device_pattern": devices["pattern"], "nvml": "false"},
        tmp_path,
    )

    assert result["failed"] is True and result["changed"] is False
    assert "31002" in result["msg"]
    assert alive(*two_tenants["ours"]) and all(alive(*t) for t in two_tenants["tenant"])


def test_a_recycled_pid_in_the_tree_file_is_not_ours(procs, devices, token, tmp_path):
    holder, _ = procs.start("term", f"x-{token}", [devices["paths"][0]])
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps([{"pid": holder.pid, "starttime": _starttime(holder.pid) + 1}]))
    result = run_module(
        {"tree_file": str(tree), "device_pattern": devices["pattern"], "nvml": "false", "allow_foreign": 1},
        tmp_path,
    )

    assert result["killed"] == [] and holder.poll() is None
