"""Stage `completions`: the target's own greedy tokens for every prompt, fetched from SGLang's /generate.

Prompts are tokenized here with the target's tokenizer and sent as `input_ids`, and the answer's
`output_ids` are stored as they come: scoring later needs the exact tokens, which a text round-trip
through a tokenizer does not guarantee. Finished records are appended to a partial file one by one,
so an interrupted run resumes where it stopped; the final file and the manifest are written last.

Request (JSON on stdin, see specops.stage): `REQUEST` in specops.completions.request, the one
declaration of its options.

This module holds the stage itself (prepare, plan, the concurrent fetch, run); the request is in
request, the prompts and tokenizer in prompts, the HTTP client in client, the validation of an
answer in answer and the records on disk in records.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import CancelledError, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops.completions.answer import check_generation
from specops.completions.client import ServerClient
from specops.completions.prompts import (
    Prompt,
    load_prompts,
    tokenize,
    tokenizer_identity,
)
from specops.completions.records import (
    OUTPUT_NAME,
    PARTIAL_NAME,
    PartialWriter,
    damaged_records,
    intact_records,
    line_sha256,
    read_partial,
)
from specops.completions.request import STAGE, Settings, parse_request
from specops.manifest import (
    MANIFEST_NAME,
    atomic_write_text,
    fingerprint,
    is_up_to_date,
    load_manifest,
    remove_stale_temporaries,
    sha256_file,
    staleness,
    write_manifest,
)
from specops.stage import StageError, log, serve

TEMPERATURE = 0.0  # greedy: the only setting under which offline scoring can reproduce the server


@dataclass
class Prepared:
    settings: Settings
    prompts: list[Prompt]
    model_info: dict[str, Any]
    inputs: dict[str, Any]
    inputs_fingerprint: str


def prepare(request: dict[str, Any]) -> Prepared:
    """Everything that decides the output, without generating: cheap enough for check mode."""
    settings = parse_request(request)
    prompts = load_prompts(settings.prompts)
    identity = tokenizer_identity(settings.tokenizer)
    with ServerClient(settings) as client:
        model_info = client.model_info()
    inputs = {
        "prompts": {"sha256": sha256_file(settings.prompts), "size": settings.prompts.stat().st_size},
        "tokenizer": identity,
        "server": model_info,
        "sampling": {"temperature": TEMPERATURE, "max_new_tokens": settings.max_new_tokens},
    }
    return Prepared(settings, prompts, model_info, inputs, fingerprint(inputs))


def _summary(prepared: Prepared, changed: bool, **extra: Any) -> dict[str, Any]:
    out = prepared.settings.out_dir
    return {
        "changed": changed,
        "count": len(prepared.prompts),
        "path": str(out / OUTPUT_NAME),
        "manifest": str(out / MANIFEST_NAME),
        "inputs_fingerprint": prepared.inputs_fingerprint,
        "model_path": prepared.model_info["model_path"],
        "weight_version": prepared.model_info["weight_version"],
        **extra,
    }


def _recorded(out: Path) -> dict[str, Any]:
    """What an up-to-date output's manifest says about it, so a no-op run reports the same figures."""
    manifest = load_manifest(out) or {}
    return {
        "sha256": manifest.get("files", {}).get(OUTPUT_NAME, {}).get("sha256"),
        "finish_reasons": manifest.get("finish_reasons", {}),
    }


def plan(request: dict[str, Any]) -> dict[str, Any]:
    prepared = prepare(request)
    out = prepared.settings.out_dir
    reason = staleness(out, prepared.inputs_fingerprint)
    if reason is None:
        return _summary(prepared, False, generated=0, resumed=0, **_recorded(out))
    damaged = damaged_records(out, prepared.inputs_fingerprint, [p.id for p in prepared.prompts])
    return _summary(
        prepared,
        True,
        generated=None,
        resumed=None,
        reason=reason + (f" ({'; '.join(damaged)})" if damaged else ""),
        msg=f"would fetch {len(prepared.prompts)} completion(s) into {out / OUTPUT_NAME}",
    )


