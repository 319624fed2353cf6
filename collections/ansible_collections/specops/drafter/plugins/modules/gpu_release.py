#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: gpu_release
short_description: Free the GPUs of our own processes, prove the memory is free, leave the rest alone
version_added: "0.1.0"
description:
  - Finds every process that holds a GPU device file open (a scan of C(/proc/*/fd) for files
    matching O(device_pattern)) and, when NVML is usable, NVML's list of compute and graphics
    processes. Both are reported.
  - Classifies each holder. Ours are processes in the cgroup of O(unit), processes recorded in
    O(tree_file) (pid and start time) as the server's before it was stopped, processes whose command
    line matches one of O(patterns), and (with O(orphans)) their kin - holders descended from a
    process that is ours, and holders re-parented away from a dead parent (to PID 1 or to a child
    subreaper outside their process group) that share their process group with a process that is
    ours, as SGLang's workers do when the launcher dies (sglang issue 23627).
  - Never signals PID 1, the module's own process, its ancestors or descendants, or a process
    named in O(protected). Any other holder is foreign. A foreign holder fails the module before
    anything is signalled, unless O(allow_foreign=true).
  - Only holders are signalled; a matching process that holds no GPU is left alone.
  - Escalation is SIGTERM, up to O(grace) seconds, SIGKILL, up to O(timeout) seconds until the
    processes have exited. Signals go through a pidfd where the kernel has them, and every
    process is pinned by its start time, so a recycled pid is never signalled.
  - Then, with NVML, waits up to O(timeout) seconds until every GPU's used memory, minus what
    NVML attributes to the processes left alone, is at most O(memory_threshold_mb), and fails
    naming each GPU's memory and the remaining holders if it is not.
  - Reading another user's C(/proc/<pid>/fd) needs root; run with C(become=true). Processes that
    could not be inspected are listed in RV(unreadable_pids).
author:
  - specops maintainers (@specops)
options:
  unit:
    description:
      - A systemd unit whose cgroup's processes are ours (C(.service) is added when the name has
        no suffix). A stopped unit's leftovers are found in the cgroup the unit had.
      - Fails, naming the unit, when systemd is not PID 1 on the host or the unit does not exist.
    type: str
  tree_file:
    description:
      - A JSON list of objects with C(pid) and C(starttime), the server's processes recorded before it was
        stopped (the sglang_service role writes it). A live process with a recorded pid and the same
        start time is ours (a recycled pid never is). A missing file means nothing is recorded.
    type: path
  patterns:
    description:
      - Regular expressions (Python C(re.search)) on a process's command line, arguments joined
        by spaces. A match makes the process ours.
      - Empty by default. SGLang's titles (C(sglang.launch_server), C(sglang serve),
        C(sglang::scheduler*), C(sglang::detokenizer), C(sglang::data_parallel_controller)) are the
        same for every SGLang on the host, another tenant's too; use them only on a host where
        every SGLang is yours, and prefer O(unit) or O(tree_file).
      - An empty list with no O(unit) and no O(tree_file) is an error.
    type: list
    elements: str
    default: []
  device_pattern:
    description:
      - Glob on the targets of open file descriptors that marks a GPU holder.
    type: str
    default: /dev/nvidia*
  spare_pids:
    description:
      - Processes never signalled though they hold a GPU, reported with the protected ones (the
        extraction started ahead of the window, which waits for these GPUs holding their device files).
    type: list
    elements: int
    default: []
    version_added: "0.2.0"
  protected:
    description:
      - Process names (the kernel's 15-character C(comm) or argv[0]'s basename) that are never
        signalled, even when they match. They hold the devices by design and are reported, not
        counted as foreign.
    type: list
    elements: str
    default:
      - nvidia-persistenced
      - nv-hostengine
      - nvidia-dcgm
      - dcgm-exporter
      - nv-fabricmanager
      - nvidia-fabricmanager
      - Xorg
      - Xwayland
      - gnome-shell
      - kwin_wayland
  allow_foreign:
    description:
      - When false, a GPU holder that is not ours, not protected and not the module's own fails
        the module before anything is signalled. When true, ours are freed, foreign holders are
        reported and left running, and their NVML memory is not counted against the threshold.
    type: bool
    default: false
  orphans:
    description:
      - Treat as ours a holder descended from a process that is ours, and a re-parented holder
        (parent PID 1, or a parent outside its process group) in the process group of a process
        that is ours. A holder re-parented after every process of its group died, whose own
        command line matches nothing, has no evidence left and is foreign.
      - Turn off where unrelated jobs share a process group with the server (for example
        background jobs of one non-interactive shell script).
    type: bool
    default: true
  grace:
    description:
      - Seconds between SIGTERM and SIGKILL.
    type: float
    default: 10
  timeout:
    description:
      - Seconds to wait after SIGKILL for the processes to exit, and again for GPU memory to fall
        under O(memory_threshold_mb).
    type: float
    default: 60
  memory_threshold_mb:
    description:
      - Per GPU, the used memory (MiB, as NVML reports it, minus what processes left alone hold)
        at or under which the GPU counts as free. Only checked when NVML is used.
    type: int
    default: 1024
  nvml:
    description:
      - V(auto) uses NVML (Python package C(nvidia-ml-py)) when it imports and initialises,
        V(true) requires it, V(false) never uses it (no memory check, no NVML process list).
    type: str
    choices: [auto, 'true', 'false']
    default: auto
attributes:
  check_mode:
    support: full
    description: Reports in RV(targets) what would be signalled (RV(would_signal)), signals nothing
      and reports C(changed=false); so does a refusal.
  diff_mode:
    support: none
    description: Nothing is written that a diff could show; processes are signalled.
  platform:
    support: full
    platforms: linux
    description: Reads C(/proc); Linux only.
notes:
  - The module needs no ML environment; it runs under the host's Ansible Python. pynvml is
    optional.
  - Stop the unit first (M(ansible.builtin.systemd_service) C(state=stopped)); a restart policy
    that starts the server again is reported as a failure.
"""

EXAMPLES = r"""
- name: Stop SGLang, then free whatever it left on the GPUs
  ansible.builtin.systemd_service:
    name: sglang-qwen
    state: stopped
  become: true

- name: Free the GPUs of SGLang's unit and its leftovers
  specops.drafter.gpu_release:
    unit: sglang-qwen
    grace: 10
    timeout: 60
  become: true

- name: See what would be killed, kill nothing
  specops.drafter.gpu_release:
    unit: sglang-qwen
    tree_file: /run/specops/sglang-qwen.tree.json
  check_mode: true
  become: true

- name: Free ours on a shared host and leave another tenant's job running
  specops.drafter.gpu_release:
    unit: sglang-qwen
    allow_foreign: true
    memory_threshold_mb: 2048
  become: true
"""

RETURN = r"""
targets:
  description: Holders that are ours (signalled, or to be signalled in check mode), with the reason.
  returned: always
  type: list
  elements: dict
  sample:
    - {pid: 4242, ppid: 1, user: sglang, cmdline: "sglang::scheduler_TP0",
       reason: "command line matches '^sglang::scheduler'", devices: [/dev/nvidia0, /dev/nvidiactl],
       nvml: [{gpu: 0, used_mb: 47012}]}
would_signal:
  description: How many holders are ours (signalled, or to be signalled in check mode).
  returned: always
  type: int
killed:
  description: Processes signalled, the last signal used (SIGTERM or SIGKILL; null when it had exited
    already) and seconds from the first signal to its exit. Empty in check mode.
  returned: always
  type: list
  elements: dict
  sample:
    - {pid: 4242, ppid: 1, user: sglang, cmdline: "sglang::scheduler_TP0", signal: SIGKILL, exited_s: 10.05,
       reason: "command line matches '^sglang::scheduler'"}
foreign:
  description: Holders that are not ours (pid, user, command line, devices, NVML memory), never signalled.
    NVML-listed pids not visible in this PID namespace appear with a null command line.
  returned: always
  type: list
  elements: dict
protected:
  description: Holders spared by name (O(protected)) or for being PID 1.
  returned: always
  type: list
  elements: dict
own_tree:
  description: Holders in the module's own process tree (the module itself once NVML is open).
  returned: always
  type: list
  elements: dict
unreadable_pids:
  description: Processes whose open files could not be read (run with become to see them all).
  returned: always
  type: list
  elements: int
unit_cgroup:
  description: The cgroup path of O(unit), or null.
  returned: always
  type: str
nvml:
  description: Whether NVML was used.
  returned: always
  type: bool
gpus_before:
  description: Per GPU, memory before anything was signalled (empty without NVML).
  returned: always
  type: list
  elements: dict
  sample: [{index: 0, uuid: GPU-1b2c, name: NVIDIA H200, used_mb: 47012, total_mb: 143771}]
gpus_after:
  description: Per GPU, memory once released; C(ours_mb) is used memory minus that of processes left alone.
  returned: always
  type: list
  elements: dict
  sample: [{index: 0, uuid: GPU-1b2c, name: NVIDIA H200, used_mb: 540, total_mb: 143771, ours_mb: 540}]
timeline:
  description: Seconds from the first signal to SIGTERM sent, SIGKILL sent (when needed), all exited,
    and GPU memory under the threshold (with NVML).
  returned: always
  type: dict
  sample: {sigterm_s: 0.0, sigkill_s: 10.01, exited_s: 10.06, memory_free_s: 10.21}
elapsed_s:
  description: Seconds the whole call took.
  returned: always
  type: float
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.specops.drafter.plugins.module_utils.gpus.gpu_release import (
    DEFAULT_DEVICE_PATTERN,
    DEFAULT_GRACE,
    DEFAULT_MEMORY_THRESHOLD_MB,
    DEFAULT_PATTERNS,
    DEFAULT_PROTECTED,
    DEFAULT_TIMEOUT,
    GpuReleaseError,
    release,
)


class GpuRelease(object):
    """Holds the module and turns release()'s outcome into exit_json/fail_json."""

    def __init__(self, module):
        self.module = module
        self.params = dict(module.params)

    def run(self):
        try:
            result = release(self.params, check_mode=self.module.check_mode, run_command=self.module.run_command)
        except GpuReleaseError as exc:
            self.module.fail_json(msg=exc.msg, **exc.result)
        self.module.exit_json(**result)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            unit=dict(type="str"),
            tree_file=dict(type="path"),
            patterns=dict(type="list", elements="str", default=list(DEFAULT_PATTERNS)),
            device_pattern=dict(type="str", default=DEFAULT_DEVICE_PATTERN),
            protected=dict(type="list", elements="str", default=list(DEFAULT_PROTECTED)),
            spare_pids=dict(type="list", elements="int", default=[]),
            allow_foreign=dict(type="bool", default=False),
            orphans=dict(type="bool", default=True),
            grace=dict(type="float", default=DEFAULT_GRACE),
            timeout=dict(type="float", default=DEFAULT_TIMEOUT),
            memory_threshold_mb=dict(type="int", default=DEFAULT_MEMORY_THRESHOLD_MB),
            nvml=dict(type="str", choices=["auto", "true", "false"], default="auto"),
        ),
        supports_check_mode=True,
    )
    GpuRelease(module).run()


if __name__ == "__main__":
    main()
