#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: score_drafter
short_description: Score a DFlash drafter's acceptance length offline and write a report with plots
version_added: "0.1.0"
description:
  - Runs C(python -m specops.score) in the ML environment O(python). It replays greedy decoding
    offline. For every completion in the extracted hidden states, the drafter drafts a block from
    the target's hidden states at each verify step, and the step accepts the leading draft tokens
    equal to the target's own tokens plus one bonus token. tau is accepted tokens per verify step,
    the same ratio as SGLang's C(spec_accept_length).
  - Reports tau per prompt and overall, the acceptance-length histogram and the acceptance rate by
    position in the block; with O(reference_drafter), the same for the reference and the tau
    ratio; with O(completions) from a server that ran speculative decoding, SGLang's online tau.
    With O(server_drafter) naming which drafter that server ran, the C(online_agreement) diagnostic
    checks that SGLang's online tau equals that drafter's offline tau once the prefill's token is
    counted as SGLang counts it (in C(completion_tokens), not in C(spec_verify_ct)).
  - Runs diagnostics (O(diagnostics)) that explain a low tau before the drafter is blamed.
    C(layer_offset) scores the drafter with every target layer id shifted by -1 and +1 and warns
    when a shift scores clearly higher (more than O(layer_offset_tolerance)); it needs the
    hidden states captured with C(capture_offsets=[-1, 0, 1]) and is reported as skipped
    otherwise. C(backend) warns loudly when the hidden states came from the torch fallback of
    C(gated_delta_rule) rather than fla's kernels. C(vocabulary) compares the drafter's
    vocabulary with the target's config, C(lm_head) and embedding rows, and checks that
    C(mask_token_id) is a special or added token of the target's tokenizer.
  - Writes C(report.json), C(report.md) (the plots embedded with relative links),
    C(tau_per_prompt.png), C(acceptance_by_position.png), C(acceptance_histogram.png) and, last,
    C(manifest.json) into O(out_dir). A rerun with the same inputs (the hidden-state and
    completions manifests, the drafters' files, the target's config and tokenizer, the options)
    loads nothing and reports C(changed=false).
author:
  - specops maintainers (@specops)
extends_documentation_fragment:
  - specops.drafter.stage
