"""SGLang's process tree, and how it dies.

SGLang's launcher runs HTTP and the tokenizer manager; it spawns one scheduler per TP rank, each on its
own GPU, and a detokenizer (sglang 0.5.23 srt/entrypoints/engine.py). Every child dies with its parent
(PR_SET_PDEATHSIG SIGKILL: managers/scheduler.py:6269, detokenizer_manager.py:550). A child that hits
an exception SIGQUITs the launcher (scheduler.py:6370-6373); one that dies without a word is seen by
the launcher's watchdog within a second (utils/watchdog.py:211-221), which SIGQUITs itself. The
launcher's SIGQUIT handler (managers/tokenizer_manager.py:4072-4081) kills the tree
(utils/common.py:2507-2554): every child with SIGKILL, then itself with SIGKILL, so it exits by signal 9.

With `--tp-size N` > 1 the development server runs that tree: N scheduler children, each holding its
own device (on CPU a device file, `--device-file`), and a detokenizer; they are light processes
(rank.py) that answer the launcher over a pipe. The model's compute stays in the launcher: on CPU it
holds no device, so the processes that hold the GPUs are the scheduler children, as in SGLang, and a
holder scan (gpu_release) finds exactly them. On CUDA the launcher would hold the memory itself, so a
tree on CUDA is refused rather than shown with the wrong holder.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, NoReturn

logger = logging.getLogger("specops.devserver")

# The tree this process launched, for the crash path (memory.scheduler_crash) and the watchdog.
_children: list[subprocess.Popen] = []


def kill_tree_and_exit() -> NoReturn:
    """What SGLang's launcher does on SIGQUIT: SIGKILL every child, wait for them, SIGKILL itself."""
    for child in _children:
        if child.poll() is None:
            child.kill()
    deadline = time.monotonic() + 60
    for child in _children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(137)  # not reached: SIGKILL cannot be caught


def _on_sigquit(signum: int, frame: Any) -> None:
    logger.error("SIGQUIT received. It usually means one child failed.")
    kill_tree_and_exit()


class Child:
    """One child and its pipe; calls are answered in order, one at a time."""

    def __init__(self, title: str, device_file: str | None) -> None:
        env = dict(os.environ)
        env.update(SPECOPS_DEVSERVER_TITLE=title, SPECOPS_DEVSERVER_PARENT=str(os.getpid()))
        env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path and os.path.isdir(path))
        if device_file:
            env["SPECOPS_DEVSERVER_DEVICE_FILE"] = device_file
        self.title = title
        self.device_file = device_file
        # argv[0] is the title: /proc/<pid>/cmdline starts with it, as setproctitle makes SGLang's.
        self.process = subprocess.Popen(
            [title, "-m", "specops.devserver.rank"],
            executable=sys.executable,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        _children.append(self.process)
        self.lock = threading.Lock()
        first = self._read()
        if first is None or "ready" not in first:
            raise RuntimeError(f"{title} did not start (exit {self.process.poll()})")

    def _read(self) -> dict | None:
        stdout: IO[str] = self.process.stdout  # type: ignore[assignment]
        line = stdout.readline()
        return json.loads(line) if line else None

    def call(self, request: dict) -> None:
        with self.lock:
            stdin: IO[str] = self.process.stdin  # type: ignore[assignment]
            try:
                stdin.write(json.dumps(request) + "\n")
                stdin.flush()
                answer = self._read()
            except (BrokenPipeError, ValueError):
                answer = None
        if answer is None:
            # The child died; its SIGQUIT or the watchdog ends the tree. The caller never gets an answer.
            while True:
                time.sleep(1)


class ProcessTree:
    """The launcher's children: schedulers TP0..TP<n-1> and a detokenizer."""

    def __init__(self, tp_size: int, device_files: list[str]) -> None:
        signal.signal(signal.SIGQUIT, _on_sigquit)
        self.schedulers = [
            Child(f"sglang::scheduler_TP{rank}", device_files[rank] if device_files else None)
            for rank in range(tp_size)
        ]
        self.detokenizer = Child("sglang::detokenizer", None)
        self.watching = threading.Event()
        self.watching.set()
        threading.Thread(target=self._watch, name="subprocess-watchdog", daemon=True).start()
        logger.info(
            "process tree: %s",
            ", ".join(f"{c.title} pid {c.process.pid}" for c in [*self.schedulers, self.detokenizer]),
        )

    def _watch(self) -> None:
        # utils/watchdog.py:211-221: a child gone with a non-zero code SIGQUITs the launcher.
        while True:
            time.sleep(0.5)
            if not self.watching.is_set():
                return
            for child in [*self.schedulers, self.detokenizer]:
                code = child.process.poll()
                if code is not None and code != 0:
                    logger.error(
                        "Subprocess %s (pid=%d) crashed with exit code %d. Triggering SIGQUIT for cleanup...",
                        child.title,
                        child.process.pid,
                        code,
                    )
                    if self.watching.is_set():
                        os.kill(os.getpid(), signal.SIGQUIT)
                    return

    def stop_watching(self) -> None:
        """Shutting down: a child that exits now is no crash."""
        self.watching.clear()

    def every_scheduler(self, op: str, tags: list[str]) -> None:
        """Each rank does its part of a release or resume (SGLang runs them on every TP rank)."""
        for child in self.schedulers:
            child.call({"op": op, "tags": sorted(tags)})

    def stop(self) -> None:
        """A graceful end: the children exit when their pipe closes."""
        for child in [*self.schedulers, self.detokenizer]:
            if child.process.stdin:
                child.process.stdin.close()
        for child in [*self.schedulers, self.detokenizer]:
            try:
                child.process.wait(10)
            except subprocess.TimeoutExpired:
                child.process.kill()


def device_files_for(template: str | None, tp_size: int) -> list[str]:
    """`--device-file DIR/nvidia{rank}` for each rank; [] without one."""
    if not template:
        return []
    if "{rank}" not in template:
        raise ValueError(f"--device-file {template} must contain {{rank}}, e.g. /tmp/devs/nvidia{{rank}}")
    return [template.format(rank=rank) for rank in range(tp_size)]
