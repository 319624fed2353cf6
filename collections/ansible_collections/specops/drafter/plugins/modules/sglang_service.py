#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: sglang_service
short_description: Run an SGLang server and take it down and back for a GPU window, guarded
description:
  - Starts, stops, restarts an SGLang server (a systemd unit or a detached process), or releases and
    resumes its GPU memory (memory-saver mode), without losing the service. docs/window.md is the interface.
  - One window per server, whoever asks; a lock in O(state_dir) names the holder to any other run.
  - Before the server goes down (stop, release, a restart of a serving server) a host-side B(guard) is
    armed that brings it back after C(min(window.guard_after, window.max_downtime)) seconds, or
    C(window.guard_grace) seconds after the window's work is gone without a disarm.
  - Readiness is C(/health_generate) 200 from B(our) process after a start, and a greedy 1-token C(/generate) 200
    after a resume (SGLang answers C(/health_generate) only on a whole second after it began, so a window
    read with it would stay down up to a second longer); an answer from another process on the port is
    refused and that process named.
version_added: "0.2.0"
author:
  - specops maintainers (@specops)
options:
  state:
    description:
      - V(started), V(stopped), V(restarted) act on the server process; V(released) frees its GPU memory
        (pause, flush, release) and V(resumed) brings it back exactly once.
      - V(window) is the memory-saver window as one step on the host - V(released) (with O(go_file) told
        go), then the window's work heard ending through O(resume_when_done) (inotify, not a polling
        interval), the guard's resume at that moment, and V(resumed)'s checks - and returns each stage's
        seconds in RV(stages). It needs O(resume_when_done) and O(guard).
    type: str
    choices: [started, stopped, restarted, released, resumed, window]
    required: true
  backend:
    description: V(systemd) drives a unit with systemctl; V(process) a detached process described by O(spec).
    type: str
    choices: [systemd, process]
    required: true
  unit:
    description: The systemd unit (without C(.service)); also names the server in messages and in the guard's unit.
    type: str
    default: sglang
  adopt:
    description:
      - systemd only. The unit is the user's and is never written; port, host, C(--enable-memory-saver),
        C(--enable-weights-cpu-backup) and whether C(--api-key) is set are read from its C(ExecStart).
    type: bool
    default: false
  spec:
    description:
      - The server's launch, as the role builds it. Required for the process backend; for a managed unit it
        is the launch that is validated before a serving server is replaced.
      - Keys C(argv) (list), C(environment) (dict), C(working_dir), C(pid_file), C(log_file).
    type: dict
  url:
    description: The server's base URL. An adopted unit's is read from its command line when left out.
    type: str
  api_key:
    description:
      - The server's C(--api-key), sent as C(Authorization Bearer) on every call but the admin endpoints when
        O(admin_api_key) is given. Kept only in the guard's 0600 configuration while a guard is armed.
    type: str
  admin_api_key:
    description:
      - The server's C(--admin-api-key) (SGLang 0.5.23), sent on the admin endpoints (pause, continue, flush,
        release, resume, weights_checker), which refuse the plain api key when the server has an admin key.
        Kept only in the guard's 0600 configuration while a guard is armed.
      - Neither key appears in what the module returns, records or logs; the server's info, which carries both,
        is redacted before anything reads it.
    type: str
  accept_abort_pause:
    description:
      - V(released) on a server whose SGLang has no pause modes (0.5.4) is refused, because its pause aborts every
        request and a request arriving after the drain's last reading is lost. V(true) accepts that risk.
    type: bool
    default: false
  drained:
    description:
      - The server's requests were drained elsewhere before the release (eval.yml sets it when the host was taken
        out of its router), so the abort-only pause of SGLang 0.5.4 loses nothing.
    type: bool
    default: false
  state_dir:
    description:
      - Per server, not per run - the window lock, the released marker, the recorded process tree and the
        guard's files. Default C(/run/specops/<unit>) (systemd) or C(<pid_file>.d) (process).
    type: path
  window:
    description:
      - The GPU window this call belongs to (eval.yml gives it). Without it, calls share one owner.
    type: dict
    suboptions:
      token:
        description: The window's C(SPECOPS_WINDOW_TOKEN); processes carrying it are the window's work.
        type: str
      owner:
        description: Who holds the window, shown to any other run that asks.
        type: raw
      guard_after:
        description: Planned seconds until the guard brings the server back.
        type: float
      max_downtime:
        description: The operator's upper bound on the downtime; the guard fires after the smaller of the two.
        type: float
      guard_grace:
        description: Seconds the window's work may be gone, without a disarm, before the guard fires.
        type: float
      wait:
        description: Seconds to wait for another run's window; 0 fails at once naming the holder.
        type: float
      planned_seconds:
        description:
          - Seconds the window is planned to last (eval.yml gives the extraction's estimate). A release is refused
            when this exceeds the server's C(SGLANG_REQ_WAITING_TIMEOUT), which aborts the requests held at the
            pause with 503; left out, the guard's C(min(guard_after, max_downtime)) is taken.
        type: float
  guard:
    description: Arm the guard before the server goes down.
    type: bool
    default: true
  release:
    description:
      - What C(released) frees. C(kv_cache) - the KV cache (and the CUDA graphs where the version has the
        tag); the weights stay on the GPU and nothing is copied, so the downtime does not grow with the model.
        C(all) - every tag, the weights through their CPU backup (the server needs
        C(--enable-weights-cpu-backup)). C(auto) - C(kv_cache) where the extraction (O(extraction_gpu)) fits
        beside the server's weights, else C(all) where the server has the backup.
      - The plan and its figures (the server's own memory accounting, nvidia-smi where present) are returned
        as RV(memory_plan), also in check mode; a forced choice that cannot work is refused before the pause.
    type: str
    choices: [auto, kv_cache, all]
    default: auto
  extraction_gpu:
    description:
      - What the extraction needs on the GPUs, from its plan - C(copy_bytes) (one copy of the target up to its
        last captured layer), C(body_bytes) (the same without the head, when split), C(reserve_bytes)
        (activations and workspace).
      - Empty - not known; C(auto) then releases every tag where the server has the weights' backup.
    type: dict
    default: {}
  gpu_reserve_mib:
    description: MiB per GPU the plan keeps free beyond what the extraction needs (allocator slack, other contexts).
    type: int
    default: 2048
  resume_when_done:
    description:
      - C(released) only - the files that say the window's work has ended - the extraction's async job's results
        file (its final result) and its state file (C(<start signal>.state), V(finished) once the outputs are
        written and the device has its memory back, before the process exits). The guard, armed to resume,
        resumes the server the moment either says so and waits for the first 1-token C(/generate) 200, so the
        service comes back without waiting for the extraction's exit or the play's next tasks; C(resumed) then
        finds it resumed and returns the guard's moment as RV(ready_at).
    type: list
    elements: path
    default: []
  go_file:
    description:
      - C(released) only - the start signal of an extraction waiting for the GPUs (M(specops.drafter.start_signal));
        V(go) is written to it as soon as the released memory is free, so the extraction starts inside the same
        module call instead of a task later.
    type: path
  tags:
    description:
      - Expert - memory tags to release, overriding O(release) (empty - as O(release) decides). Weights are
        never released from a server without C(enable_weights_cpu_backup).
    type: list
    elements: str
    default: []
  ready_timeout:
    description: Seconds to wait for our server to answer (C(/health_generate), or C(/generate) after a resume).
    type: float
    default: 900
  ready_delay:
    description: Seconds between readiness, drain and flush polls.
    type: float
    default: 0.5
  health_timeout:
    description: Seconds one HTTP call may take.
    type: float
    default: 30
  stop_timeout:
    description: Seconds from SIGTERM to SIGKILL (process backend), and for the port to close.
    type: float
    default: 120
  drain_timeout:
    description: Seconds to wait until nothing runs (versions without a retract pause) and until C(/flush_cache) is 200.
    type: float
    default: 120
  release_max_used_mib:
    description: Released means every GPU (or O(gpu_ids)) uses at most this many MiB, per nvidia-smi where present.
    type: int
    default: 4096
  gpu_ids:
    description: GPUs the memory check looks at (empty - all).
    type: list
    elements: str
    default: []
attributes:
  check_mode:
    support: full
    description: Reads the server's state and info; writes nothing on the host (no lock, guard, marker) and says what would change.
  diff_mode:
    support: none
    description: Nothing to diff.
"""

EXAMPLES = r"""
- name: Release the GPU memory for the window
  specops.drafter.sglang_service:
    state: released
    backend: systemd
    unit: sglang-qwen
    adopt: true
    api_key: "{{ sglang_api_key }}"
    admin_api_key: "{{ sglang_admin_api_key }}"
    window:
      token: "{{ specops_window_token }}"
      owner: "eval.yml on {{ inventory_hostname }}"
      guard_after: 1800
      max_downtime: 3600
  register: released

- name: Bring it back
  specops.drafter.sglang_service:
    state: resumed
    backend: systemd
    unit: sglang-qwen
    adopt: true
    api_key: "{{ sglang_api_key }}"
    admin_api_key: "{{ sglang_admin_api_key }}"
    window:
      token: "{{ specops_window_token }}"
"""

RETURN = r"""
state:
  description: The state asked for.
  returned: always
  type: str
pid:
  description: The server's pid after the call (stopped - the pid that was stopped).
  returned: when known
  type: int
version:
  description: The server's SGLang version, as its server info says.
  returned: released, window
  type: str
down_at:
  description: When the service stopped answering (stop, or the pause), on the host's clock.
  returned: when the server went down
  type: float
ready_at:
  description: When our server first answered 200 (/health_generate; after a resume a 1-token /generate), on the host's clock.
  returned: when the server was waited for
  type: float
server_start_s:
  description: Seconds from the launch to the first 200.
  returned: when the server was started
  type: float
memory_saver_backend:
  description: What frees the memory on the server, as its server info says (the development server's
    C(torch_memory_saver <version>) on CUDA); absent where the server does not say.
  returned: released, window
  type: str
pause_mode:
  description: C(retract), or C(drain then abort) on versions without pause modes.
  returned: released, window
  type: str
released_tags:
  description: The tags released (empty - every tag).
  returned: released, window
  type: list
memory_plan:
  description:
    - What the release frees and why - C(choice) (kv_cache, all or explicit), C(tags), C(reason), the server's
      own accounting per rank (C(server) - weights, KV cache, CUDA graphs in MiB), the GPUs' figures (C(gpus)),
      C(free_after_kv_release_mib), C(fits_beside_weights), and the extraction's needs.
  returned: released, window
  type: dict
released_at:
  description: When the release answered, on the host's clock.
  returned: released or window, when it happened
  type: float
resumed_by:
  description: Who resumed the server when it was not this call (the guard, at the end of the window's work).
  returned: resumed or window, when it happened
  type: str
resume_started_at:
  description: When the guard began the resume, on the host's clock.
  returned: resumed, when the guard resumed
  type: float
called_at:
  description: When C(resumed) began, on the host's clock (the window's record splits its downtime with it).
  returned: resumed, window
  type: float
work_finished_at:
  description: When the window's work said finished (its state file's moment), on the host's clock.
  returned: window, where a state file says it
  type: float
stages:
  description:
    - The window's seconds by stage, on the host's clock - C(pause_and_release_s), C(memory_check_to_go_s),
      C(work_s) (go to the work's finished), C(heard_to_resume_s), C(resume_to_ready_s) and C(downtime_s).
  returned: window
  type: dict
go_at:
  description: When O(go_file) was told go, on the host's clock.
  returned: released or window, with go_file
  type: float
gpu_memory:
  description: The GPU memory check after the release (C(checked) false where nvidia-smi is absent).
  returned: released, window
  type: dict
waiting_timeout:
  description: The server's C(SGLANG_REQ_WAITING_TIMEOUT) as read from its process's environment (C(seconds), none
    when unset), with the planned and the guard's seconds; C(read) false where the environment could not be read.
  returned: released, window
  type: dict
abort_pause:
  description: Why the abort-only pause of a server without pause modes was taken (drained, or the risk accepted).
  returned: released, on such servers
  type: str
weights_check:
  description: The weights' checksum (C(/weights_checker)) before the release and after the resume, C(matched), and
    C(restarted) with C(after_restart) when they differed and the server was restarted from disk.
  returned: resumed, where the server answers /weights_checker
  type: dict
serving_tree:
  description: The serving server's processes (pid + start time), for a check of the GPU holders that
    are not ours before a window (gpu_release's tree_file in check mode).
  returned: when the server was waited for
  type: str
recorded_tree:
  description: The server's processes (pid + start time) recorded before the stop, for gpu_release's tree_file.
  returned: when the server was stopped
  type: str
guard:
  description: The guard - armed, pid, fires_in, action, unit, log; or disarmed.
  returned: when armed or disarmed
  type: dict
found_down:
  description: started or restarted outside a window found no server process (it died, or was stopped
    outside this run) and started one; in check mode, that it would.
  returned: started, restarted
  type: bool
started_instead:
  description: resumed found no server process (killed inside the window), or one that did not answer after the
    resume, and started it.
  returned: resumed, when it happened
  type: bool
restarted:
  description: The server did not serve after a failed release or after the resume (SGLang kills its tree on a
    release that finds the scheduler busy, or a resume that cannot allocate), or a release was not answered; it
    was stopped and started again from disk.
  returned: released (with the failure), resumed, when it happened
  type: bool
window_holder:
  description: The run holding this server's window when this call was refused.
  returned: on refusal
  type: dict
port_holder:
  description: The pid that holds the server's port when our server could not serve there.
  returned: on that failure
  type: int
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError
from ansible_collections.specops.drafter.plugins.module_utils.window.sglang_service import ServiceWindow

WINDOW_OPTIONS = dict(
    token=dict(type="str", no_log=False),
    owner=dict(type="raw"),
    guard_after=dict(type="float"),
    max_downtime=dict(type="float"),
    guard_grace=dict(type="float"),
    wait=dict(type="float"),
    planned_seconds=dict(type="float"),
)

ARGUMENT_SPEC = dict(
    state=dict(type="str", required=True,
               choices=["started", "stopped", "restarted", "released", "resumed", "window"]),
    backend=dict(type="str", required=True, choices=["systemd", "process"]),
    unit=dict(type="str", default="sglang"),
    adopt=dict(type="bool", default=False),
    spec=dict(type="dict"),
    url=dict(type="str"),
    api_key=dict(type="str", no_log=True),
    admin_api_key=dict(type="str", no_log=True),
    accept_abort_pause=dict(type="bool", default=False),
    drained=dict(type="bool", default=False),
    state_dir=dict(type="path"),
    window=dict(type="dict", options=WINDOW_OPTIONS),
    guard=dict(type="bool", default=True),
    release=dict(type="str", default="auto", choices=["auto", "kv_cache", "all"]),
    extraction_gpu=dict(type="dict", default={}),
    gpu_reserve_mib=dict(type="int", default=2048),
    go_file=dict(type="path"),
    resume_when_done=dict(type="list", elements="path", default=[]),
    tags=dict(type="list", elements="str", default=[]),
    ready_timeout=dict(type="float", default=900),
    ready_delay=dict(type="float", default=0.5),
    health_timeout=dict(type="float", default=30),
    stop_timeout=dict(type="float", default=120),
    drain_timeout=dict(type="float", default=120),
    release_max_used_mib=dict(type="int", default=4096),
    gpu_ids=dict(type="list", elements="str", default=[]),
)


def main():
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        required_if=[("backend", "process", ("spec",))],
        supports_check_mode=True,
    )
    try:
        result = ServiceWindow(module.params, module.check_mode).run()
    except ServiceError as error:
        fields = dict(error.fields)
        fields.pop("msg", None)
        fields["failed"] = True
        for warning in fields.pop("warnings", []):
            module.warn(warning)
        module.fail_json(msg=error.msg, **fields)
    for warning in result.pop("warnings", []):
        module.warn(warning)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
