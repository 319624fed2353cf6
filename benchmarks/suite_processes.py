#!/usr/bin/env python3
"""Where a command's CPU goes, process by process: for `make test`, by lane, by kind of process and by test.

    benchmarks/suite_processes.py run PREFIX -- COMMAND...   (root: BSD process accounting)
    benchmarks/suite_processes.py report PREFIX [--top N] [--json FILE] [--test TEXT]

`run` switches the kernel's process accounting on (acct(2), one record with the CPU time of every process
as it exits, however short) and samples /proc every 0.1 s for new processes: parent, command line, and the
test that was running when pytest started it (PYTEST_CURRENT_TEST, which children inherit, so the
development servers and ansible's module processes a test starts are counted to it). A process too short
to be sampled is counted where its parent is. Files: PREFIX.acct, PREFIX.pids.

`report` sums the records by lane (the .ci/heartbeat.py label above a process), by kind of process and
by test, counting only the command's own descendants; the sampler's own CPU is given apart. --test counts
only the processes of the tests whose id contains TEXT (what one test's CPU went to).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import re
import resource
import struct
import subprocess
import sys
import threading
from pathlib import Path

# struct acct_v3 (linux/acct.h): 64 bytes, comp_t times in AHZ (100 per second).
ACCT_V3 = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")
AHZ = 100
SAMPLE_S = 0.1
NO_TEST = "(no test)"  # what --test names the processes started outside any test with


def comp_t(value: int) -> int:
    """comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def sample(pids_file, stop: threading.Event) -> None:
    seen: set[tuple[str, int]] = set()
    listed: set[str] = set()
    while not stop.is_set():
        names = set(os.listdir("/proc"))
        # A pid listed last time is the same process (pids are not reused within 0.1 s): only new ones
        # are read, which keeps the sampler's own cost small.
        new, listed = names - listed, names
        for name in new:
            if not name.isdigit():
                continue
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                key = (name, int(fields[19]))
                if key in seen:
                    continue
                seen.add(key)
                cmdline = (
                    Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
                environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
                test = next(
                    (
                        e[20:].decode(errors="replace")
                        for e in environ
                        if e.startswith(b"PYTEST_CURRENT_TEST=")
                    ),
                    None,
                )
                pids_file.write(json.dumps([int(name), int(fields[1]), key[1], cmdline[:2000], test]) + "\n")
            except (OSError, IndexError, ValueError):
                continue  # gone before it could be read
        stop.wait(SAMPLE_S)


def run(prefix: str, command: list[str]) -> int:
    acct_path = Path(prefix + ".acct")
    acct_path.write_bytes(b"")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(acct_path).encode()) != 0:
        sys.exit(f"acct({acct_path}): {os.strerror(ctypes.get_errno())} (process accounting needs root)")
    stop = threading.Event()
    with open(prefix + ".pids", "w") as pids_file:
        sampler = threading.Thread(target=sample, args=(pids_file, stop), daemon=True)
        sampler.start()
        try:
            process = subprocess.Popen(command)
            # Only what descends from the command is counted: accounting records every process of the host.
            # The boot time turns the sampled start ticks into dates; a report made after a reboot needs it.
            pids_file.write(json.dumps({"root": process.pid, "boot": boot_time()}) + "\n")
            return process.wait()
        finally:
            stop.set()
            sampler.join()
            libc.acct(None)
            used = resource.getrusage(resource.RUSAGE_SELF)
            pids_file.write(json.dumps({"sampler_core_s": round(used.ru_utime + used.ru_stime, 1)}) + "\n")


def kind(cmdline: str, comm: str) -> str:
    """A short name for what a process is."""
    if m := re.search(r"-m (specops\.[\w.]+)(?: (--plan|--run))?", cmdline):
        return " ".join(filter(None, m.groups()))
    if m := re.search(r"AnsiballZ_(\w+)", cmdline):
        return f"module {m.group(1)}"
    # The program: the executable, or the script or module an interpreter runs.
    words = cmdline.split()
    program = " ".join(Path(word).name for word in words[:3])
    for name in (
        "ansible-playbook",
        "ansible-test",
        "ansible-lint",
        "ansible-doc",
        "ansible",
        "mypy",
        "molecule",
        "pytest",
        "debootstrap",
        "sglang_router",
    ):
        if re.search(rf"(^| ){re.escape(name)}( |$)", program):
            return name
    if "exec(eval(sys.stdin.readline()))" in cmdline:
        return "pytest-xdist worker"
    if comm.startswith("python") and len(words) > 1:
        # The script, or the first words of a -c or -m program.
        return f"{comm} " + (" ".join(words[1:3])[:60] if words[1].startswith("-") else Path(words[1]).name)
    return comm


def boot_time() -> float:
    return float(Path("/proc/stat").read_text().split("btime ")[1].split()[0])


