"""The service window: how long the service was down (or released), and what filled that time.

The play marks the start of each stage inside the window and the moment the service answered
again (/health_generate after a start, a 1-token /generate after a resume); the extraction's
manifest says how much of its stage was compute. This module turns both into the `window` record
that report.json, report.md and set_stats carry:

    downtime_s = the service's own moments on the host's clock: from the stop (or the pause before
                 the memory-saver release) to the first 200 after it is back, as the sglang_service
                 helpers record them; without them, ready - the first stage's mark
    play_span_s = the play's marks, from the first stage to ready (its set-up before the stop and
                 its polling after the extraction included): the bound the play itself observed
    stages     = the time from each mark to the next
    compute_s  = the extraction's forwards (device time on CUDA, host-timed forwards on the CPU)
    extraction.prestart = what an extraction started ahead of the window did before it (process
                 start and inputs, weights into host memory, the wait), outside the downtime
    other_s    = downtime_s - compute_s: what a shorter window could still save

Outages no play saw end (the play that took the service down was lost and the host-side guard brought
it back) come from the guard's record through the next run's sglang_service call: `--run` with
{"hidden_states": DIR, "outages": [...]} and no marks adds them to DIR/outages.json, which the report
shows beside the window.

python -m specops.window --plan|--run: JSON request on stdin, {"marks": [[stage, epoch_s], ...,
["ready", epoch_s]], "mode": "stop" | "memory_saver", "hidden_states": DIR, "service":
{"down_at": epoch_s, "ready_at": epoch_s, "start_s": s, "started_instead": bool,
"weights_check": {before, after, matched, ...}}}; --run writes DIR/window.json, where the score stage
finds it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specops.manifest import atomic_write_json, load_manifest
from specops.stage import StageError, serve

WINDOW_JSON = "window.json"
OUTAGES_JSON = "outages.json"
READY = "ready"
MODES = ("stop", "memory_saver")
# The extraction's stage, whose time splits into the process around the work and the work itself.
EXTRACT_STAGE = "extract"


def _iso(epoch: float) -> str:
    stamp = datetime.fromtimestamp(epoch, tz=timezone.utc).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def _parse_marks(marks: Sequence[Sequence[Any]]) -> list[tuple[str, float]]:
    parsed = []
    for mark in marks:
        if len(mark) != 2:
            raise StageError(f"window mark {mark!r} is not [stage, epoch seconds]")
        parsed.append((str(mark[0]), float(mark[1])))
    if len(parsed) < 2 or parsed[-1][0] != READY:
        raise StageError(
            f"the window's marks must end with '{READY}' after at least one stage; got "
            f"{[name for name, _ in parsed]}: mark when the service answered again"
        )
    for (name, at), (next_name, next_at) in zip(parsed, parsed[1:], strict=False):
        if next_at < at:
            raise StageError(
                f"window mark '{next_name}' ({next_at}) comes before '{name}' ({at}): "
                "the marks must be taken in order, on one clock"
            )
    return parsed


def extraction_figures(manifest: Mapping[str, Any] | None) -> dict[str, Any]:
    """What the extraction's manifest says about its own time (seconds; None where not recorded)."""
    progress = (manifest or {}).get("progress") or {}
    compute = progress.get("device_busy_s")
    source = "device" if compute is not None else "host"
    if compute is None:
        compute = progress.get("forward_s")
    return {
        "compute_s": compute,
        "compute_measured_on": source if compute is not None else None,
        "load_s": progress.get("load_s"),
        "loop_s": progress.get("total_s"),
        "tokens": progress.get("tokens"),
        "backend": ((manifest or {}).get("backend") or {}).get("gated_delta_rule"),
        # The writers' tail after the last forward: the part of the loop that writing adds.
        "write_tail_s": progress.get("finish_s"),
        "prestart": progress.get("prestart"),
        "loop_ended_at": progress.get("loop_ended_at"),
    }