options:
  hidden_states:
    description:
      - The output directory of M(specops.drafter.extract_hidden_states) (C(manifest.json) and shards).
    type: path
    required: true
  target:
    description:
      - The target model directory; its C(embed_tokens), C(lm_head) and tokenizer are used.
    type: path
    required: true
  drafter:
    description:
      - The drafter checkpoint directory (C(config.json) with C(dflash_config), safetensors), or a list
        of them (checkpoints of a training run, or rivals), all scored on the same hidden states.
      - Each drafter is named by its directory's name; its report and plots go to
        C(<out_dir>/drafters/<name>/), and C(report.md) compares them.
    type: list
    elements: path
    required: true
  reference_drafter:
    description:
      - A drafter to compare with, scored on the same hidden states. Its target layers must be in
        the hidden states too.
    type: path
  completions:
    description:
      - The output directory of M(specops.drafter.sglang_completions). When the server ran
        speculative decoding, each completion's C(spec_accept_length) is shown beside the offline tau.
    type: path
  server_drafter:
    description:
      - Which drafter the SGLang server speculated with when it made O(completions), one of V(drafter) (the
        first of O(drafter)), a drafter's name, or V(reference) (then O(reference_drafter) is required);
        V("") when unknown.
      - When known, the C(online_agreement) diagnostic compares SGLang's online tau with that
        drafter's offline tau plus the prefill token SGLang counts (offline tau + 1 / verify steps
        per completion). Prompts that differ are classified, as a near-tie (a draft decided by a logit
        margin under 0.5, which another kernel or dtype can flip) is reported as such; otherwise it
        warns of a configuration error, naming both numbers.
    type: str
    default: ""
  out_dir:
    description:
      - Directory the report is written to (created if needed).
    type: path
    required: true
  device:
    description:
      - Where to score. V(cpu), V(cuda), V(cuda:N), or V(auto) (a CUDA GPU when torch sees one, else the
        CPU).
      - Scoring runs after the server is back on the GPUs, so it uses one only when asked; give
        O(gpu_memory_gib) so it cannot take the memory the server needs.
    type: str
    default: cpu
  gpu_memory_gib:
    description:
      - On a GPU, the most memory scoring may allocate; the run fails at start when the GPU has less
        than this free. V(0) sets no limit.
    type: float
    default: 0.0
  dtype:
    description:
      - Precision of the drafter and the target head while scoring. V(auto) is V(float32) on the CPU
        and on a GPU where the head and drafters fit in a quarter of free memory, else V(bfloat16);
        inside a window (O(placement) C(where=window)) on a GPU it is V(bfloat16), the service being down.
    type: str
    choices: [auto, bfloat16, float16, float32]
    default: auto
  diagnostics:
    description:
      - Which diagnostics to run. C(acceptance) names the cause the acceptance figures point to
        (position-1 acceptance near zero, a collapse after position k, far below the reference on
        every prompt or on some). C(layer_offset) scores each drafter twice more.
    type: list
    elements: str
    choices: [acceptance, layer_offset, backend, vocabulary]
    default: [acceptance, layer_offset, backend, vocabulary]
  step_costs:
    description:
      - The cost of a drafter step and of a target verify step, in target decode steps, as timed on the
        target GPUs (keys C(draft_cost), C(verify_cost)). The expected speedup is
        tau / (draft_cost + verify_cost). Empty to estimate them from the weights each step reads.
    type: dict
  history:
    description:
      - Directory of past runs. A run that scores copies its report to C(<history>/<run_id>/) and
        appends a line to C(<history>/index.jsonl) (under a lock, safe for concurrent runs); the report
        then plots tau per drafter and its interval over the runs and names the changes outside the
        noise. A run with unchanged inputs scores nothing and adds no line; O(force) scores again.
    type: path
  detectable_difference:
    description:
      - The difference in tau for which the report says how many prompts a paired comparison (a
        drafter against the reference, or two drafters) would need to resolve it, from the run's
        per-prompt spread (95% interval, 80% power); the observed difference gets the same statement.
    type: float
    default: 0.1
  layer_offset_tolerance:
    description:
      - The layer-offset check warns when the drafter's tau with its target layers shifted by -1
        or +1 exceeds its tau at the configured layers by more than this fraction (0.1 = 10%).
        Scoring is deterministic, so a real off-by-one shows as a large gap, not a few percent.
    type: float
    default: 0.1
  force:
    description:
      - Score again even when the report in O(out_dir) is up to date.
    type: bool
    default: false
  placement:
    description:
      - Where the play placed the scoring and why, said in the report beside how long the stage took
        (C(where) is C(window) or C(cpu); C(why) the rule that chose it; C(estimated_seconds)).
      - Not part of the inputs' fingerprint; a report refreshed after the window keeps the placement it
        was scored with.
      - C(finished_file) (inside a memory-saver window) - a file the stage writes the state C(finished)
        to once its scores are computed and the device's memory is given back, before it writes its
        reports; the window's guard resumes the service then. Not said in the report.
    type: dict
  start_after:
    description:
      - Scoring inside a memory-saver window, started as a job before the window - wait, before the stage
        starts, until the extraction says finished (C(finished_file), its C(<start signal>.state)); fail
        without scoring when its job has ended without finishing (C(ended_file), its async results file)
        or after C(timeout) seconds. The wait hears the files change (inotify), so the scoring begins the
        moment the extraction's outputs are written; the window is then one task (sglang_service V(window)).
    type: dict
    suboptions:
      finished_file:
        description: The extraction's state file.
        type: path
        required: true
      ended_file:
        description: The extraction's async job results file.
        type: path
      timeout:
        description: Seconds to wait at most.
        type: float
        default: 7200
  cpu_bounds:
    description:
      - Run the stage with its CPU share and priority bounded, keys C(nice), C(cpu_quota_percent) (100 is one
        core) and C(threads). Where systemd is PID 1 and may be asked (root, or a user manager), the stage
        runs in C(systemd-run --scope -p CPUQuota=... --nice=...); elsewhere under C(nice -n) with its
        threads bounded (C(OMP_NUM_THREADS) and C(torch.set_num_threads)), the quota not enforced.
      - The stage records the nice value, the cgroup's C(cpu.max) and the thread count it ran with in
        the report (C(placement.bounds)). Empty runs it unbounded.
    type: dict
