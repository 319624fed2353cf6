#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: sglang_completions
short_description: Prefetch the target model's exact greedy completions from a running SGLang server
version_added: "0.1.0"
description:
  - Runs C(python -m specops.completions) in the ML environment O(python). Every prompt of
    O(prompts) is tokenized with the target's tokenizer (O(tokenizer)) and sent to SGLang's
    C(/generate) as C(input_ids) with temperature 0, so the prompt and output token ids are the
    server's own, exactly; the returned text is kept but never re-tokenized.
  - O(prompts) is a JSONL file with one object per line, either C({"id", "prompt"}) (tokenized as
    plain text) or C({"id", "messages"}) (a chat, rendered with the tokenizer's chat template and
    the generation prompt). Ids must be unique strings. Every invalid line is reported with its
    line number and the problem.
  - Requests run with bounded concurrency (O(concurrency)) and a per-request timeout; connection
    errors, timeouts and 5xx answers (such as 503 while SGLang starts) are retried with exponential
    backoff, a 4xx answer fails at once. An answer that is not SGLang-like (no C(output_ids), empty
    C(output_ids), token counts that disagree with C(meta_info)) fails with the endpoint and what
    came back.
  - Writes C(completions.jsonl) (one line per prompt, in prompt-file order, with C(id),
    C(prompt_ids), C(output_ids), C(text), C(finish_reason) and the server's C(meta_info)) and, last,
    C(manifest.json) (the server's model path and weight version, the sampling parameters, the
    prompts and tokenizer digests, the count and the file's checksum) into O(out_dir), atomically.
  - A rerun with the same prompts, tokenizer, server model and O(max_new_tokens) generates nothing
    and reports C(changed=false). An interrupted run leaves C(completions.partial.jsonl); the next
    run with the same inputs reuses its records and fetches only the rest.
author:
  - specops maintainers (@specops)
extends_documentation_fragment:
  - specops.drafter.stage
options:
  server_url:
    description:
      - Base URL of the SGLang server (no trailing path).
    type: str
    default: http://127.0.0.1:30000
  api_key:
    description:
      - "The server's API key (SGLang started with C(--api-key)), sent as C(Authorization: Bearer) on
        every request. Empty sends none. Never returned or written."
    type: str
    default: ""
  prompts:
    description:
      - JSONL file of prompts on the managed host, C({"id", "prompt"}) or C({"id", "messages"}) per line.
    type: path
    required: true
  tokenizer:
    description:
      - Directory of the target model that SGLang serves, on the managed host; its tokenizer files
        and chat template turn prompts into C(input_ids).
    type: path
    required: true
  out_dir:
    description:
      - Directory that receives C(completions.jsonl) and C(manifest.json) (created if needed).
    type: path
    required: true
  max_new_tokens:
    description:
      - Greedy tokens to generate per prompt at most (generation also stops at the model's eos).
    type: int
    default: 256
  concurrency:
    description:
      - Requests in flight at once. Keep it low while SGLang serves production traffic.
    type: int
    default: 4
  timeout:
    description:
      - Seconds to wait for one answer before it counts as failed (and is retried).
    type: float
    default: 300
  retries:
    description:
      - Retries per request after a connection error, a timeout or a 5xx answer.
    type: int
    default: 5
  backoff:
    description:
      - Seconds before the first retry; each further retry waits twice as long, at most 30 s.
    type: float
    default: 1.0
attributes:
  check_mode:
    support: full
    description: Says whether the completions are up to date or would be fetched; it reads the prompts
      and asks the server for its model info (C(/get_model_info)), and generates nothing.
  diff_mode:
    support: none
    description: Nothing to diff; the result says how many completions were fetched or reused.
  platform:
    support: full
    platforms: posix
    description: Runs on POSIX hosts that have the ML environment.
notes:
  - Readiness is not this module's job; gate on SGLang's C(/health_generate) first (the
    C(specops.drafter.sglang_service) role does). Retries with backoff ride out a short restart.
  - Check mode needs the server to answer C(/get_model_info), since the server's model is part of
    what decides whether the output is up to date.
seealso:
  - module: specops.drafter.extract_hidden_states
  - module: specops.drafter.score_drafter
"""

EXAMPLES = r"""
- name: Prefetch greedy completions while SGLang still serves
  specops.drafter.sglang_completions:
    python: /opt/specops/ml/bin/python
    server_url: http://127.0.0.1:30000
    prompts: /srv/eval/prompts/coding.jsonl
    tokenizer: /models/Qwen3.6-27B
    out_dir: /srv/eval/run-1/completions
    max_new_tokens: 1024
    concurrency: 4
  register: completions

- name: Show what was fetched
  ansible.builtin.debug:
    msg: "{{ completions.count }} completions ({{ completions.resumed }} resumed) from {{ completions.model_path }}"
"""

RETURN = r"""
count:
  description: Prompts in the prompts file (and records in the output).
  returned: always
  type: int
  sample: 100
generated:
  description: Completions fetched from the server by this run; null in check mode when the output would be
    written.
  returned: always
  type: int
  sample: 60
resumed:
  description: Completions reused from an interrupted run's partial file; null in check mode when the output
    would be written.
  returned: always
  type: int
  sample: 40
path:
  description: Path of completions.jsonl.
  returned: always
  type: str
  sample: /srv/eval/run-1/completions/completions.jsonl
manifest:
  description: Path of manifest.json.
  returned: always
  type: str
out_dir:
  description: The output directory.
  returned: always
  type: str
inputs_fingerprint:
  description: Digest of everything the output depends on (prompts, tokenizer, server model, sampling).
  returned: always
  type: str
model_path:
  description: The model path the server reports.
  returned: always
  type: str
  sample: /models/Qwen3.6-27B
weight_version:
  description: The weight version the server reports, null when it reports none.
  returned: always
  type: str
  sample: default
sha256:
  description: SHA-256 of completions.jsonl; null in check mode when the output would be written.
  returned: always
  type: str
finish_reasons:
  description: How many completions ended at a stop token (stop) or at max_new_tokens (length); empty in
    check mode when the output would be written.
  returned: always
  type: dict
  sample: {"length": 80, "stop": 20}
reason:
  description: Why the output could not be reused (other inputs, a missing file, or a damaged one).
  returned: when completions were fetched, or in check mode when they would be
  type: str
damaged:
  description: The lines of an earlier output of the same inputs that no longer match their sha256, with ids;
    only those records are fetched again.
  returned: when completions were fetched
  type: list
  elements: str
"""

from ansible_collections.specops.drafter.plugins.module_utils.stages.stage_runner import stage_module, stage_result

# The request's options: specops.completions REQUEST declares them (tests/ansible/test_stage_schemas.py checks).
REQUEST_OPTIONS = dict(
    server_url=dict(type="str", default="http://127.0.0.1:30000"),
    prompts=dict(type="path", required=True),
    tokenizer=dict(type="path", required=True),
    out_dir=dict(type="path", required=True),
    # A count of tokens, not a secret.
    max_new_tokens=dict(type="int", default=256, no_log=False),
    concurrency=dict(type="int", default=4),
    timeout=dict(type="float", default=300),
    retries=dict(type="int", default=5),
    backoff=dict(type="float", default=1.0),
    api_key=dict(type="str", default="", no_log=True),
)

FIGURES = {
    "count": None,
    "generated": None,
    "resumed": None,
    "path": None,
    "manifest": None,
    "inputs_fingerprint": None,
    "model_path": None,
    "weight_version": None,
    "sha256": None,
    "finish_reasons": {},
}


def main():
    module = stage_module(REQUEST_OPTIONS)
    # Why the output was not reused, and which records were damaged: returned only when there is a why.
    result = stage_result(module, "completions", REQUEST_OPTIONS, FIGURES, optional=("reason", "damaged"))
    result["out_dir"] = module.params["out_dir"]
    module.exit_json(**result)


if __name__ == "__main__":
    main()