def build_window(
    marks: Sequence[Sequence[Any]],
    mode: str,
    manifest: Mapping[str, Any] | None,
    prepared: Mapping[str, Any] | None = None,
    service: Mapping[str, Any] | None = None,
    follows: Mapping[str, Any] | None = None,
    finished: float | None = None,
) -> dict[str, Any]:
    """The window record from the play's marks and the extraction's manifest; `prepared` is what
    specops.prewarm did before the window (outside the downtime, recorded beside it); `service`
    holds the moments the service went down and answered again, on the host's clock; `finished` the
    moment the extraction said its outputs were written and the device's memory given back."""
    if mode not in MODES:
        raise StageError(f"window mode {mode!r} is not one of {', '.join(MODES)}")
    parsed = _parse_marks(marks)
    stages: list[dict[str, Any]] = [
        {"stage": name, "s": round(next_at - at, 3)}
        for (name, at), (_, next_at) in zip(parsed, parsed[1:], strict=False)
    ]
    play_span = parsed[-1][1] - parsed[0][1]
    moments = _service_moments(service)
    down_at, ready_at = moments or (parsed[0][1], parsed[-1][1])
    downtime = ready_at - down_at
    extraction = extraction_figures(manifest)
    extraction["finished_at"] = finished
    extract_stage = sum(s["s"] for s in stages if s["stage"] == EXTRACT_STAGE)
    if extract_stage and extraction["loop_s"] is not None:
        # Process start, imports, planning and the play's polling: the stage's time outside the work.
        around = extract_stage - extraction["loop_s"] - (extraction["load_s"] or 0)
        extraction["around_s"] = round(max(0.0, around), 3)
    compute = extraction["compute_s"]
    return {
        "taken": True,
        "mode": mode,
        "down_at": _iso(down_at),
        "ready_at": _iso(ready_at),
        "downtime_s": round(downtime, 3),
        "measured_by": "service" if moments else "play",
        # The stop window's server start, launch to first 200 (process backend; None otherwise).
        "server_start_s": _seconds((service or {}).get("start_s")),
        # How the memory-saver window held its requests (retract, or drain then abort) and the
        # server's SGLang version and memory backend, as the server said them.
        "pause_mode": (service or {}).get("pause_mode") or None,
        "server_version": (service or {}).get("version") or None,
        "memory_saver_backend": (service or {}).get("memory_saver_backend") or None,
        # The memory-saver window's server died inside it: the resume started a new one from disk.
        "started_instead": bool((service or {}).get("started_instead")),
        # What the memory-saver release freed and why (the KV cache alone keeps the weights on the GPU).
        "memory_plan": memory_plan_summary((service or {}).get("memory_plan")),
        # The pause, flush and release, from the service's own moments (memory saver).
        "release_s": _span(down_at if moments else None, (service or {}).get("released_at")),
        # The guard resumed the server the moment the extraction's job ended (memory saver, prestarted).
        "resumed_by": (service or {}).get("resumed_by") or None,
        # Every second of the downtime by where it went, on the host's clock (memory saver, prestarted).
        "accounted": account(down_at, ready_at, service, extraction) if moments else None,
        # The weights' checksum before the release and after the resume (/weights_checker); restarted
        # from disk when they differed. None where the server has no checksum to give.
        "weights_check": (service or {}).get("weights_check") or None,
        # The window as one step on the host: its seconds by stage as sglang_service's state window saw them.
        "step_stages": (service or {}).get("step_stages") or None,
        "play_span_s": round(play_span, 3),
        "stages": stages,
        "extraction": extraction,
        "compute_s": None if compute is None else round(compute, 3),
        "other_s": None if compute is None else round(downtime - compute, 3),
        "compute_share": None if compute is None or not downtime else round(compute / downtime, 4),
        "prepared": dict(prepared) if prepared else None,
        # The window of another extraction on this host shortly before: the service went down twice.
        "follows": dict(follows) if follows else None,
    }


def _moment(value: Any) -> float | None:
    try:
        return None if value is None or value == "" else float(value)
    except (TypeError, ValueError):
        return None


