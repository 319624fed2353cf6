"""The shape of eval.yml, read statically: how many task files a run can reach, how deep includes go,
and the one always: that brings the service back. A window that is easy to follow stays that way."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
EVAL = ROOT / "playbooks" / "eval.yml"
INCLUDES = ("ansible.builtin.include_tasks", "ansible.builtin.import_tasks", "include_tasks", "import_tasks")
ROLES = ("ansible.builtin.include_role", "ansible.builtin.import_role", "include_role", "import_role")


def tasks_of(items):
    """Every task in a list of tasks, blocks opened (block, rescue, always)."""
    for item in items or []:
        if any(key in item for key in ("block", "rescue", "always")):
            for key in ("block", "rescue", "always"):
                yield from tasks_of(item.get(key))
        else:
            yield item


def candidates(value: str) -> list[str]:
    """A templated name stands for each quoted literal in it; a plain name for itself."""
    return re.findall(r"'([^']+)'", value) if "{{" in value else [value]


def reached(path: Path, depth: int = 0, seen: dict | None = None) -> dict[Path, int]:
    """{task file: deepest include depth} for every task file reachable from `path`."""
    seen = {} if seen is None else seen
    items = yaml.safe_load(path.read_text()) or []
    # A playbook's plays hold the tasks; a task file is the tasks.
    items = [task for play in items for task in play.get("tasks", [])] if "hosts" in items[0] else items
    for task in tasks_of(items):
        for key in INCLUDES:
            if key in task:
                spec = task[key]
                name = spec["file"] if isinstance(spec, dict) else spec
                for option in candidates(name):
                    found = path.parent / option
                    if found.is_file() and seen.get(found, -1) < depth + 1:
                        seen[found] = depth + 1
                        reached(found, depth + 1, seen)
        for key in ROLES:
            if key in task:
                spec = task[key]
                for option in candidates(spec.get("tasks_from", "main")):
                    found = (
                        ROOT
                        / "roles"
                        / spec["name"].split(".")[-1]
                        / "tasks"
                        / (option.removesuffix(".yml") + ".yml")
                    )
                    if found.is_file() and seen.get(found, -1) < depth + 1:
                        seen[found] = depth + 1
                        reached(found, depth + 1, seen)
    return seen


def test_eval_reaches_at_most_eighteen_task_files():
    # 16: the scoring host's shipping (tasks/score_on_host.yml) runs after the window, in a file of its own;
    # 18: the scoring's start and its wait (score_drafter's start.yml, wait.yml), which the window in one
    # step runs apart (started before the pause, read after the service is back).
    files = reached(EVAL)
    assert len(files) <= 18, sorted(str(f.relative_to(ROOT)) for f in files)


def test_includes_go_at_most_three_deep():
    deepest = max(reached(EVAL).values())
    assert deepest <= 3, {str(f.relative_to(ROOT)): d for f, d in reached(EVAL).items() if d > 3}


def test_the_window_is_one_block_whose_always_brings_the_service_back():
    window = yaml.safe_load((ROOT / "playbooks" / "tasks" / "window.yml").read_text())
    blocks = [task for task in window if "block" in task]
    assert len(blocks) == 1 and "rescue" not in blocks[0]
    states = [
        task.get("vars", {}).get("sglang_service_state", "")
        for task in blocks[0]["always"]
        if task.get("ansible.builtin.include_role", {}).get("name") == "sglang_service"
    ]
    assert states == ["{{ specops_window_server_states.back }}"]
    # The one table that pairs each mode with the server's states it takes.
    main_play = yaml.safe_load((ROOT / "playbooks" / "eval.yml").read_text())[1]
    table = main_play["vars"]["specops_window_server_states"]
    for mode, down, back in (("stop", "stopped", "started"), ("memory_saver", "released", "resumed")):
        assert f"'{mode}': {{'down': '{down}', 'back': '{back}'}}" in " ".join(table.split()), table


def test_the_run_lock_is_given_back_in_one_place():
    releases = [
        task
        for play in yaml.safe_load(EVAL.read_text())
        for task in tasks_of(play.get("tasks", []))
        if task.get("specops.drafter.run_lock", {}).get("state") == "released"
    ]
    assert len(releases) == 1