def recorded_boot(prefix: str, root: int | None, root_start: int | None) -> float:
    """The boot time of the run: from its .pids header, else from the root process's accounting record
    (its creation date less its start ticks), else this boot's."""
    for line in open(prefix + ".pids"):
        row = json.loads(line)
        if isinstance(row, dict) and "boot" in row:
            return float(row["boot"])
    data = Path(prefix + ".acct").read_bytes()
    for offset in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        fields = ACCT_V3.unpack_from(data, offset)
        if root is not None and root_start is not None and fields[6] == root:
            return fields[8] - root_start / os.sysconf("SC_CLK_TCK")
    return boot_time()


def report(prefix: str, top: int, json_out: str | None, only_test: str | None = None) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    rows = [json.loads(line) for line in open(prefix + ".pids")]
    header_root = next((r["root"] for r in rows if isinstance(r, dict) and "root" in r), None)
    root_start = next((r[2] for r in rows if isinstance(r, list) and r[0] == header_root), None)
    boot = recorded_boot(prefix, header_root, root_start)
    # pid -> every process sampled under it: (start, pid, ppid, cmdline, test)
    sampled: dict[int, list[tuple[float, int, int, str, str | None]]] = collections.defaultdict(list)
    root, own = None, 0.0
    for row in rows:
        if isinstance(row, dict):
            root = row.get("root", root)
            own = row.get("sampler_core_s", own)
            continue
        pid, ppid, start, cmdline, *test = row
        sampled[pid].append((boot + start / hz, pid, ppid, cmdline, test[0] if test else None))

    def seen_as(pid: int, when: float):
        candidates = [s for s in sampled.get(pid, ()) if s[0] <= when + 1.5]
        return max(candidates, key=lambda s: s[0]) if candidates else None

    def ancestry(entry):
        """The entry, its parent, and so on up, as far as they were sampled."""
        for _ in range(60):
            if entry is None:
                return
            yield entry
            entry = seen_as(entry[2], entry[0])

    def descends(entry) -> bool:
        return root is None or any(root in (e[1], e[2]) for e in ancestry(entry))

    def lane_of(entry) -> str | None:
        for e in ancestry(entry):
            if m := re.search(r"heartbeat\.py (\S+)", e[3]):
                return m.group(1)
        return None

    by_lane, by_kind, by_test = collections.Counter(), collections.Counter(), collections.Counter()
    count = collections.Counter()
    total = 0.0
    data = Path(prefix + ".acct").read_bytes()
    for offset in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        fields = ACCT_V3.unpack_from(data, offset)
        pid, ppid, btime = fields[6], fields[7], fields[8]
        cpu = (comp_t(fields[10]) + comp_t(fields[11])) / AHZ
        comm = fields[18].split(b"\0")[0].decode(errors="replace")
        itself = seen_as(pid, btime)
        entry = itself or seen_as(ppid, btime)
        if pid != root and not descends(entry):
            continue
        test = entry[4] if entry else None
        if only_test is not None and only_test not in (test or NO_TEST):
            continue
        total += cpu
        name = kind(itself[3], comm) if itself else f"{comm} (short)"
        by_kind[name] += cpu
        count[name] += 1
        by_lane[lane_of(entry) or "(set-up, outside the lanes)"] += cpu
        by_test[re.sub(r" \((setup|call|teardown)\)$", "", test) if test else NO_TEST] += cpu

    def table(title: str, counter: collections.Counter, n: int) -> None:
        print(f"\n{title}")
        for key, value in counter.most_common(n):
            print(
                f"  {value:8.1f} core-s  {value / total:6.1%}  {key}"
                + (f"  ({count[key]} processes)" if counter is by_kind else "")
            )

    print(f"{total:.0f} core-s in {sum(count.values())} processes (the sampler's own {own:.0f} not counted)")
    table("by lane", by_lane, top)
    table("by kind of process", by_kind, top)
    table("by test (what each test started, its servers included)", by_test, top)
    if json_out:
        Path(json_out).write_text(
            json.dumps(
                {
                    "core_s": round(total),
                    "sampler_core_s": round(own),
                    "by_lane": {k: round(v, 1) for k, v in by_lane.most_common()},
                    "by_kind": {k: round(v, 1) for k, v in by_kind.most_common(top)},
                    "by_test": {k: round(v, 1) for k, v in by_test.most_common()},
                },
                indent=1,
            )
            + "\n"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    run_parser = sub.add_parser("run")
    run_parser.add_argument("prefix")
    run_parser.add_argument("command", nargs=argparse.REMAINDER)
    report_parser = sub.add_parser("report")
    report_parser.add_argument("prefix")
    report_parser.add_argument("--top", type=int, default=30)
    report_parser.add_argument("--json")
    report_parser.add_argument("--test", help="only the processes of the tests whose id contains this")
    args = parser.parse_args()
    if args.action == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        return run(args.prefix, command)
    report(args.prefix, args.top, args.json, args.test)
    return 0


if __name__ == "__main__":
    sys.exit(main())
