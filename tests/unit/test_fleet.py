"""specops.fleet: the prompt split covers every prompt once; the merged report is exactly the report
of one scorer over every host's steps."""

from __future__ import annotations

import io
import json

import pytest

from specops import report as rep
from specops.fleet import main, merge_reports, render_markdown, share, split
from specops.stage import StageError

BLOCK = 4


def host_report(sequences, reference=None):
    drafter = {"block_size": BLOCK, "sequences": sequences}
    ref = {"block_size": BLOCK, "sequences": reference} if reference else None
    return rep.build_report({}, drafter, ref, {}, [], None)


def test_shares_of_all_hosts_cover_every_prompt_exactly_once():
    lines = [f'{{"id": "p{k}"}}' for k in range(11)]
    shares = [share(lines, index, 3) for index in range(3)]
    assert sorted(line for s in shares for line in s) == sorted(lines)
    assert [len(s) for s in shares] == [4, 4, 3]


def test_split_writes_the_share_and_reports_no_change_on_a_rerun(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"id": "p{k}", "prompt": "x"}}\n' for k in range(5)))
    request = {"prompts": str(prompts), "out": str(tmp_path / "run" / "share.jsonl"), "index": 1, "count": 2}
    first = split(request)
    assert first["changed"] and first["n_prompts"] == 2
    written = (tmp_path / "run" / "share.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in written] == ["p1", "p3"]
    assert split(request)["changed"] is False


def test_split_refuses_a_fleet_larger_than_the_prompt_set(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a"}\n{"id": "b"}\n')
    with pytest.raises(StageError, match="too few for 3 hosts"):
        split({"prompts": str(prompts), "out": str(tmp_path / "s.jsonl"), "index": 2, "count": 3})


def test_merged_tau_equals_tau_over_every_hosts_steps():
    a = [{"id": "p0", "accept_lengths": [1, 2, 4]}, {"id": "p2", "accept_lengths": [3]}]
    b = [{"id": "p1", "accept_lengths": [1, 1, 1, 1, 2]}]
    fleet = merge_reports(
        [{"host": "h1", "report": host_report(a, a)}, {"host": "h2", "report": host_report(b, a)}]
    )
    whole = rep.summarize(a + b, BLOCK)
    assert {key: value for key, value in fleet["overall"].items() if key != "interval"} == whole
    assert fleet["overall"]["tau"] == pytest.approx(16 / 9)
    assert [row["id"] for row in fleet["per_prompt"]] == ["p0", "p2", "p1"]
    assert [row["host"] for row in fleet["per_prompt"]] == ["h1", "h1", "h2"]


def test_the_merged_interval_and_paired_comparison_resample_the_prompts_of_every_host():
    a = [{"id": f"p{k}", "accept_lengths": [1, 2, 1 + k % 3]} for k in range(4)]
    b = [{"id": f"q{k}", "accept_lengths": [1, 1, 2 + k % 2]} for k in range(3)]
    reference = [{"id": s["id"], "accept_lengths": [4, 4]} for s in a + b]
    fleet = merge_reports(
        [
            {"host": "h1", "report": host_report(a, reference[:4])},
            {"host": "h2", "report": host_report(b, reference[4:])},
        ]
    )
    whole = rep.build_report(
        {}, {"block_size": BLOCK, "sequences": a + b}, {"block_size": BLOCK, "sequences": reference}
    )
    assert fleet["overall"]["interval"] == whole["overall"]["interval"] is not None
    assert fleet["vs_reference"]["n_prompts"] == 7 and fleet["vs_reference"]["verdict"] == "worse"
    assert rep.verdict(fleet).endswith(": worse")


def test_merged_report_sums_the_per_host_windows_with_both_downtimes_named_apart():
    seq = [{"id": "p", "accept_lengths": [2]}]
    # The host's window record: the service's own downtime, on the host's clock.
    recorded = {**host_report(seq), "window": {"downtime_s": 4.5}}
    fleet = merge_reports(
        [
            {"host": "h1", "report": recorded, "window": {"window_s": 10.0, "play_downtime_s": 6.0}},
            {"host": "h2", "report": host_report(seq), "window": {"window_s": 12.5, "play_downtime_s": 7.0}},
            {"host": "h3", "report": recorded, "window": {}},  # nothing to extract: no window this run
        ],
        {"wall_s": 30.0},
    )
    assert fleet["fleet"]["sum_window_s"] == 22.5
    assert fleet["fleet"]["sum_play_downtime_s"] == 13.0
    assert fleet["fleet"]["sum_service_downtime_s"] == 4.5
    assert "sum_downtime_s" not in fleet["fleet"]
    assert fleet["fleet"]["wall_s"] == 30.0
    assert [row["window"] for row in fleet["per_host"]] == [
        {"window_s": 10.0, "play_downtime_s": 6.0, "service_downtime_s": 4.5},
        {"window_s": 12.5, "play_downtime_s": 7.0, "service_downtime_s": None},
        {},
    ]
    table = render_markdown(fleet)
    assert "| service down s (host) | down s (play) |" in table
    assert "| 10.0 | 4.5 | 6.0 | no |" in table


def test_a_server_found_down_is_named_in_the_fleet_report_and_its_warnings():
    seq = [{"id": "p", "accept_lengths": [2]}]
    fleet = merge_reports(
        [
            {"host": "h1", "report": host_report(seq), "window": {}},
            {
                "host": "h2",
                "report": host_report(seq),
                "window": {},
                "found_down": {"stage": "serve", "pid": 42},
            },
        ]
    )
    assert fleet["fleet"]["found_down"] == ["h2"]
    assert [row["found_down"] for row in fleet["per_host"]] == [None, {"stage": "serve", "pid": 42}]
    assert fleet["warnings"][0].startswith("h2: its server was not running when the rollout reached it")
    assert "started it again (pid 42)" in fleet["warnings"][0]
    text = render_markdown(fleet)
    assert "| h2 |" in text and "| yes | 0 |" in text and "h2: its server was not running" in text


def test_merge_names_the_host_whose_report_is_missing(tmp_path, capsys, monkeypatch):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "h1.json").write_text(json.dumps(host_report([{"id": "p", "accept_lengths": [2]}])))
    request = {"hosts": ["h1", "h2"], "shards_dir": str(shards), "out_dir": str(tmp_path / "fleet")}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(request)))
    assert main(["merge"]) == 2
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["failed"] and "host h2's report" in result["msg"]