def account(
    down_at: float, ready_at: float, service: Mapping[str, Any] | None, extraction: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The downtime split at the moments both sides recorded: pause + release, the GPU memory check, go
    reaching the extraction, its set-up, the weights' copy, its loop (parity and forwards), from the loop's
    end to the resume's start (the manifest, the extraction's exit, and the play's tasks unless the guard
    resumed at the work's end), and the resume to the first 200. Where the extraction said finished, that
    span is split there: the manifest and the device's memory given back, then the guard's reaction.
    None where a moment is missing (stop mode, or an extraction not started ahead)."""
    service = service or {}
    prestart = extraction.get("prestart") or {}
    released, go = _moment(service.get("released_at")), _moment(service.get("go_at"))
    seen, ended = _moment(prestart.get("go_seen_at")), _moment(extraction.get("loop_ended_at"))
    resume = _moment(service.get("resume_called_at"))
    if None in (released, go, seen, ended, resume):
        return None
    assert released is not None and go is not None and seen is not None and ended is not None
    assert resume is not None
    setup = float(prestart.get("setup_s") or 0.0)
    load = float(extraction.get("load_s") or 0.0)
    parts = {
        "pause_and_release_s": released - down_at,
        "gpu_memory_check_s": go - released,
        "go_to_extraction_s": seen - go,
        "extraction_setup_s": setup,
        "weights_to_device_s": load,
        "extraction_loop_s": ended - seen - setup - load,
        "loop_end_to_resume_s": resume - ended,
        "resume_to_ready_s": ready_at - resume,
    }
    finished = _moment(extraction.get("finished_at"))
    if finished is not None and ended <= finished <= resume:
        ready = parts.pop("resume_to_ready_s")
        del parts["loop_end_to_resume_s"]
        parts["outputs_and_device_release_s"] = finished - ended
        # The window in one step with the scoring in it: the scoring said finished last.
        scored = _moment(service.get("work_finished_at"))
        if scored is not None and finished < scored <= resume:
            parts["scoring_s"] = scored - finished
            finished = scored
        parts.update(finished_to_resume_s=resume - finished, resume_to_ready_s=ready)
    parts = {key: round(value, 3) for key, value in parts.items()}
    parts["unexplained_s"] = round((ready_at - down_at) - sum(parts.values()), 3)
    return parts


def memory_plan_summary(plan: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The plan's choice, tags, reason and the figures a reader checks it against."""
    if not plan or not plan.get("choice"):
        return None
    keys = (
        "choice",
        "tags",
        "reason",
        "fits_beside_weights",
        "free_after_kv_release_mib",
        "server",
        "source",
    )
    return {key: plan.get(key) for key in keys}


def _span(start: Any, end: Any) -> float | None:
    """Seconds from start to end (epoch seconds, as numbers or their text); None where either is missing."""
    try:
        return None if start is None or end is None else round(float(end) - float(start), 3)
    except (TypeError, ValueError):
        return None


def _service_moments(service: Mapping[str, Any] | None) -> tuple[float, float] | None:
    """(down_at, ready_at) from the service's helpers, or None when either is missing."""
    if not service:
        return None
    try:
        down_at, ready_at = float(service["down_at"]), float(service["ready_at"])
    except (KeyError, TypeError, ValueError):
        return None
    if ready_at < down_at:
        raise StageError(
            f"the service answered again ({ready_at}) before it went down ({down_at}): "
            "the down and ready moments must come from one host's clock"
        )
    return down_at, ready_at


def _seconds(value: Any) -> float | None:
    try:
        return None if value is None else round(float(value), 3)
    except (TypeError, ValueError):
        return None


def read_window(hidden_states: Path) -> dict[str, Any] | None:
    """The window that produced these hidden states, if the play recorded one."""
    try:
        return json.loads((hidden_states / WINDOW_JSON).read_text())
    except FileNotFoundError:
        return None


def read_outages(hidden_states: Path) -> list[dict[str, Any]]:
    """The outages the guard ended for runs on these hidden states, oldest first."""
    try:
        outages = json.loads((hidden_states / OUTAGES_JSON).read_text())
    except FileNotFoundError:
        return []
    return outages if isinstance(outages, list) else []


def _outage_entry(outage: Mapping[str, Any]) -> dict[str, Any]:
    down_at, ready_at = outage.get("down_at"), outage.get("ready_at")
    return {
        "down_at": None if down_at is None else _iso(float(down_at)),
        "ready_at": None if ready_at is None else _iso(float(ready_at)),
        "downtime_s": _span(down_at, ready_at),
        "cause": str(outage.get("cause") or "unknown"),
        "owner": outage.get("owner"),
        "server": outage.get("server"),
        "failed": bool(outage.get("failed")),
        "msg": outage.get("msg"),
        # "guard": an outage a guard ended; "found_down": a server this run found not running (its start
        # unknown) and started; "scoring_replica": a replica of the fleet out of the router for this host's
        # scoring (down_at to ready_at: from its drain to its return, the control node's clock).
        "kind": str(outage.get("kind") or "guard"),
    }


def record_outages(hidden_states: Path, outages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Add outages to DIR/outages.json (one entry per outage, however often it is given)."""
    known = read_outages(hidden_states)
    for outage in (_outage_entry(o) for o in outages):
        if outage not in known:
            known.append(outage)
    known.sort(key=lambda outage: outage["down_at"] or outage["ready_at"] or "")
    hidden_states.mkdir(parents=True, exist_ok=True)
    atomic_write_json(hidden_states / OUTAGES_JSON, known)
    return known


def render_outages(outages: Sequence[Mapping[str, Any]]) -> str:
    """report.md sections for the outages no play saw end, the servers found down and the scoring replica's
    time out of the router; empty when there were none."""
    guarded = [o for o in outages if o.get("kind", "guard") == "guard"]
    found = [o for o in outages if o.get("kind") == "found_down"]
    scoring = [o for o in outages if o.get("kind") == "scoring_replica"]
    lines = []
    if scoring:
        lines += ["", "## Scoring replica out of the router", ""]
        lines += [
            f"- {o.get('server') or 'the scoring replica'} was out of the router from {o['down_at']} to "
            f"{o.get('ready_at') or '?'} ("
            + (f"{o['downtime_s']:.1f} s" if o.get("downtime_s") is not None else "?")
            + f"): {o['cause']}"
            + (f"; the scoring failed: {o['msg']}" if o.get("failed") else "")
            for o in scoring
        ]
    if found:
        lines += ["", "## Servers found down", ""]
        lines += [
            f"- {o.get('server') or 'the server'} was not running when this run reached it ({o['cause']}); "
            f"started, answering at {o.get('ready_at') or '?'}. A first start on this host reads the same; "
            f"otherwise it died or was stopped outside any window, when is not known."
            for o in found
        ]
    if guarded:
        lines += ["", "## Outages the guard ended", ""]
    for outage in guarded:
        span = (
            f"{outage['downtime_s']:.1f} s"
            if outage.get("downtime_s") is not None
            else "not answering when the guard's time ran out"
        )
        lines.append(
            f"- {outage.get('server') or 'the server'} down from {outage['down_at']} to "
            f"{outage.get('ready_at') or '?'} ({span}), in the window of "
            f"{outage.get('owner') or 'an earlier run'}: {outage['cause']}"
            + (f"; it failed: {outage['msg']}" if outage.get("failed") else "")
        )
    return "\n".join(lines) + "\n" if lines else ""


def render_markdown(window: Mapping[str, Any] | None) -> str:
    """A report.md section; empty when no window was recorded."""
    if not window:
        return ""
    lines = ["", "## Service window", ""]
    taken = "released (memory saver)" if window["mode"] == "memory_saver" else "stopped"
    share = window.get("compute_share")
    compute = (
        "extraction compute not recorded"
        if window.get("compute_s") is None
        else f"extraction compute {window['compute_s']:.1f} s ({share:.0%}), everything else "
        f"{window['other_s']:.1f} s"
    )
    # A resume's end is read with one generated token; a start's with SGLang's health check.
    resumed = window["mode"] == "memory_saver" and not window.get("started_instead")
    ready = "a 1-token /generate 200" if resumed else "/health_generate 200"
    lines.append(
        f"The service was {taken} for **{window['downtime_s']:.1f} s** ({window['down_at']} to "
        f"{window['ready_at']}, ready = {ready}): {compute}."
    )
    if window.get("measured_by") == "service" and window.get("play_span_s") is not None:
        lines += [
            "",
            f"The play's own span, from the start of its stop stage to ready: {window['play_span_s']:.1f} s "
            "(the stop's set-up and the guard are armed before the service goes down).",
        ]
    plan = window.get("memory_plan") or {}
    if plan:
        kept = (
            "the weights stayed on the GPU"
            if plan["choice"] == "kv_cache"
            else "the weights went to host memory"
        )
        tags = ", ".join(plan.get("tags") or []) or "every tag"
        release = window.get("release_s")
        took = f", pause + release {release:.2f} s" if release is not None else ""
        lines += ["", f"Released: {tags} ({kept}{took}). Why: {plan.get('reason')}."]
    accounted = window.get("accounted") or {}
    if accounted:
        named = ", ".join(
            f"{key[:-2].replace('_', ' ')} {value:.2f} s"
            for key, value in accounted.items()
            if key != "unexplained_s"
        )
        lines += ["", f"Where the downtime went: {named}; unexplained {accounted['unexplained_s']:.2f} s."]
    if window.get("resumed_by"):
        lines += ["", f"Resumed by the {window['resumed_by']}: the play's own tasks were not waited for."]
    if window.get("started_instead"):
        lines += [
            "",
            "The server was gone when its memory was to be resumed (its process died inside the window): "
            "a new server was started instead, loading its weights from disk.",
        ]
    if (window.get("weights_check") or {}).get("restarted"):
        lines += [
            "",
            "The weights came back from the window with another checksum (/weights_checker): the server was "
            "restarted to load them from disk.",
        ]
    follows = window.get("follows") or {}
    if follows:
        why = (
            "this run did the same work again (taking it over was turned off: specops_reuse_extractions)"
            if follows.get("same_work")
            else f"that work was not this one ({', '.join(follows.get('differs') or ['other inputs'])} "
            "differ), so its output could not be taken over"
        )
        other = follows.get("owner") or follows.get("out_dir")
        lines += [
            "",
            f"The service was taken down a second time: {other} took it down for its extraction "
            f"{follows.get('ago_s') or 0:.0f} s before this window, and {why}.",
        ]
    if window.get("server_start_s") is not None:
        start = window["server_start_s"]
        lines += ["", f"Of that, the server's own start (launch to the first 200): {start:.1f} s."]
    lines += ["", "| stage | s |", "| --- | ---: |"]
    lines += [f"| {s['stage']} | {s['s']:.1f} |" for s in window["stages"]]
    extraction = window.get("extraction") or {}
    prestart = extraction.get("prestart") or {}
    if extraction.get("around_s") is not None:
        load = (
            f"weights host -> device {extraction['load_s'] or 0:.1f} s"
            if prestart
            else f"model load {extraction['load_s'] or 0:.1f} s"
        )
        lines += [
            "",
            f"Inside `extract`: {load}, the extraction's loop {extraction['loop_s']:.1f} s "
            f"(of which the writers' tail {extraction.get('write_tail_s') or 0:.1f} s), process and "
            f"polling around them {extraction['around_s']:.1f} s.",
        ]
    if prestart:
        lines += [
            "",
            "The extraction started before the window and waited for it: process start, imports "
            f"and inputs {prestart.get('before_load_s') or 0:.1f} s, weights into host memory "
            f"{prestart.get('host_load_s') or 0:.1f} s, waiting {prestart.get('waited_s') or 0:.1f} s.",
        ]
    prepared = window.get("prepared") or {}
    weights, kernels = prepared.get("read_weights") or {}, prepared.get("tune_kernels") or {}
    if prepared:
        done = [
            f"weights read in {weights['s']:.1f} s"
            if weights.get("done")
            else f"weights not read ({weights.get('reason', 'off')})",
            f"kernels tuned in {kernels['s']:.1f} s for {len(kernels['shapes'])} batch shapes"
            if kernels.get("done")
            else f"kernels not tuned ({kernels.get('reason', 'off')})",
        ]
        lines += ["", f"Before the window, while the service served: {'; '.join(done)}."]
    return "\n".join(lines) + "\n"


def _request(request: Mapping[str, Any]) -> tuple[list, str, Path]:
    allowed = {
        "marks",
        "mode",
        "hidden_states",
        "prepared",
        "service",
        "outages",
        "follows",
        "extraction_state",
    }
    unknown = set(request) - allowed
    if unknown:
        raise StageError(f"unknown request keys {sorted(unknown)}: allowed are {', '.join(sorted(allowed))}")
    if not request.get("hidden_states"):
        raise StageError("'hidden_states' is required: the extraction's output directory")
    marks = list(request.get("marks") or [])
    return marks, str(request.get("mode") or "stop"), Path(request["hidden_states"])


def _window_of(request: Mapping[str, Any], marks: list, mode: str, hidden_states: Path) -> dict[str, Any]:
    return build_window(
        marks,
        mode,
        load_manifest(hidden_states),
        request.get("prepared"),
        request.get("service"),
        request.get("follows"),
        finished_at(request.get("extraction_state")),
    )


def finished_at(state_file: Any) -> float | None:
    """When the extraction started ahead said finished (its state file), None where it did not."""
    if not state_file:
        return None
    try:
        state = json.loads(Path(state_file).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(state, dict) or state.get("state") != "finished":
        return None
    return _moment(state.get("finished_at"))


def plan(request: dict[str, Any]) -> dict[str, Any]:
    marks, mode, hidden_states = _request(request)
    window = _window_of(request, marks, mode, hidden_states)
    return {"changed": True, "window": window}


def run(request: dict[str, Any]) -> dict[str, Any]:
    marks, mode, hidden_states = _request(request)
    if not marks and "outages" in request:
        outages = record_outages(hidden_states, list(request["outages"] or []))
        return {"changed": True, "outages": outages, "path": str(hidden_states / OUTAGES_JSON)}
    window = _window_of(request, marks, mode, hidden_states)
    if not hidden_states.is_dir():
        # The extraction failed before writing anything: publish the window, create no output for it.
        return {"changed": False, "window": window, "path": None}
    atomic_write_json(hidden_states / WINDOW_JSON, window)
    return {"changed": True, "window": window, "path": str(hidden_states / WINDOW_JSON)}


def main(argv: list[str] | None = None) -> int:
    return serve("window", plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