attributes:
  check_mode:
    support: full
    description: Says whether the report is up to date (with its figures) or would be written; loads no model.
  diff_mode:
    support: none
    description: The report is rewritten as a whole; no diff is shown.
  platform:
    support: full
    platforms: posix
    description: Runs wherever the ML environment runs; the module itself needs only the standard library.
notes:
  - Scoring a large target's completions can take long; run the task with C(async) and C(poll) to outlive
    a connection timeout.
  - Publish the figures to AWX/Tower with M(ansible.builtin.set_stats), as the C(specops.drafter.score_drafter)
    role does.
seealso:
  - module: specops.drafter.extract_hidden_states
  - module: specops.drafter.sglang_completions
"""

EXAMPLES = r"""
- name: Score the drafter against the reference on the extracted hidden states
  specops.drafter.score_drafter:
    python: /opt/specops/ml/bin/python
    hidden_states: /srv/eval/run-1/hidden_states
    completions: /srv/eval/run-1/completions
    target: /models/Qwen3.6-27B
    drafter: /models/qwen3.6-dflash-v4
    reference_drafter: /models/z-lab-qwen3.6-dflash
    # The production server speculates with the reference drafter: check its online tau.
    server_drafter: reference
    out_dir: /srv/eval/run-1/score
  register: score

- name: Show the verdict
  ansible.builtin.debug:
    msg: "{{ score.verdict }}"

- name: Score on the CPU without the layer-offset check (it scores the drafter twice more)
  specops.drafter.score_drafter:
    python: /opt/specops/ml/bin/python
    hidden_states: /srv/eval/run-1/hidden_states
    target: /models/Qwen3.6-27B
    drafter: /models/qwen3.6-dflash-v4
    out_dir: /srv/eval/run-1/score-cpu
    device: cpu
    dtype: float32
    diagnostics: [backend, vocabulary]
"""

RETURN = r"""
placement:
  description: Where the scoring ran, why, how long it took (C(seconds)) and the bounds it observed
    (C(bounds), with O(cpu_bounds)); null when the stage did not say.
  returned: always
  type: dict
tau:
  description: The drafter's mean acceptance length (accepted tokens per verify step, bonus included). Null in
    check mode when the report would be written.
  returned: always
  type: float
  sample: 3.02
tau_interval:
  description: The 95% interval of RV(tau), from a seeded bootstrap over prompts (tau is pooled over verify
    steps, so prompts are resampled, not steps); null with fewer than 5 prompts.
  returned: always
  type: list
  elements: float
  sample: [2.91, 3.13]
reference_tau:
  description: The reference drafter's tau, null without O(reference_drafter).
  returned: always
  type: float
  sample: 12.41
reference_tau_interval:
  description: The 95% interval of RV(reference_tau), null without a reference or with fewer than 5 prompts.
  returned: always
  type: list
  elements: float
  sample: [11.9, 12.8]
ratio:
  description: tau / reference_tau, null without a reference.
  returned: always
  type: float
  sample: 0.24
vs_reference:
  description: The first drafter against the reference on the same prompts, null without a reference.
    C(difference) in tau with its C(interval), the tau ratio's C(ratio_interval), C(wins) (prompts where
    each has the higher tau, and ties), C(verdict) (better, worse, or no difference shown at this size)
    and C(prompts_needed), about how many prompts would resolve the observed difference.
  returned: always
  type: dict
  sample: {"names": ["step-2000", "reference"], "n_prompts": 200, "difference": -9.39, "interval": [-9.7, -9.1],
           "ratio_interval": [0.23, 0.25], "wins": {"first": 0, "second": 200, "ties": 0}, "verdict": "worse",
           "prompts_needed": 3}
pairs:
  description: Every two drafters, and each drafter against the reference, compared the same way as
    RV(vs_reference).
  returned: always
  type: list
  elements: dict
