"""Divide an evaluation across a fleet of hosts and merge their shards into one report.

`split`: host i of n keeps the prompts at positions i, i+n, i+2n ... of the prompt set, so every
prompt is evaluated exactly once and each host prefetches and extracts only its share.
`merge`: each host scored its own share; the fleet's figures are pooled over verify steps (tau =
accepted tokens / steps), so the merged tau is exactly the tau of one scorer over every prompt.

python -m specops.fleet split|merge --request FILE (or JSON on stdin); the last line of stdout is
one JSON object, as in the stage protocol (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specops import report as rep
from specops.manifest import atomic_write_json, atomic_write_text
from specops.stage import StageError, log, read_request, respond

FLEET_REPORT_JSON = "report.json"
FLEET_REPORT_MD = "report.md"


# -- split ---------------------------------------------------------------------------------------
def share(lines: Sequence[str], index: int, count: int) -> list[str]:
    """The prompts host `index` of `count` evaluates: every count-th one, starting at index."""
    if count < 1 or not 0 <= index < count:
        raise StageError(f"host index {index} is outside a fleet of {count} host(s)")
    return [line for position, line in enumerate(lines) if position % count == index]


def split(request: Mapping[str, Any]) -> dict[str, Any]:
    prompts = Path(str(request.get("prompts") or ""))
    out = Path(str(request.get("out") or ""))
    index, count = int(request.get("index", 0)), int(request.get("count", 1))
    if not prompts.is_file():
        raise StageError(f"prompt set {prompts} does not exist: set specops_prompts to a JSONL file")
    lines = [line for line in prompts.read_text().splitlines() if line.strip()]
    mine = share(lines, index, count)
    if not mine:
        raise StageError(
            f"{prompts} holds {len(lines)} prompt(s), too few for {count} hosts: "
            f"host {index} would get none; evaluate on fewer hosts or add prompts"
        )
    text = "\n".join(mine) + "\n"
    changed = not out.is_file() or out.read_text() != text
    if changed and not request.get("check_mode"):
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, text)
    return {"changed": changed, "out": str(out), "n_prompts": len(mine), "n_total": len(lines)}


# -- merge ---------------------------------------------------------------------------------------
def pooled(summaries: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """One drafter's summary over every host: the histograms add up; tau and the acceptance by
    position follow from the pooled histogram exactly (report.summarize on the same steps)."""
    present = [s for s in summaries if s]
    if not present:
        return None
    block_size = max(int(s["block_size"]) for s in present)
    counts = [0] * block_size
    for summary in present:
        for length, count in zip(summary["histogram"]["length"], summary["histogram"]["count"], strict=True):
            counts[int(length) - 1] += int(count)
    lengths = [length for length, count in enumerate(counts, start=1) for _ in range(count)]
    return rep.summarize([{"accept_lengths": lengths}], block_size)


def merged_online(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    onlines = [r["online"] for r in reports if r.get("online")]
    if not onlines:
        return None
    steps = sum(o["steps"] for o in onlines)
    tokens = sum(o["tokens"] for o in onlines)
    return {
        "tau": tokens / steps if steps else None,
        "steps": steps,
        "tokens": tokens,
        "n_prompts": sum(o["n_prompts"] for o in onlines),
    }


def found_down_warning(host: str, found: Mapping[str, Any]) -> str:
    return (
        f"{host}: its server was not running when the rollout reached it (it died, or was stopped outside "
        f"the run): the {found.get('stage') or 'serve'} stage started it again (pid {found.get('pid')}); "
        "any request it held when it went down was lost"
    )


def host_window(control_node: Mapping[str, Any], report: Mapping[str, Any]) -> dict[str, Any]:
    """This run's window of a host, both downtimes named apart: play_downtime_s (the control node's
    clock, from the drain's end to the service answering) and service_downtime_s (the host's clock,
    the window record's downtime: the server's stop or pause to its first /health_generate 200)."""
    if not control_node:
        return {}
    record = report.get("window") or {}
    return {**control_node, "service_downtime_s": record.get("downtime_s")}


def merge_reports(
    hosts: Sequence[Mapping[str, Any]], rollout: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """hosts: [{"host", "report": <a host's report.json>, "window": {...}, "found_down": {...}}] -> the
    fleet's report; found_down (stage, pid) names a server the run found not running and started."""
    if not hosts:
        raise StageError("no host shard to merge: the fleet run scored nothing")
    reports = [h["report"] for h in hosts]
    overall = pooled([r["overall"] for r in reports])
    reference = pooled([r.get("reference") for r in reports])
    per_prompt = [{"host": h["host"], **row} for h in hosts for row in h["report"]["per_prompt"]]
    # The interval and the paired comparison resample the prompts of every host together.
    counts = {f"{row['host']}/{row['id']}": (row["tokens"], row["steps"]) for row in per_prompt}
    reference_counts = {
        f"{row['host']}/{row['id']}": (row["tokens"], row["reference_steps"])
        for row in per_prompt
        if row.get("reference_steps") is not None
    }
    if overall:
        overall["interval"] = rep.tau_interval(counts)
    if reference:
        reference["interval"] = rep.tau_interval(reference_counts)
    vs_reference = (
        rep.paired(counts, reference_counts, ("drafter", "reference")) if reference_counts else None
    )
    per_host = []
    for h in hosts:
        r = h["report"]
        per_host.append(
            {
                "host": h["host"],
                "n_prompts": len(r["per_prompt"]),
                "tau": r["overall"]["tau"],
                "steps": r["overall"]["steps"],
                "reference_tau": (r.get("reference") or {}).get("tau"),
                "online_tau": (r.get("online") or {}).get("tau"),
                "warnings": list(r.get("warnings") or []),
                "window": host_window(h.get("window") or {}, r),
                "found_down": dict(h["found_down"]) if h.get("found_down") else None,
            }
        )
    diagnostics = []
    for h in hosts:
        for finding in h["report"].get("diagnostics") or []:
            diagnostics.append({**finding, "name": f"{finding['name']}@{h['host']}"})
    windows = [row["window"] for row in per_host if row["window"].get("window_s") is not None]
    return {
        "schema_version": rep.SCHEMA_VERSION,
        "fleet": {
            "hosts": [h["host"] for h in hosts],
            "n_hosts": len(hosts),
            "sum_window_s": round(sum(w["window_s"] for w in windows), 3) if windows else None,
            "sum_play_downtime_s": round(sum(w.get("play_downtime_s") or 0 for w in windows), 3)
            if windows
            else None,
            "sum_service_downtime_s": round(sum(w.get("service_downtime_s") or 0 for w in windows), 3)
            if windows
            else None,
            "found_down": [row["host"] for row in per_host if row["found_down"]],
            **dict(rollout or {}),
        },
        "overall": overall,
        "reference": reference,
        "ratio": rep.ratio(overall["tau"] if overall else None, reference["tau"] if reference else None),
        "vs_reference": vs_reference,
        "online": merged_online(reports),
        "per_host": per_host,
        "per_prompt": per_prompt,
        "diagnostics": diagnostics,
        "warnings": [
            *[found_down_warning(h["host"], h["found_down"]) for h in hosts if h.get("found_down")],
            *[f"{h['host']}: {w}" for h in hosts for w in h["report"].get("warnings") or []],
        ],
    }


def _fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def render_markdown(fleet: Mapping[str, Any]) -> str:
    info = fleet["fleet"]
    lines = [
        f"# Fleet evaluation: {rep.verdict(fleet)}",
        "",
        f"{info['n_hosts']} host(s), {len(fleet['per_prompt'])} prompt(s) split across them.",
        "",
    ]
    if info.get("wall_s") is not None:
        lines += [
            f"Rollout wall time {_fmt(info['wall_s'], 1)} s; sum of the per-host windows "
            f"{_fmt(info.get('sum_window_s'), 1)} s "
            f"(service down {_fmt(info.get('sum_service_downtime_s'), 1)} s in all by the hosts' clocks, "
            f"server stop to ready; {_fmt(info.get('sum_play_downtime_s'), 1)} s as the play saw it, "
            "drained to answering).",
            "",
        ]
    lines += [
        "| host | prompts | tau | reference tau | online tau | out of the router s "
        "| service down s (host) | down s (play) | found down | warnings |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in fleet["per_host"]:
        window = row["window"]
        lines.append(
            f"| {row['host']} | {row['n_prompts']} | {_fmt(row['tau'])} "
            f"| {_fmt(row['reference_tau'])} "
            f"| {_fmt(row['online_tau'])} | {_fmt(window.get('window_s'), 1)} "
            f"| {_fmt(window.get('service_downtime_s'), 1)} | {_fmt(window.get('play_downtime_s'), 1)} "
            f"| {'yes' if row.get('found_down') else 'no'} | {len(row['warnings'])} |"
        )
    lines += ["", "| prompt | host | tau | reference tau | ratio |", "| --- | --- | --- | --- | --- |"]
    for row in fleet["per_prompt"]:
        lines.append(
            f"| {row['id']} | {row['host']} | {_fmt(row['tau'])} | {_fmt(row.get('reference_tau'))} "
            f"| {_fmt(row.get('ratio'))} |"
        )
    if fleet["warnings"]:
        lines += ["", "Warnings:", *[f"- {w}" for w in fleet["warnings"]]]
    return "\n".join(lines) + "\n"


SCORED_KEYS = (
    "overall",
    "reference",
    "ratio",
    "vs_reference",
    "online",
    "per_prompt",
    "diagnostics",
    "warnings",
)


def scored_part(fleet: Mapping[str, Any]) -> dict[str, Any]:
    """What the hosts' scores decide, without the rollout's timings and without what the rollout found
    (a server found down is that run's news, not the scores')."""
    found = {f"{row['host']}: its server was not running" for row in fleet.get("per_host") or []}
    part = {key: fleet.get(key) for key in SCORED_KEYS}
    part["warnings"] = [w for w in part.get("warnings") or [] if not any(w.startswith(f) for f in found)]
    return part


def merge(request: Mapping[str, Any]) -> dict[str, Any]:
    """{"hosts": [name], "shards_dir": dir of <host>.json reports, "windows": {host: figures},
    "found_down": {host: {"stage", "pid"}}, "rollout": {...}, "out_dir"} -> the fleet's report.json
    and report.md in out_dir."""
    out_dir = Path(str(request.get("out_dir") or ""))
    shards_dir = Path(str(request.get("shards_dir") or ""))
    if not request.get("out_dir") or not request.get("shards_dir"):
        raise StageError(
            "out_dir and shards_dir are required: where the fleet report goes, where the hosts' reports are"
        )
    windows = request.get("windows") or {}
    found_down = request.get("found_down") or {}
    hosts = []
    for host in request.get("hosts") or []:
        path = shards_dir / f"{host}.json"
        if not path.is_file():
            raise StageError(
                f"host {host}'s report {path} does not exist: its scoring did not run; "
                "rerun the evaluation for that host"
            )
        hosts.append(
            {
                "host": host,
                "report": json.loads(path.read_text()),
                "window": windows.get(host) or {},
                "found_down": found_down.get(host),
            }
        )
    fleet = merge_reports(hosts, request.get("rollout") or {})
    figures = {
        "tau": fleet["overall"]["tau"],
        "tau_interval": fleet["overall"].get("interval"),
        "reference_tau": (fleet["reference"] or {}).get("tau"),
        "reference_tau_interval": (fleet["reference"] or {}).get("interval"),
        "ratio": fleet["ratio"],
        "vs_reference": fleet["vs_reference"],
        "online_tau": (fleet["online"] or {}).get("tau"),
        "n_prompts": len(fleet["per_prompt"]),
        "n_hosts": len(hosts),
        "verdict": rep.verdict(fleet),
        "warnings": fleet["warnings"],
        "wall_s": fleet["fleet"].get("wall_s"),
        "sum_window_s": fleet["fleet"]["sum_window_s"],
        "found_down": fleet["fleet"]["found_down"],
        "per_host": [{"host": r["host"], "tau": r["tau"], **r["window"]} for r in fleet["per_host"]],
        "report": str(out_dir / FLEET_REPORT_MD),
        "report_md": str(out_dir / FLEET_REPORT_MD),
        "report_json": str(out_dir / FLEET_REPORT_JSON),
    }
    path = out_dir / FLEET_REPORT_JSON
    before = json.loads(path.read_text()) if path.is_file() else None
    # A run with windows has new timings to record; one without (nothing to extract) changes
    # the report only if a host's scores changed.
    had_windows = any(h["window"] for h in hosts)
    now = scored_part(json.loads(json.dumps(fleet)))
    changed = before is None or had_windows or scored_part(before) != now
    if changed and not request.get("check_mode"):
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / FLEET_REPORT_MD, render_markdown(fleet))
        atomic_write_json(path, fleet)
        log(f"fleet: {figures['verdict']}; report in {out_dir / FLEET_REPORT_MD}")
    return {"changed": changed, **figures}


COMMANDS = {"split": split, "merge": merge}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specops.fleet", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--request", default="-", help="JSON request file, - for stdin")
    args = parser.parse_args(argv)
    return respond(f"fleet {args.command}", lambda: COMMANDS[args.command](read_request(args.request)))


if __name__ == "__main__":
    raise SystemExit(main())