def _generate(
    prepared: Prepared, prompt_ids: dict[str, list[int]], done: dict[str, dict], writer: PartialWriter
) -> None:
    settings = prepared.settings
    pending = [p for p in prepared.prompts if p.id not in done]
    abort = threading.Event()
    client = ServerClient(settings, abort)
    endpoint = f"POST {settings.server_url}/generate"
    total, first_error = len(prepared.prompts), None
    step = max(1, len(pending) // 10)

    def one(prompt: Prompt) -> dict[str, Any]:
        body = {
            "input_ids": prompt_ids[prompt.id],
            "sampling_params": {"temperature": TEMPERATURE, "max_new_tokens": settings.max_new_tokens},
        }
        answer = client.request("POST", "/generate", body)
        return check_generation(answer, prompt, prompt_ids[prompt.id], settings.max_new_tokens, endpoint)

    with client, ThreadPoolExecutor(settings.concurrency, thread_name_prefix="completions") as pool:
        futures = [pool.submit(one, prompt) for prompt in pending]
        try:
            for count, future in enumerate(as_completed(futures), start=1):
                try:
                    record = future.result()
                except CancelledError:
                    continue
                except StageError as error:
                    if first_error is None:
                        first_error = error
                        abort.set()  # in-flight retries stop; queued prompts are not sent
                        for other in futures:
                            other.cancel()
                    continue
                writer.append(record)
                done[record["id"]] = record
                if count % step == 0 or count == len(pending):
                    log(f"completions: {len(done)}/{total}")
        finally:
            abort.set()
    if first_error is not None:
        raise StageError(
            f"{first_error} ({len(done)} of {total} completions kept in "
            f"{settings.out_dir / PARTIAL_NAME}: rerun to resume)"
        )


def run(request: dict[str, Any]) -> dict[str, Any]:
    prepared = prepare(request)
    settings, out = prepared.settings, prepared.settings.out_dir
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    if is_up_to_date(out, prepared.inputs_fingerprint):
        log(f"completions: {out / OUTPUT_NAME} is up to date")
        return _summary(prepared, False, generated=0, resumed=0, **_recorded(out))

    previous = load_manifest(out)
    reason = staleness(out, prepared.inputs_fingerprint)
    damaged = damaged_records(out, prepared.inputs_fingerprint, [p.id for p in prepared.prompts])
    log(f"completions: fetching, {reason}" + "".join(f"; {problem}" for problem in damaged))
    prompt_ids = tokenize(prepared.prompts, settings.tokenizer, settings.prompts)
    intact = intact_records(out, prepared.inputs_fingerprint, prompt_ids)
    # The manifest means "complete": it goes first, so a crash below never pairs it with a new file.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    partial = out / PARTIAL_NAME
    done = {**intact, **read_partial(partial, prepared.inputs_fingerprint, prompt_ids)}
    resumed = len(done)
    if resumed:
        log(f"completions: resuming, {resumed} of {len(prepared.prompts)} already fetched")
    writer = PartialWriter(partial, prepared.inputs_fingerprint, list(done.values()))
    try:
        _generate(prepared, prompt_ids, done, writer)
    finally:
        writer.close()

    records = [done[prompt.id] for prompt in prepared.prompts]
    lines = [json.dumps(r, sort_keys=True) + "\n" for r in records]
    atomic_write_text(out / OUTPUT_NAME, "".join(lines))
    manifest = write_manifest(
        out,
        STAGE,
        prepared.inputs,
        [OUTPUT_NAME],
        count=len(records),
        server_url=settings.server_url,
        prompts_path=str(settings.prompts.resolve()),
        tokenizer_path=str(settings.tokenizer.resolve()),
        finish_reasons=dict(Counter(r["finish_reason"] for r in records)),
        # Per record, so a damaged line is named and refetched alone.
        records_sha256={r["id"]: line_sha256(line) for r, line in zip(records, lines, strict=True)},
    )
    partial.unlink(missing_ok=True)
    log(
        f"completions: wrote {len(records)} record(s) to {out / OUTPUT_NAME}"
        + (" (replacing an output made from other inputs)" if previous else "")
    )
    return _summary(
        prepared,
        True,
        generated=len(records) - resumed,
        resumed=resumed,
        reason=reason,
        damaged=damaged,
        sha256=manifest["files"][OUTPUT_NAME]["sha256"],
        finish_reasons=manifest["finish_reasons"],
    )


def main(argv: list[str] | None = None) -> int:
    return serve(STAGE, plan, run, argv)