online_tau:
  description: SGLang's online tau (completion tokens / verify steps) over the completions that carry it, else null.
  returned: always
  type: float
n_prompts:
  description: How many completions were scored.
  returned: always
  type: int
  sample: 10
steps:
  description: Verify steps the drafter was scored on.
  returned: always
  type: int
drafters:
  description: Per drafter, its name, tau and its 95% interval, ratio to the reference and the paired
    verdict against it, expected speedup and the diagnostics that warned.
  returned: always
  type: list
  elements: dict
  sample: [{"name": "step-2000", "tau": 3.02, "tau_interval": [2.91, 3.13], "ratio": 0.24, "vs_reference": "worse",
            "expected_speedup": 2.71, "warnings": []}]
expected_speedup:
  description: The first drafter's expected speedup over decoding without a drafter (the report states the model).
  returned: always
  type: float
  sample: 2.71
run_id:
  description: This run's name in O(history), null without it or when nothing was scored.
  returned: always
  type: str
history_index:
  description: Path of the run index, null without O(history).
  returned: always
  type: str
trend:
  description: tau per drafter and its 95% interval (and the reference's) over the last 20 runs of
    O(history), oldest first.
  returned: always
  type: list
  elements: dict
  sample: [{"run_id": "20261201T101500Z-3f2a9c1e", "tau": {"step-2000": 3.02}, "tau_interval": {"step-2000": [2.91, 3.13]},
            "reference_tau": 12.41, "reference_tau_interval": [11.9, 12.8]}]
changes:
  description: The drafters whose tau moved since their previous run in O(history) by more than the two
    runs' intervals allow (C(direction) up or down, C(before), C(after), C(previous_run_id)); a move within
    the noise is not listed.
  returned: always
  type: list
  elements: dict
verdict:
  description: The report's first line.
  returned: always
  type: str
  sample: "drafter tau 3.02 [2.91, 3.13] vs reference 12.41 [11.90, 12.80] (0.24x): worse"
diagnostic_warnings:
  description: The diagnostics that warned, each as the diagnostic's name, a colon and its finding. Each is
    also shown as an Ansible warning.
  returned: always
  type: list
  elements: str
  sample: ["layer_offset: the drafter scores clearly higher with its target layers shifted by +1 ..."]
out_dir:
  description: The report directory.
  returned: always
  type: str
report_json:
  description: Path of report.json.
  returned: always
  type: str
report_md:
  description: Path of report.md.
  returned: always
  type: str
plots:
  description: Paths of the PNG plots.
  returned: always
  type: list
  elements: str
"""

import os
import re
import time

from ansible_collections.specops.drafter.plugins.module_utils.common.file_watch import FileWatch
from ansible_collections.specops.drafter.plugins.module_utils.common.state_files import write_json
from ansible_collections.specops.drafter.plugins.module_utils.stages import cpu_scope
from ansible_collections.specops.drafter.plugins.module_utils.stages.async_job import job_result, read_json
from ansible_collections.specops.drafter.plugins.module_utils.stages.stage_runner import stage_module, stage_result

# The request's options: specops.score REQUEST declares them (tests/ansible/test_stage_schemas.py checks).
REQUEST_OPTIONS = dict(
    hidden_states=dict(type="path", required=True),
    target=dict(type="path", required=True),
    drafter=dict(type="list", elements="path", required=True),
    reference_drafter=dict(type="path"),
    completions=dict(type="path"),
    server_drafter=dict(type="str", default=""),
    out_dir=dict(type="path", required=True),
    device=dict(type="str", default="cpu"),
    gpu_memory_gib=dict(type="float", default=0.0),
    dtype=dict(type="str", choices=["auto", "bfloat16", "float16", "float32"], default="auto"),
    diagnostics=dict(type="list", elements="str",
                     choices=["acceptance", "layer_offset", "backend", "vocabulary"],
                     default=["acceptance", "layer_offset", "backend", "vocabulary"]),
    layer_offset_tolerance=dict(type="float", default=0.1),
    detectable_difference=dict(type="float", default=0.1),
    step_costs=dict(type="dict"),
    history=dict(type="path"),
    force=dict(type="bool", default=False),
    placement=dict(type="dict"),
    cpu_bounds=dict(type="dict"),
)

FIGURES = {
    "tau": None,
    "tau_interval": None,
    "reference_tau": None,
    "reference_tau_interval": None,
    "ratio": None,
    "vs_reference": None,
    "pairs": [],
    "online_tau": None,
    "n_prompts": None,
    "steps": None,
    "verdict": "",
    "drafters": [],
    "expected_speedup": None,
    "run_id": None,
    "history_index": None,
    "trend": [],
    "changes": [],
    "diagnostic_warnings": [],
    "out_dir": None,
    "report_json": None,
    "report_md": None,
    "plots": [],
    "placement": None,
}

DEVICE_FORM = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$")


# The module's own options, not part of the stage's request: it waits on the host before it starts the stage.
HOST_OPTIONS = dict(start_after=dict(type="dict", options=dict(finished_file=dict(type="path", required=True),
                                                               ended_file=dict(type="path"),
                                                               timeout=dict(type="float", default=7200))))


def wait_for_extraction(module, after):
    """Until the extraction's state file says finished; fails the module when it ended without that.

    Its own state file (placement.finished_file, which says "finished" once the scores are computed) says
    "waiting" first: the play opens the window only once the scoring waits, so a scoring that failed
    before it could wait never ends the window (its end would resume the server under the extraction)."""
    own = (module.params.get("placement") or {}).get("finished_file")
    if own:
        write_json(own, {"state": "waiting", "pid": os.getpid(), "at": time.time()})
    finished_file, ended_file = after["finished_file"], after.get("ended_file")
    deadline = time.monotonic() + float(after["timeout"])
    with FileWatch([path for path in (finished_file, ended_file) if path]) as watch:
        while True:
            if (read_json(finished_file) or {}).get("state") == "finished":
                return
            ended = job_result(ended_file) if ended_file else None
            if ended is not None:
                module.fail_json(msg="not scored: the extraction ended without finishing (%s)"
                                 % (ended.get("msg") or "no message"), not_started=True)
            if time.monotonic() >= deadline:
                module.fail_json(msg="not scored: the extraction did not finish within %s s" % after["timeout"],
                                 not_started=True)
            watch.wait(min(1.0, deadline - time.monotonic()))


def main():
    module = stage_module(dict(REQUEST_OPTIONS, **HOST_OPTIONS),
                          required_if=[("server_drafter", "reference", ("reference_drafter",))])
    # Refused here, before the ML environment is started for nothing.
    if not DEVICE_FORM.match(module.params["device"]):
        module.fail_json(msg="device %r is not one of auto, cpu, cuda, cuda:N" % module.params["device"])
    bounds = cpu_scope.with_defaults(module.params["cpu_bounds"] or {}, os.cpu_count() or 1)
    problems = cpu_scope.check_bounds(bounds)
    if problems:
        module.fail_json(msg="cpu_bounds %r: %s" % (bounds, "; ".join(problems)))
    if module.params["start_after"] and not module.check_mode:
        wait_for_extraction(module, module.params["start_after"])
    manager = cpu_scope.host_systemd_manager() if bounds else None
    # Ansible reserves 'warnings' in a module result for its own display.
    # A systemd scope holds the process it starts; `nice` alone is set by whatever runs the stage.
    scoped = bool(bounds) and manager is not None
    result = stage_result(module, "score", REQUEST_OPTIONS, FIGURES, renamed={"warnings": "diagnostic_warnings"},
                          wrap=(lambda cmd: cpu_scope.bounded_argv(cmd, bounds, manager)) if scoped else None,
                          nice=0 if scoped else int(bounds.get("nice") or 0),
                          extra_env=cpu_scope.thread_environment(bounds))
    result["diagnostic_warnings"] = list(result["diagnostic_warnings"] or [])
    for warning in result["diagnostic_warnings"]:
        module.warn(warning)
    result["out_dir"] = result["out_dir"] or module.params["out_dir"]
    module.exit_json(**result)


if __name__ == "__main__":
    main()
