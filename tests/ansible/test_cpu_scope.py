"""The command line of scoring on the bounded CPU: a systemd scope with CPUQuota and Nice where systemd
is PID 1 and may be asked, `nice -n` (threads bounded, quota not enforced) elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "collections"))

from ansible_collections.specops.drafter.plugins.module_utils.stages import cpu_scope  # noqa: E402

COMMAND = ["/opt/specops/ml/bin/python", "-m", "specops.score", "--run"]
BOUNDS = {"nice": 10, "cpu_quota_percent": 400, "threads": 4}


def test_root_on_a_systemd_host_runs_the_stage_in_a_system_scope_with_quota_and_nice():
    manager = cpu_scope.systemd_manager("systemd\n", euid=0, user_bus_exists=False)
    assert manager == "system"
    assert cpu_scope.bounded_argv(COMMAND, BOUNDS, manager) == [
        "systemd-run", "--scope", "--quiet", "-p", "CPUQuota=400%", "--nice=10", *COMMAND,
    ]  # fmt: skip


def test_a_user_with_a_user_manager_asks_it_for_the_scope():
    manager = cpu_scope.systemd_manager("systemd", euid=1000, user_bus_exists=True)
    assert manager == "user"
    assert cpu_scope.bounded_argv(COMMAND, BOUNDS, manager)[:3] == ["systemd-run", "--user", "--scope"]


def test_without_systemd_as_pid_1_the_stage_runs_under_nice():
    # A container (PID 1 is a shell or an init of its own), or a user without a user manager.
    for manager in (
        cpu_scope.systemd_manager("bash", euid=0, user_bus_exists=True),
        cpu_scope.systemd_manager("systemd", euid=1000, user_bus_exists=False),
    ):
        assert manager is None
        assert cpu_scope.bounded_argv(COMMAND, BOUNDS, manager) == ["nice", "-n", "10", *COMMAND]


def test_the_threads_are_bounded_through_the_math_libraries_environment():
    assert cpu_scope.thread_environment(BOUNDS) == {
        "OMP_NUM_THREADS": "4",
        "MKL_NUM_THREADS": "4",
        "OPENBLAS_NUM_THREADS": "4",
    }
    assert cpu_scope.thread_environment({}) == {}


def test_no_bounds_leave_the_command_as_it_is():
    assert cpu_scope.bounded_argv(COMMAND, {}, "system") == COMMAND


def test_unusable_bounds_are_named():
    problems = cpu_scope.check_bounds({"nice": 25, "cpu_quota_percent": 0, "threads": -1})
    assert problems == [
        "nice 25 is outside -20..19",
        "cpu_quota_percent 0 must be positive (100 is one core)",
        "threads -1 must be positive",
    ]


def test_the_default_quota_and_threads_are_a_quarter_of_the_cores():
    assert (cpu_scope.default_quota_percent(32), cpu_scope.default_threads(32)) == (800, 8)
    assert (cpu_scope.default_quota_percent(2), cpu_scope.default_threads(2)) == (50, 1)


def test_bounds_that_leave_keys_out_get_the_defaults_and_none_stay_none():
    filled = cpu_scope.with_defaults({"nice": 5}, cores=16)
    assert filled == {"nice": 5, "cpu_quota_percent": 400, "threads": 4}
    assert cpu_scope.with_defaults({}, cores=16) == {}
