"""The service window's record: downtime, time per stage, extraction compute against the rest."""

import json

import pytest

from specops import window
from specops.stage import StageError

MARKS = [
    ["stop-server", 100.0],
    ["release-gpus", 104.0],
    ["verify-environment", 105.0],
    ["extract", 107.0],
    ["start-server", 127.0],
    ["ready", 190.0],
]
MANIFEST = {
    "progress": {"device_busy_s": 2.2, "forward_s": 2.4, "load_s": 6.0, "total_s": 3.0, "tokens": 1720},
    "backend": {"gated_delta_rule": "fla"},
}


def test_downtime_runs_from_the_first_stage_to_ready():
    record = window.build_window(MARKS, "stop", MANIFEST)
    assert record["downtime_s"] == 90.0
    assert record["down_at"] == "1970-01-01T00:01:40.000Z"


def test_the_services_own_moments_give_the_downtime_and_the_play_span_is_kept():
    service = {"down_at": 102.5, "ready_at": 189.25, "start_s": 58.5}
    record = window.build_window(MARKS, "stop", MANIFEST, service=service)
    assert record["downtime_s"] == 86.75
    assert record["server_start_s"] == 58.5
    assert record["measured_by"] == "service"
    assert record["play_span_s"] == 90.0
    assert (record["down_at"], record["ready_at"]) == ("1970-01-01T00:01:42.500Z", "1970-01-01T00:03:09.250Z")
    assert record["other_s"] == 84.55
    assert "play's own span" in window.render_markdown(record)
    assert "server's own start (launch to the first 200): 58.5 s" in window.render_markdown(record)


def test_a_server_started_instead_of_resumed_is_recorded_and_said():
    service = {"down_at": 102.5, "ready_at": 189.25, "start_s": 58.5, "started_instead": True}
    record = window.build_window(MARKS, "memory_saver", MANIFEST, service=service)
    assert record["started_instead"] is True
    assert "a new server was started instead" in window.render_markdown(record)
    resumed = {"down_at": 102.5, "ready_at": 189.25}
    kept = window.build_window(MARKS, "memory_saver", MANIFEST, service=resumed)
    assert kept["started_instead"] is False
    assert "started instead" not in window.render_markdown(kept)
    # What "ready" was: a resume's end is read with one generated token, a start's with the health check.
    assert "ready = a 1-token /generate 200" in window.render_markdown(kept)
    assert "ready = /health_generate 200" in window.render_markdown(record)
    stopped = window.build_window(MARKS, "stop", MANIFEST, service=resumed)
    assert "ready = /health_generate 200" in window.render_markdown(stopped)


def test_weights_restarted_after_a_checksum_mismatch_are_recorded_and_said():
    check = {"before": "a1", "after": "b2", "matched": False, "restarted": True, "after_restart": "a1"}
    service = {"down_at": 102.5, "ready_at": 189.25, "weights_check": check}
    record = window.build_window(MARKS, "memory_saver", MANIFEST, service=service)
    assert record["weights_check"] == check
    assert "restarted to load them from disk" in window.render_markdown(record)
    resumed = {"down_at": 102.5, "ready_at": 189.25}
    kept = window.build_window(MARKS, "memory_saver", MANIFEST, service=resumed)
    assert kept["weights_check"] is None and "checksum" not in window.render_markdown(kept)


def test_without_both_service_moments_the_play_marks_give_the_downtime():
    record = window.build_window(MARKS, "stop", MANIFEST, service={"down_at": 102.5, "ready_at": None})
    assert (record["downtime_s"], record["measured_by"]) == (90.0, "play")


def test_service_moments_out_of_order_are_refused():
    with pytest.raises(StageError, match="one host's clock"):
        window.build_window(MARKS, "stop", MANIFEST, service={"down_at": 200.0, "ready_at": 150.0})


def test_each_stage_lasts_until_the_next_mark():
    record = window.build_window(MARKS, "stop", MANIFEST)
    assert record["stages"] == [
        {"stage": "stop-server", "s": 4.0},
        {"stage": "release-gpus", "s": 1.0},
        {"stage": "verify-environment", "s": 2.0},
        {"stage": "extract", "s": 20.0},
        {"stage": "start-server", "s": 63.0},
    ]


def test_compute_is_the_device_time_and_the_rest_is_other():
    record = window.build_window(MARKS, "memory_saver", MANIFEST)
    assert (record["compute_s"], record["other_s"]) == (2.2, 87.8)
    assert record["extraction"]["compute_measured_on"] == "device"


def test_compute_falls_back_to_the_host_timed_forwards_on_the_cpu():
    progress = {k: v for k, v in MANIFEST["progress"].items() if k != "device_busy_s"}
    record = window.build_window(MARKS, "stop", {"progress": progress})
    assert record["compute_s"] == 2.4
    assert record["extraction"]["compute_measured_on"] == "host"


def test_extract_stage_time_outside_load_and_loop_is_reported():
    record = window.build_window(MARKS, "stop", MANIFEST)
    assert record["extraction"]["around_s"] == 11.0


