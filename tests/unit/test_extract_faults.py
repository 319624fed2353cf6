"""The extraction's plan refuses before the GPU window what the run would refuse inside it, and reuses
outputs by content: a damaged file is named and redone, a refetch with the same tokens changes nothing."""

from __future__ import annotations

import errno
import io
import json
import re
import shutil
import types
from pathlib import Path

import pytest

from specops import extract, preflight
from specops.hidden_states import open_hidden_states
from specops.manifest import write_manifest
from specops.stage import StageError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def completions(fixture_models, tmp_path_factory) -> Path:
    """Three records of known token ids, with a completions manifest that records the file's sha256."""
    directory = tmp_path_factory.mktemp("completions")
    write_completions(directory, latency=0.1)
    return directory


def write_completions(directory: Path, latency: float) -> None:
    lines = [
        json.dumps(
            {
                "id": f"p{n}",
                "prompt_ids": list(range(5, 15 + n)),
                "output_ids": [7, 8, 9 + n],
                "meta_info": {"e2e_latency": latency + n, "id": f"rid-{latency}-{n}"},
            }
        )
        for n in range(3)
    ]
    (directory / "completions.jsonl").write_text("\n".join(lines) + "\n")
    write_manifest(directory, "completions", {"prompts": "fixed"}, ["completions.jsonl"])


def request(fixture_models, completions, out_dir, **overrides):
    return {
        "target": str(fixture_models.target),
        "completions": str(completions),
        "out_dir": str(out_dir),
        "drafter": str(fixture_models.drafter),
        "shard_tokens": 20,
        "device": "cpu",
        **overrides,
    }


def drafter_with(fixture_models, tmp_path, **changes) -> Path:
    drafter = tmp_path / "drafter"
    shutil.copytree(fixture_models.drafter, drafter)
    config = json.loads((drafter / "config.json").read_text())
    for key, value in changes.items():
        if key == "mask_token_id":
            config["dflash_config"]["mask_token_id"] = value
        else:
            config[key] = value
    (drafter / "config.json").write_text(json.dumps(config))
    return drafter


@pytest.fixture(scope="module")
def extracted(fixture_models, completions, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("extracted") / "hidden_states"
    extract.run(request(fixture_models, completions, out_dir))
    return out_dir


# ------------------------------------------------------------------ refused by the plan


def test_a_garbled_drafter_config_is_named_not_taken_for_the_request(
    fixture_models, completions, tmp_path, monkeypatch, capsys
):
    drafter = tmp_path / "drafter"
    shutil.copytree(fixture_models.drafter, drafter)
    (drafter / "config.json").write_text('{"dflash_config": {"mask_token_id": 3,')
    monkeypatch.setattr(
        "sys.stdin",
        io.StringIO(json.dumps(request(fixture_models, completions, tmp_path / "out", drafter=str(drafter)))),
    )
    assert extract.main(["--plan"]) == 2
    message = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["msg"]
    assert f"drafter config {drafter / 'config.json'} is not valid JSON" in message
    assert "the request is not JSON" not in message


def test_a_mask_token_outside_the_vocabulary_is_refused_by_the_plan(fixture_models, completions, tmp_path):
    drafter = drafter_with(fixture_models, tmp_path, mask_token_id=400)
    with pytest.raises(
        StageError,
        match=r"drafter/config\.json: the drafter's mask_token_id 400 is out of "
        r"range: the target's embedding has 400 rows",
    ):
        extract.plan(request(fixture_models, completions, tmp_path / "out", drafter=str(drafter)))


def test_a_drafter_for_another_vocabulary_is_refused_by_the_plan(fixture_models, completions, tmp_path):
    drafter = drafter_with(fixture_models, tmp_path, vocab_size=512)
    with pytest.raises(StageError, match=r"vocab_size 512 differs from the target's 400"):
        extract.plan(request(fixture_models, completions, tmp_path / "out", drafter=str(drafter)))


def test_require_fla_without_fla_or_a_gpu_is_refused_by_the_plan(fixture_models, completions, tmp_path):
    with pytest.raises(StageError, match=r"require_backend is fla but .* fla does not import"):
        extract.plan(request(fixture_models, completions, tmp_path / "out", require_backend="fla"))


def test_too_little_disk_is_refused_by_the_plan_with_the_real_figure(
    fixture_models, completions, tmp_path, monkeypatch
):
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=4096))
    planned = None
    needs = r"the hidden states need \d+\.\d\d KiB .*, 4.00 KiB are free"
    with pytest.raises(StageError, match=needs) as error:
        planned = extract.plan(
            request(fixture_models, completions, tmp_path / "not-yet-created", disk_reserve_bytes=0)
        )
    assert planned is None and "0.00 GiB" not in str(error.value)


def test_the_plan_names_every_problem_it_finds_in_one_refusal(
    fixture_models, completions, tmp_path, monkeypatch
):
    # Four problems of three kinds (the drafter's config twice, the backend, the disk): one run names them
    # all, numbered, so the operator fixes everything before the next run.
    drafter = drafter_with(fixture_models, tmp_path, vocab_size=512, mask_token_id=10**6)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=4096))
    with pytest.raises(StageError) as error:
        extract.plan(
            request(
                fixture_models,
                completions,
                tmp_path / "out",
                drafter=str(drafter),
                require_backend="fla",
                disk_reserve_bytes=0,
            )
        )
    message = str(error.value)
    assert message.startswith("4 problems, each to fix: (1) ")
    for number, pattern in enumerate(
        (
            r"vocab_size 512 differs from the target's 400",
            r"the drafter's mask_token_id 1000000 is out of range",
            r"require_backend is fla but",
            r"the hidden states need \d+\.\d\d KiB",
        ),
        1,
    ):
        assert re.search(rf"\({number}\) [^;]*{pattern}", message), (number, message)


