# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""/proc read one way for every module: stat and start time, cmdline, environment tokens, trees, listeners.

Standard library only: the sglang_service guard runs it outside Ansible.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import collections
import fnmatch
import os
import re

Stat = collections.namedtuple("Stat", ["state", "ppid", "pgid", "sid", "starttime"])

WINDOW_TOKEN_VARIABLE = "SPECOPS_WINDOW_TOKEN"
# The stage host's module (module_utils/stages/stage_host.py starts it): the stages it forks keep its command line.
STAGE_HOST_MODULE = "specops.stage_host"
# The run directory's lock token, in every task of eval.yml: run_lock's holder waits for its carriers.
RUN_LOCK_VARIABLE = "SPECOPS_RUN_LOCK"


def _read(path: str, mode: str = "r"):
    with open(path, mode) as handle:
        return handle.read()


def read_stat(pid: int, proc_root: str = "/proc") -> Stat | None:
    """A Stat of pid, or None when it is gone or its stat cannot be read."""
    try:
        raw = _read("%s/%d/stat" % (proc_root, pid))
    except (IOError, OSError):
        return None
    # comm may hold spaces and parentheses; the fields after the last ')' are fixed.
    fields = raw[raw.rfind(")") + 2:].split() if ")" in raw else []
    if len(fields) < 20:
        return None
    return Stat(fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))


def start_time(pid: int, proc_root: str = "/proc") -> int | None:
    """Clock ticks after boot when pid started: with the pid, the identity of one process."""
    stat = read_stat(pid, proc_root)
    return stat.starttime if stat else None


def is_gone(pid: int, proc_root: str = "/proc") -> bool:
    """Exited, or a zombie that only waits to be reaped."""
    stat = read_stat(pid, proc_root)
    return stat is None or stat.state in ("Z", "X")


def is_same_process(pid: int, started: int | None, proc_root: str = "/proc") -> bool:
    """pid still runs the process that started at `started` (a recycled pid does not count)."""
    return started is not None and not is_gone(pid, proc_root) and start_time(pid, proc_root) == started


# Options whose values are secrets (SGLang's --api-key and --admin-api-key): a command line read here or logged by
# the module shows them redacted, so no record, message or log carries a key.
SECRET_OPTIONS = ("--api-key", "--admin-api-key")
REDACTED = "<redacted>"


def redact_argv(argv: list) -> list:
    shown = []
    hide_next = False
    for word in argv:
        name, equals, dummy = str(word).partition("=")
        if hide_next:
            shown.append(REDACTED)
            hide_next = False
        elif name in SECRET_OPTIONS and equals:
            shown.append(name + "=" + REDACTED)
        else:
            shown.append(str(word))
            hide_next = word in SECRET_OPTIONS
    return shown


# A key in a server's log: the argv form, and SGLang's own `server_args={... 'api_key': '...'}` line at start
# (sglang 0.5.23 srt/entrypoints/engine.py:173-174, :311 logs both keys).
_SECRET_IN_TEXT = re.compile(r"""(--(?:admin-)?api-key[= ]|['"]?(?:admin_)?api_key['"]?\s*[:=]\s*)(['"]?)([^\s'",)]+)""")


def redact_text(text: str) -> str:
    """Log lines with every key value replaced, for messages that quote a server's log."""
    return _SECRET_IN_TEXT.sub(lambda match: match.group(1) + match.group(2) + REDACTED, text or "")


def cmdline(pid: int, proc_root: str = "/proc") -> str:
    try:
        raw = _read("%s/%d/cmdline" % (proc_root, pid), "rb")
    except (IOError, OSError):
        return ""
    # setproctitle pads the argument area with NULs or spaces.
    return " ".join(redact_argv([part for part in raw.decode("utf-8", "replace").split("\0") if part])).strip()


def comm(pid: int, proc_root: str = "/proc") -> str:
    try:
        return _read("%s/%d/comm" % (proc_root, pid)).strip()
    except (IOError, OSError):
        return ""


def list_pids(proc_root: str = "/proc") -> list[int]:
    return sorted(int(name) for name in os.listdir(proc_root) if name.isdigit())


class Proc(object):
    """What /proc says about one process, read once."""

    __slots__ = ("pid", "ppid", "pgid", "sid", "state", "starttime", "uid", "comm", "cmdline", "cgroups")

    def __init__(self, pid, ppid, pgid, sid, state, starttime, uid, comm, cmdline, cgroups):
        self.pid = pid
        self.ppid = ppid
        self.pgid = pgid
        self.sid = sid
        self.state = state
        self.starttime = starttime
        self.uid = uid
        self.comm = comm
        self.cmdline = cmdline
        self.cgroups = cgroups

    @property
    def user(self) -> str:
        import pwd

        try:
            return pwd.getpwuid(self.uid).pw_name
        except (KeyError, TypeError):
            return str(self.uid)

    @property
    def names(self) -> set[str]:
        """Names a protected entry can match: the kernel's comm and argv[0]'s basename."""
        names = set([self.comm])
        if self.cmdline:
            names.add(os.path.basename(self.cmdline.split(" ", 1)[0]))
        return names

    def describe(self) -> dict:
        return {"pid": self.pid, "ppid": self.ppid, "user": self.user, "cmdline": self.cmdline}


def read_proc(pid: int, proc_root: str = "/proc") -> Proc | None:
    """A Proc for pid, or None when it has exited (or is unreadable)."""
    stat = read_stat(pid, proc_root)
    if stat is None:
        return None
    base = "%s/%d" % (proc_root, pid)
    try:
        name = _read(base + "/comm").rstrip("\n")
        status = _read(base + "/status")
    except (IOError, OSError):
        return None
    uid = None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            uid = int(line.split()[1])
            break
    try:
        cgroups = [line.split(":", 2)[2] for line in _read(base + "/cgroup").splitlines() if line.count(":") >= 2]
    except (IOError, OSError):
        cgroups = []
    return Proc(pid, stat.ppid, stat.pgid, stat.sid, stat.state, stat.starttime, uid, name,
                cmdline(pid, proc_root), cgroups)