def test_marks_must_end_when_the_service_is_ready():
    with pytest.raises(StageError, match="must end with 'ready'"):
        window.build_window(MARKS[:-1], "stop", MANIFEST)


def test_marks_out_of_order_are_refused():
    with pytest.raises(StageError, match="comes before"):
        window.build_window([["stop-server", 10.0], ["ready", 9.0]], "stop", MANIFEST)


def test_run_writes_window_json_beside_the_hidden_states(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(MANIFEST))
    result = window.run({"marks": MARKS, "mode": "stop", "hidden_states": str(tmp_path)})
    assert window.read_window(tmp_path) == result["window"]


def test_markdown_section_names_downtime_and_compute():
    text = window.render_markdown(window.build_window(MARKS, "stop", MANIFEST))
    assert "## Service window" in text
    assert "**90.0 s**" in text and "extraction compute 2.2 s (2%)" in text
    assert "| start-server | 63.0 |" in text


def test_no_window_renders_nothing():
    assert window.render_markdown(None) == ""


def test_what_was_prepared_before_the_window_is_recorded_beside_it():
    prepared = {
        "read_weights": {"done": True, "s": 1.5},
        "tune_kernels": {"done": True, "s": 40.0, "shapes": [{"s": 40.0}]},
    }
    record = window.build_window(MARKS, "stop", MANIFEST, prepared)
    assert record["prepared"] == prepared and record["downtime_s"] == 90.0
    assert "kernels tuned in 40.0 s for 1 batch shapes" in window.render_markdown(record)


def test_without_an_extraction_directory_the_window_is_returned_and_nothing_is_created(tmp_path):
    result = window.run({"marks": MARKS, "mode": "stop", "hidden_states": str(tmp_path / "missing")})
    assert result["window"]["downtime_s"] == 90.0 and result["path"] is None
    assert not (tmp_path / "missing").exists()


PRESTART = {"before_load_s": 14.5, "host_load_s": 3.25, "waited_s": 40.0, "to_device_s": 0.75}


def test_a_prestarted_extraction_records_what_it_did_before_the_window_and_after_go():
    progress = {**MANIFEST["progress"], "load_s": 0.75, "finish_s": 0.5, "prestart": PRESTART}
    record = window.build_window(MARKS, "stop", {**MANIFEST, "progress": progress})
    assert record["extraction"]["prestart"] == PRESTART
    assert (record["extraction"]["load_s"], record["extraction"]["write_tail_s"]) == (0.75, 0.5)
    text = window.render_markdown(record)
    assert "weights host -> device 0.8 s" in text and "the writers' tail 0.5 s" in text
    assert "process start, imports and inputs 14.5 s, weights into host memory 3.2 s, waiting 40.0 s" in text


def test_every_second_of_a_memory_saver_window_is_accounted_for():
    manifest = {
        "progress": {
            "device_busy_s": 2.0,
            "total_s": 2.2,
            "load_s": 0.5,
            "loop_ended_at": 1013.9,
            "prestart": {"go_seen_at": 1010.7, "setup_s": 0.4},
        }
    }
    service = {
        "down_at": 1000.0,
        "released_at": 1010.5,
        "go_at": 1010.6,
        "resume_called_at": 1014.6,
        "ready_at": 1015.0,
        "memory_plan": {"choice": "kv_cache", "tags": ["kv_cache", "cuda_graph"], "reason": "fits"},
    }
    marks = [["stop-server", 999.0], ["ready", 1015.5]]
    record = window.build_window(marks, "memory_saver", manifest, None, service)
    parts = record["accounted"]
    assert parts == {
        "pause_and_release_s": 10.5,
        "gpu_memory_check_s": 0.1,
        "go_to_extraction_s": 0.1,
        "extraction_setup_s": 0.4,
        "weights_to_device_s": 0.5,
        "extraction_loop_s": 2.3,
        "loop_end_to_resume_s": 0.7,
        "resume_to_ready_s": 0.4,
        "unexplained_s": 0.0,
    }
    assert record["release_s"] == 10.5 and record["memory_plan"]["choice"] == "kv_cache"
    text = window.render_markdown(record)
    assert "Released: kv_cache, cuda_graph (the weights stayed on the GPU, pause + release 10.50 s)" in text
    assert "Where the downtime went: pause and release 10.50 s" in text and "unexplained 0.00 s" in text

    # The extraction said finished (outputs written, device memory given back) before its exit: the span
    # from its loop's end to the resume splits there.
    finished = window.build_window(marks, "memory_saver", manifest, None, service, None, 1014.2)
    split = finished["accounted"]
    assert "loop_end_to_resume_s" not in split and split["unexplained_s"] == 0.0
    assert (split["outputs_and_device_release_s"], split["finished_to_resume_s"]) == (0.3, 0.4)
    assert list(split)[-2:] == ["resume_to_ready_s", "unexplained_s"]

    # The window in one step with the scoring in it: the scoring said finished after the extraction did,
    # and the span splits there too (the scoring a stage of its own).
    scored = window.build_window(
        [["window", 999.0], ["ready", 1015.5]],
        "memory_saver",
        manifest,
        None,
        dict(service, work_finished_at=1014.5, step_stages={"work_s": 3.9}),
        None,
        1014.2,
    )
    parts = scored["accounted"]
    assert (parts["outputs_and_device_release_s"], parts["scoring_s"], parts["finished_to_resume_s"]) == (
        0.3,
        0.3,
        0.1,
    )
    assert parts["unexplained_s"] == 0.0 and scored["step_stages"] == {"work_s": 3.9}