def test_the_disk_check_counts_the_files_beside_the_shards_their_blocks_and_a_reserve(tmp_path, monkeypatch):
    # Seen: 3,121,152 B free passed for a 3,098,056 B shard, and the disk filled inside the window.
    shards = 3_098_056
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=3_121_152))
    with pytest.raises(StageError, match=r"in \d+-byte blocks\), 2.98 MiB are free"):
        preflight.check_disk(tmp_path / "out", shards, reserve=0, shards=1)
    # The reserve is kept by default: room for the shards and their files is not enough.
    taken = preflight.on_disk_bytes(shards, 1, preflight.block_bytes(tmp_path))
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=taken))
    assert preflight.check_disk(tmp_path / "out", shards, reserve=0, shards=1) == taken
    with pytest.raises(StageError, match=r"64.00 MiB are to stay free \(disk_reserve_bytes\)"):
        preflight.check_disk(tmp_path / "out", shards, shards=1)


def test_the_disk_estimate_is_the_size_of_the_written_shards(
    fixture_models, completions, extracted, tmp_path
):
    planned = extract.plan(request(fixture_models, completions, tmp_path / "out"))
    written = sum(p.stat().st_size for p in extracted.glob("shard-*.safetensors"))
    assert written <= planned["estimated_bytes"] <= written * 1.2


def test_the_plan_estimates_the_extraction_and_nothing_for_an_up_to_date_output(
    fixture_models, completions, extracted, tmp_path
):
    needed = extract.plan(request(fixture_models, completions, tmp_path / "out"))
    assert needed["changed"] and needed["estimated_seconds"] >= preflight.STARTUP_S
    # Started ahead of its window, the extraction's start and disk reads are behind it.
    prestarted = needed["estimated_seconds_prestarted"]
    assert preflight.PRESTARTED_START_S <= prestarted <= needed["estimated_seconds"] - preflight.STARTUP_S + 5
    current = extract.plan(request(fixture_models, completions, extracted))
    assert not current["changed"] and current["estimated_seconds"] == 0.0
    assert current["estimated_seconds_prestarted"] == 0.0


# ------------------------------------------------------------------ integrity by content


def test_completions_refetched_with_the_same_tokens_leave_the_output_up_to_date(
    fixture_models, completions, extracted, tmp_path
):
    refetched = tmp_path / "completions"
    refetched.mkdir()
    write_completions(refetched, latency=9.9)  # other latencies and request ids, the same tokens
    assert (refetched / "completions.jsonl").read_bytes() != (completions / "completions.jsonl").read_bytes()
    assert extract.plan(request(fixture_models, refetched, extracted))["changed"] is False


def test_an_edited_completions_file_is_named_against_its_manifest(fixture_models, completions, tmp_path):
    edited = tmp_path / "completions"
    shutil.copytree(completions, edited)
    path = edited / "completions.jsonl"
    path.write_text(path.read_text().replace('"output_ids": [7, 8, 9]', '"output_ids": [7, 8, 8]'))
    with pytest.raises(
        StageError,
        match=r"completions\.jsonl does not match the sha256 in .*manifest\.json "
        r".*rerun sglang_completions",
    ):
        extract.plan(request(fixture_models, edited, tmp_path / "out"))


def test_a_flipped_shard_byte_is_named_and_only_that_shard_is_redone(
    fixture_models, completions, extracted, tmp_path
):
    out_dir = tmp_path / "hidden_states"
    shutil.copytree(extracted, out_dir)
    victim, kept = out_dir / "shard-00001.safetensors", out_dir / "shard-00000.safetensors"
    original, kept_mtime = victim.read_bytes(), kept.stat().st_mtime_ns
    damaged = bytearray(original)
    damaged[-3] ^= 0xFF  # same size: a size check cannot see it
    victim.write_bytes(bytes(damaged))
    planned = extract.plan(request(fixture_models, completions, out_dir))
    assert planned["changed"] and f"{victim} does not match the sha256" in planned["reason"]
    assert victim.name not in planned["resumable_shards"] and kept.name in planned["resumable_shards"]
    result = extract.run(request(fixture_models, completions, out_dir))
    assert result["progress"]["shards_written"] == 1
    assert victim.read_bytes() == original and kept.stat().st_mtime_ns == kept_mtime
    assert len(list(open_hidden_states(out_dir))) == 3


def test_every_drafter_of_a_list_is_checked_by_the_plan(fixture_models, completions, tmp_path):
    drafter = drafter_with(fixture_models, tmp_path, vocab_size=512)
    with pytest.raises(StageError, match=r"vocab_size 512 differs from the target's 400"):
        extract.plan(
            request(
                fixture_models,
                completions,
                tmp_path / "out",
                drafter=[str(fixture_models.drafter), str(drafter)],
            )
        )


def test_a_full_disk_names_the_file_and_the_fix_not_a_traceback(tmp_path, monkeypatch, capsys):
    from specops import manifest, stage

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    report = tmp_path / "score" / "report.json"
    monkeypatch.setattr(manifest.os, "fsync", lambda fd: full(fd, b""))
    code = stage.respond("score", lambda: manifest.atomic_write_json(report, {"tau": 1.0}) or {})
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 2 and answer["failed"]
    assert f"no space left to write {report} (No space left on device)" in answer["msg"]
    assert f"df -h {report.parent}" in answer["msg"] and "rerun" in answer["msg"]
    assert not list(report.parent.glob(".*.tmp"))