def scan_fd_holders(device_pattern: str, proc_root: str = "/proc") -> tuple[dict, list]:
    """Processes with an open file matching the glob: ({pid: set(paths)}, [pids we could not read])."""
    holders: dict = {}
    unreadable = []
    for pid in list_pids(proc_root):
        fd_dir = "%s/%d/fd" % (proc_root, pid)
        try:
            fds = os.listdir(fd_dir)
        except OSError as exc:
            # Gone since listing (ENOENT) is normal; EACCES means we lack the rights to see it.
            if getattr(exc, "errno", None) not in (2, 3):
                unreadable.append(pid)
            continue
        for fd in fds:
            try:
                target = os.readlink("%s/%s" % (fd_dir, fd))
            except OSError:
                continue
            if fnmatch.fnmatchcase(target, device_pattern):
                holders.setdefault(pid, set()).add(target)
    return holders, unreadable


def parents(proc_root: str = "/proc") -> dict[int, int]:
    """{pid: ppid} of every visible process."""
    table = {}
    for pid in list_pids(proc_root):
        stat = read_stat(pid, proc_root)
        if stat:
            table[pid] = stat.ppid
    return table


def process_tree(root: int, proc_root: str = "/proc") -> list[int]:
    """root and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents(proc_root).items():
        children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.append(pid)
        stack.extend(children.get(pid, []))
    return [pid for pid in found if not is_gone(pid, proc_root)]


def describe_tree(pids: list[int], proc_root: str = "/proc") -> list[dict]:
    """pid + start time pins each process: gpu_release never takes a recycled pid for ours."""
    entries = []
    for pid in pids:
        started = start_time(pid, proc_root)
        if started is not None:
            entries.append({"pid": pid, "starttime": started, "cmdline": cmdline(pid, proc_root)})
    return entries


def group_members(pgid: int, proc_root: str = "/proc") -> list[int]:
    """Live processes of a process group."""
    members = []
    for pid in list_pids(proc_root):
        stat = read_stat(pid, proc_root)
        if stat and stat.pgid == pgid and stat.state not in ("Z", "X"):
            members.append(pid)
    return members


def listening_inodes(port: int, proc_root: str = "/proc") -> set[str]:
    """Socket inodes listening on a TCP port (IPv4 and IPv6)."""
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            rows = _read("%s/%s" % (proc_root, table)).splitlines()[1:]
        except (IOError, OSError):
            continue
        for row in rows:
            fields = row.split()
            # local_address is HEX_IP:HEX_PORT; state 0A is LISTEN.
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def socket_owners(inodes: set[str], proc_root: str = "/proc", pids=None) -> set[int]:
    """Pids (of `pids`, else every process) with one of the socket inodes open; only those we may inspect."""
    wanted = set("socket:[%s]" % inode for inode in inodes)
    owners: set[int] = set()
    if not wanted:
        return owners
    for pid in sorted(pids) if pids is not None else list_pids(proc_root):
        if fd_links(pid, proc_root) & wanted:
            owners.add(pid)
    return owners


def carries_token(pid: int, token: str, proc_root: str = "/proc") -> bool:
    """pid's environment holds SPECOPS_WINDOW_TOKEN=<token>: it is the window's work."""
    try:
        raw = _read("%s/%d/environ" % (proc_root, pid), "rb")
    except (IOError, OSError):
        return False
    return ("%s=%s" % (WINDOW_TOKEN_VARIABLE, token)).encode() in raw.split(b"\0")


def token_processes(token: str, proc_root: str = "/proc") -> list[int]:
    """Live processes carrying the window's token, this one excepted."""
    me = os.getpid()
    return [pid for pid in list_pids(proc_root)
            if pid != me and not is_gone(pid, proc_root) and carries_token(pid, token, proc_root)]


def fd_links(pid: int, proc_root: str = "/proc", fds=None) -> set[str]:
    """What pid's descriptors (all, or those named) point to: paths, "pipe:[inode]", "socket:[inode]"."""
    try:
        names = fds if fds is not None else os.listdir("%s/%d/fd" % (proc_root, pid))
    except OSError:
        return set()
    links = set()
    for fd in names:
        try:
            links.add(os.readlink("%s/%d/fd/%s" % (proc_root, pid, fd)))
        except OSError:
            continue
    return links


def window_processes(token: str, proc_root: str = "/proc") -> list[int]:
    """The window's work: the processes carrying its token, and the stages a stage host forked for them.

    A forked stage runs with its caller's environment set inside it, while /proc shows the host's; its
    caller carries the token and hands it its standard streams, so the stage is the host's child whose
    stdin, stdout or stderr is a pipe a carrier holds the other end of (and so are its own children,
    which inherit them)."""
    carriers = token_processes(token, proc_root)
    pipes: set[str] = set()
    for pid in carriers:
        pipes.update(link for link in fd_links(pid, proc_root) if link.startswith("pipe:"))
    if not pipes:
        return carriers
    table = parents(proc_root)
    hosts = set(pid for pid in set(table.values()) if STAGE_HOST_MODULE in cmdline(pid, proc_root).split())
    stages = [pid for pid, parent in sorted(table.items())
              if parent in hosts and pid not in carriers and not is_gone(pid, proc_root)
              and fd_links(pid, proc_root, ("0", "1", "2")) & pipes]
    return carriers + stages