def test_the_extractions_finished_moment_is_read_from_its_state_file(tmp_path):
    state = tmp_path / "extract.start.state"
    assert window.finished_at(str(state)) is None  # not there
    state.write_text(json.dumps({"state": "started", "pid": 1}))
    assert window.finished_at(str(state)) is None
    state.write_text(json.dumps({"state": "finished", "finished_at": 1014.2, "pid": 1}))
    assert window.finished_at(str(state)) == 1014.2 and window.finished_at(None) is None


def test_without_the_extractions_moments_nothing_is_accounted():
    service = {"down_at": 1000.0, "ready_at": 1015.0, "released_at": 1001.0}
    marks = [["stop-server", 999.0], ["ready", 1015.5]]
    record = window.build_window(marks, "memory_saver", None, None, service)
    assert record["accounted"] is None and record["memory_plan"] is None


def test_outages_the_guard_ended_are_recorded_once_and_shown_in_the_report(tmp_path):
    hidden_states = tmp_path / "hidden_states"  # not there yet: a rerun in a fresh run directory
    outage = {
        "server": "sglang-qwen",
        "owner": "/srv/run (eval, control node a)",
        "down_at": 1_700_000_000.0,
        "fired_at": 1_700_000_060.0,
        "ready_at": 1_700_000_070.9,
        "cause": "the guard brought the server back: the window's work is gone",
    }
    for _ in range(2):  # given twice, kept once
        answer = window.run({"hidden_states": str(hidden_states), "outages": [outage]})
    assert answer["changed"] and window.read_outages(hidden_states) == answer["outages"]
    [kept] = answer["outages"]
    assert kept["downtime_s"] == 70.9 and kept["down_at"].startswith("2023-11-14T22:13:20")
    shown = window.render_outages(answer["outages"])
    assert "## Outages the guard ended" in shown and "(70.9 s)" in shown and "/srv/run" in shown
    assert window.render_outages([]) == "" and window.read_outages(tmp_path / "nowhere") == []


def test_a_server_found_down_is_recorded_and_shown_apart_from_the_guards_outages(tmp_path):
    hidden_states = tmp_path / "hidden_states"
    found = {
        "kind": "found_down",
        "server": "sglang-qwen",
        "ready_at": 1_700_000_100.0,
        "cause": "found not running at the serve stage and started as pid 4242",
    }
    [kept] = window.run({"hidden_states": str(hidden_states), "outages": [found]})["outages"]
    assert kept["kind"] == "found_down" and kept["down_at"] is None and kept["downtime_s"] is None
    shown = window.render_outages([kept])
    assert "## Servers found down" in shown and "pid 4242" in shown and "2023-11-14T22:15:00" in shown
    assert "## Outages the guard ended" not in shown


def test_a_scoring_replicas_time_out_of_the_router_is_recorded_and_shown_apart(tmp_path):
    hidden_states = tmp_path / "hidden_states"
    out = {
        "kind": "scoring_replica",
        "server": "replica3",
        "down_at": 1_700_000_000.0,
        "ready_at": 1_700_000_012.5,
        "cause": "out of the router to score replica1's share (its server stopped and started for it)",
    }
    failed = {**out, "down_at": 1_700_000_100.0, "ready_at": 1_700_000_104.0, "failed": True, "msg": "boom"}
    kept = window.run({"hidden_states": str(hidden_states), "outages": [out, failed]})["outages"]
    assert [o["kind"] for o in kept] == ["scoring_replica"] * 2 and kept[0]["downtime_s"] == 12.5
    shown = window.render_outages(kept)
    assert "## Scoring replica out of the router" in shown
    assert "- replica3 was out of the router from 2023-11-14T22:13:20" in shown and "(12.5 s)" in shown
    assert "replica1's share" in shown and "; the scoring failed: boom" in shown
    assert "## Outages the guard ended" not in shown and "## Servers found down" not in shown


def test_a_window_right_after_another_runs_says_so_and_why():
    marks = [["stop-server", 100.0], ["extract", 101.0], ["ready", 110.0]]
    follows = {"owner": "/srv/run-a (eval)", "ago_s": 16.2, "same_work": False, "differs": ["the layers"]}
    record = window.build_window(marks, "stop", None, follows=follows)
    assert record["follows"] == follows
    shown = window.render_markdown(record)
    assert "taken down a second time: /srv/run-a (eval) took it down for its extraction 16 s before" in shown
    assert "the layers differ" in shown
