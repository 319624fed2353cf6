#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: extract_hidden_states
short_description: Extract a target model's hidden states at a DFlash drafter's layers
description:
  - Runs C(python -m specops.extract) in the ML environment built by the C(fla_env) module.
  - Reads the completions written by C(sglang_completions) and writes safetensors shards plus a
    C(manifest.json) into O(out_dir); only the captured layers run (no later layers, no lm_head).
  - An output whose manifest matches the current inputs is left alone (C(changed=false)) without
    loading the model; an interrupted run resumes from its finished shards.
  - Long extractions should run as an async task; progress goes to O(progress_log).
version_added: "0.1.0"
author:
  - specops maintainers (@specops)
extends_documentation_fragment:
  - specops.drafter.stage
options:
  target:
    description: Directory of the target model (C(config.json) and C(*.safetensors)).
    type: path
    required: true
  completions:
    description: Output directory of C(sglang_completions) (holds C(completions.jsonl)).
    type: path
    required: true
  out_dir:
    description: Directory for the shards, C(manifest.json) and C(progress.log).
    type: path
    required: true
  drafter:
    description:
      - DFlash drafter directory, or a list of them; the union of their C(dflash_config.target_layer_ids)
        is captured once, so several drafters are scored on one extraction.
      - Required unless O(layer_ids) is given.
    type: list
    elements: path
  layer_ids:
    description:
      - Target layer ids to capture, overriding the drafter's. Layer V(k) is C(hidden_states[k + 1]) of
        transformers' C(output_hidden_states).
    type: list
    elements: int
  capture_offsets:
    description:
      - Also capture layers V(k + offset) for each target layer V(k); neighbours outside the model are
        skipped and recorded. V([-1, 0, 1]) serves the scorer's layer-offset diagnostic.
    type: list
    elements: int
    default: [0]
  dtype:
    description: Compute and storage dtype; V(auto) is bfloat16 on CUDA and float32 on the CPU.
    type: str
    choices: [auto, bfloat16, float16, float32]
    default: auto
  device:
    description:
      - The device when O(devices) is not given, V(auto), V(cpu), V(cuda) or V(cuda:N).
      - With V(auto) and no O(devices), every GPU torch sees is a candidate (see O(parallel)).
    type: str
    default: auto
  devices:
    description:
      - Devices to extract on, such as V([cuda:0, cuda:1]); default every GPU torch sees when O(device) is
        V(auto), else O(device) alone. V(cpu) may be listed more than once (for tests).
      - The devices are not part of the output's inputs fingerprint, so an interrupted run resumes on
        another set of devices.
    type: list
    elements: str
  parallel:
    description:
      - How to use several devices. V(data) loads one copy of the model per device and divides the
        shards among them (longest first, so they finish together). V(split) spreads the model's layers
        over the devices in proportion to their free memory, for a model that fits on no single device.
        V(single) uses the first device only.
      - V(auto) picks from each device's free memory at run time, against one copy of the model up to
        the last captured layer plus a reserve for one batch's activations; the choice, the devices and
        the memory figures are recorded in the manifest under C(parallel).
    type: str
    choices: [auto, single, data, split]
    default: auto
  require_backend:
    description:
      - Gated-delta-rule implementation the run must use. The values are those of
        O(specops.drafter.fla_env#module:require_backend) and mean the same.
      - V(fla) fails the run (its plan, before any weights load) unless fla's kernels run on the GPU; it
        fails if transformers falls back to the torch implementation.
      - V(auto) is V(fla) when the device is CUDA, else V(any).
      - V(torch) forces the PyTorch reference implementation (fla need not be installed, and on the CPU
        an installed fla is not called).
      - V(any) accepts whatever transformers runs.
    type: str
    choices: [auto, fla, torch, any]
    default: auto
  parity_samples:
    description: Records on which to compare the running backend with the fp32 torch reference; V(0) is off.
    type: int
    default: 0
  parity_tolerance:
    description:
      - Relative error per layer above which the parity probe fails (the limit is the larger of this and
        twice the bf16 noise floor measured in the same run).
    type: float
    default: 0.05
  batch_tokens:
    description: Most tokens (padding included) in one forward.
    type: int
    default: 16384
  shard_tokens:
    description: Tokens per shard file.
    type: int
    default: 32768
  writer_threads:
    description: Threads that write shards while the next batches compute.
    type: int
    default: 4
  fsync:
    description:
      - Flush each shard to the device while it is written, so a power loss cannot damage shards the
        manifest lists. V(false) leaves flushing to the OS, for a disk slower than the extraction.
    type: bool
    default: true
  progress_log:
    description: Progress log (tokens done / total, tokens per second); default O(out_dir)/progress.log.
    type: path
  disk_reserve_bytes:
    description: Bytes that must stay free on the output's file system once the planned shards and the files
      beside them are written (64 MiB; 0 keeps nothing free).
    type: int
    default: 67108864
  start_signal:
    description:
      - Start ahead of the GPU window; run as an async task. The extraction prepares (imports, inputs, the
        target's weights in host memory), then waits until M(specops.drafter.start_signal) writes go into
        this file; on abort, an expired lease or a missing file it exits having written nothing.
    type: path
    version_added: "0.2.0"
  window_mode:
    description:
      - The window the extraction runs in, for the host memory plan. V(memory_saver) counts the server's
        pinned CPU backup of its weights beside the extraction's; V(stop) counts the page cache the
        server's restart reads its weights from.
    type: str
    choices: [stop, memory_saver]
    default: stop
  host_weights:
    description:
      - Weights held ahead of the window (with O(start_signal)). V(pinned) refuses, before the service is
        touched, a host without room for them beside what the window needs; V(pageable) never holds them
        ahead (they load inside the window through the page cache); V(auto) pins where the host has room.
    type: str
    choices: [auto, pinned, pageable]
    default: auto
  server_weights_bytes:
    description: Bytes of the served model's weights (its CPU backup in memory-saver mode); V(0) is the target's.
    type: int
    default: 0
  host_memory_reserve_bytes:
    description: Host memory left to everything else; V(0) is the larger of 4 GiB and 5% of the host's.
    type: int
    default: 0
  meminfo:
    description: The host's memory figures, in C(/proc/meminfo)'s format (MemTotal, MemAvailable).
    type: path
    default: /proc/meminfo
attributes:
  check_mode:
    support: full
    description: Validates the inputs and reports whether the output is out of date; loads no model.
  diff_mode:
    support: none
    description: Outputs are tensor shards; no diff is shown.
notes:
  - The ML environment must import C(specops); the C(fla_env) module installs it.
"""

EXAMPLES = r"""
- name: Extract the target's hidden states at the drafter's layers
  specops.drafter.extract_hidden_states:
    python: /opt/specops/ml/bin/python
    target: /models/Qwen3.6-27B
    drafter: /models/Qwen3.6-27B-DFlash
    completions: /srv/eval/run1/completions
    out_dir: /srv/eval/run1/hidden_states
    parity_samples: 4
  async: 7200
  poll: 0
  register: extraction

- name: Capture the neighbours of each layer too, for the layer-offset diagnostic
  specops.drafter.extract_hidden_states:
    python: /opt/specops/ml/bin/python
    target: /models/Qwen3.6-27B
    drafter: /models/Qwen3.6-27B-DFlash
    completions: /srv/eval/run1/completions
    out_dir: /srv/eval/run1/hidden_states_offsets
    capture_offsets: [-1, 0, 1]

- name: Spread a target too large for one GPU over two
  specops.drafter.extract_hidden_states:
    python: /opt/specops/ml/bin/python
    target: /models/Qwen3.6-27B
    drafter: /models/Qwen3.6-27B-DFlash
    completions: /srv/eval/run1/completions
    out_dir: /srv/eval/run1/hidden_states
    devices: [cuda:0, cuda:1]
    parallel: split
"""

RETURN = r"""
inputs_fingerprint:
  description: The fingerprint of what the output is to be made from (target, completions' tokens, layers, options).
  returned: check mode, when the output is out of date
  type: str
out_dir:
  description: Directory holding the shards and the manifest.
  returned: always
  type: str
manifest:
  description: Path of C(manifest.json).
  returned: always
  type: str
layer_ids:
  description: Captured layer ids, in the order of the shards' layer axis.
  returned: always
  type: list
  elements: int
records:
  description: Number of completions extracted.
  returned: always
  type: int
tokens:
  description: Number of tokens extracted (prompt and output).
  returned: always
  type: int
shards:
  description: Shard file names.
  returned: always
  type: list
  elements: str
backend:
  description: Implementations that ran (C(gated_delta_rule), C(causal_conv1d)), device and dtype.
  returned: when the extraction ran or had run
  type: dict
parity:
  description: Per-layer cosine similarity and relative error against the fp32 torch reference.
  returned: when O(parity_samples) > 0
  type: dict
progress:
  description: Timings and throughput of the run (tokens per second, shards resumed, per device).
  returned: when the extraction ran or had run
  type: dict
parallel:
  description:
    - How the run used its devices (C(mode) single, data or split, C(devices), C(reason), the memory
      figures it was decided from, and for split the C(layers) each device holds).
    - In check mode, the choice the devices' total memory would give; the run decides on free memory.
  returned: always
  type: dict
reason:
  description: Why the output cannot be reused (other inputs, or which file is missing or damaged).
  returned: in check mode, when an extraction is needed
  type: str
estimated_bytes:
  description: Bytes the shards still to write will take on disk.
  returned: in check mode, when an extraction is needed
  type: int
host_memory:
  description:
    - The host memory plan, made before the window. Keys (bytes unless named otherwise)
      C(weights) (V(pinned) or V(pageable)), C(reason), C(msg) (one line for the play to show),
      C(available_bytes), C(total_bytes), C(meminfo), C(window_mode), C(prestart), C(host_weights),
      C(extraction_weights_bytes), C(server_cpu_backup_bytes), C(restart_page_cache_bytes),
      C(reserve_bytes), C(pinned_needs_bytes), C(pageable_needs_bytes).
    - A host without room for what the window needs fails the plan instead, its message naming the figures.
  returned: in check mode, when an extraction is needed
  type: dict
gpu_need:
  description:
    - What the extraction needs on the GPUs, for the memory-saver window's plan (sglang_service's
      O(specops.drafter.sglang_service#module:extraction_gpu)) - C(copy_bytes) (the target up to its last
      captured layer, head included), C(body_bytes) (without the head, when split over GPUs),
      C(reserve_bytes) (activations and workspace at the planned batch).
  returned: in check mode, when an extraction is needed
  type: dict
estimated_seconds:
  description:
    - A pessimistic duration of the extraction (start, model load, forwards, writes), to size the
      window's guard; V(0.0) when nothing is to extract.
  returned: in check mode
  type: float
estimated_seconds_prestarted:
  description:
    - The same inside the window of an extraction started ahead of it (its start and disk reads done, the
      weights copied from host memory), which eval.yml plans the window with.
  returned: in check mode
  type: float
"""

from ansible_collections.specops.drafter.plugins.module_utils.stages.stage_runner import stage_module, stage_result

# The request's options: specops.extract REQUEST declares them (tests/ansible/test_stage_schemas.py checks).
REQUEST_OPTIONS = dict(
    target=dict(type="path", required=True),
    completions=dict(type="path", required=True),
    out_dir=dict(type="path", required=True),
    drafter=dict(type="list", elements="path"),
    layer_ids=dict(type="list", elements="int"),
    capture_offsets=dict(type="list", elements="int", default=[0]),
    dtype=dict(type="str", default="auto", choices=["auto", "bfloat16", "float16", "float32"]),
    device=dict(type="str", default="auto"),
    devices=dict(type="list", elements="str"),
    parallel=dict(type="str", default="auto", choices=["auto", "single", "data", "split"]),
    require_backend=dict(type="str", default="auto", choices=["auto", "fla", "torch", "any"]),
    parity_samples=dict(type="int", default=0),
    parity_tolerance=dict(type="float", default=0.05),
    batch_tokens=dict(type="int", default=16384, no_log=False),
    shard_tokens=dict(type="int", default=32768, no_log=False),
    writer_threads=dict(type="int", default=4),
    fsync=dict(type="bool", default=True),
    progress_log=dict(type="path"),
    disk_reserve_bytes=dict(type="int", default=67108864),
    start_signal=dict(type="path"),
    window_mode=dict(type="str", default="stop", choices=["stop", "memory_saver"]),
    host_weights=dict(type="str", default="auto", choices=["auto", "pinned", "pageable"]),
    server_weights_bytes=dict(type="int", default=0),
    host_memory_reserve_bytes=dict(type="int", default=0),
    meminfo=dict(type="path", default="/proc/meminfo"),
)


def main():
    module = stage_module(REQUEST_OPTIONS, required_one_of=[("drafter", "layer_ids")])
    module.exit_json(**stage_result(module, "extract", REQUEST_OPTIONS))


if __name__ == "__main__":
    main()
