"""One child of the development server's process tree: a scheduler rank or the detokenizer.

Started by process_tree.py as `sglang::scheduler_TP<n>` or `sglang::detokenizer` (argv[0], as SGLang's
setproctitle shows them: sglang 0.5.23 srt/managers/scheduler.py:6294, detokenizer_manager.py:551).
Like SGLang's children it asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG,
scheduler.py:6269 and detokenizer_manager.py:550 through utils/common.py:3432-3437), and on an
exception it logs "Scheduler hit an exception" and SIGQUITs its parent (scheduler.py:6370-6373).

A scheduler holds its device for its whole life (its CUDA context: a release frees memory, not the
device). On CPU the device is a file (`--device-file`), as the project's gpu_release tests model GPUs.
It answers the parent one JSON line per request on stdin/stdout:
- {"op": "ping"}: {"ok": true}
- {"op": "release", "tags": [...]}: the tags join its released set (weight_updater.py:348-349).
- {"op": "resume", "tags": [...]}: each tag leaves the set, KeyError when it was not released
  (weight_updater.py:389-390); then the memory is allocated again, which fails (CUDA out of memory,
  :393-406) while a process outside the server holds the device: on CPU, the memory of a device is
  taken while another process holds its file.
Standard library only, so that a child costs a Python interpreter and nothing more.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1


def _prctl(option: int, value: int | bytes) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0)
    except OSError:
        pass


def _tree_of(root: int) -> set[int]:
    """root and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, []))
    return tree


def holders_outside(path: str, server: int) -> list[int]:
    """Processes that hold `path` open and are not part of the server's tree."""
    target = os.path.realpath(path)
    ours = _tree_of(server)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in ours:
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") == target:
                    found.append(int(entry))
                    break
            except OSError:
                continue
    return sorted(found)


class Rank:
    def __init__(self, title: str, device_file: str | None) -> None:
        self.title = title
        self.device_file = device_file
        self.device = open(device_file, "a+b") if device_file else None  # noqa: SIM115 (held for life)
        self.offload_tags: set[str] = set()

    def handle(self, request: dict) -> dict:
        op = request.get("op")
        tags = list(request.get("tags") or [])
        if op == "release":
            self.offload_tags.update(tags)
        elif op == "resume":
            for tag in tags:
                self.offload_tags.remove(tag)
            if self.device_file:
                others = holders_outside(self.device_file, os.getppid())
                if others:
                    raise MemoryError(
                        f"torch.OutOfMemoryError: CUDA out of memory while resuming {', '.join(tags)} on "
                        f"{self.device_file}: held by pid(s) {others} outside the server"
                    )
        return {"ok": True}


def main() -> int:
    title = os.environ.get("SPECOPS_DEVSERVER_TITLE") or sys.argv[0]
    parent = int(os.environ["SPECOPS_DEVSERVER_PARENT"])
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        return 1
    _prctl(PR_SET_NAME, title.encode()[:15])
    rank = Rank(title, os.environ.get("SPECOPS_DEVSERVER_DEVICE_FILE") or None)
    sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            answer = rank.handle(json.loads(line))
        except Exception:  # any failure ends the tree, as SGLang's scheduler does
            sys.stderr.write(f"[{title}] Scheduler hit an exception: {traceback.format_exc()}")
            sys.stderr.flush()
            os.kill(parent, signal.SIGQUIT)
            return 1
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