def test_merge_writes_one_report_and_a_rerun_without_windows_changes_nothing(tmp_path, capsys, monkeypatch):
    shards = tmp_path / "shards"
    shards.mkdir()
    for host, ids in (("h1", ["p0"]), ("h2", ["p1"])):
        sequences = [{"id": i, "accept_lengths": [2, 1]} for i in ids]
        (shards / f"{host}.json").write_text(json.dumps(host_report(sequences)))
    request = {
        "hosts": ["h1", "h2"],
        "shards_dir": str(shards),
        "out_dir": str(tmp_path / "fleet"),
        "windows": {"h1": {"window_s": 3.0}, "h2": {"window_s": 4.0}},
    }
    # The first run found h1's server down and started it; the rerun finds nothing: the scores are the
    # same, so the report is too.
    found = {"h1": {"stage": "serve", "pid": 4242}}
    for expected_change, windows, found_down in ((True, request["windows"], found), (False, {}, {})):
        merged = {**request, "windows": windows, "found_down": found_down}
        monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(merged)))
        assert main(["merge"]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["changed"] is expected_change
    saved = json.loads((tmp_path / "fleet" / "report.json").read_text())
    assert saved["fleet"]["sum_window_s"] == 7.0 and result["n_prompts"] == 2
    assert "h1" in (tmp_path / "fleet" / "report.md").read_text()
