"""The host's note of finished extractions: the same work is taken over, other work is named."""

from __future__ import annotations

from pathlib import Path

from specops import extraction_cache
from specops.manifest import load_manifest, write_manifest

INPUTS = {"target": {"name": "t"}, "completions": {"tokens_sha256": "a"}, "layer_ids": [1, 2]}


def extraction(out_dir: Path, inputs: dict) -> dict:
    out_dir.mkdir(parents=True)
    (out_dir / "shard-00000.safetensors").write_bytes(b"shard")
    return write_manifest(out_dir, "extract", inputs, ["shard-00000.safetensors"])


def request(action: str, cache: Path, out_dir: Path, **more) -> dict:
    return {"action": action, "cache_dir": str(cache), "out_dir": str(out_dir), **more}


def test_the_same_work_is_taken_over_with_its_manifest_last(tmp_path):
    cache, first, second = tmp_path / "cache", tmp_path / "a" / "hs", tmp_path / "b" / "hs"
    manifest = extraction(first, INPUTS)
    assert extraction_cache.run(request("note", cache, first, owner="run a"))["changed"]
    taken = extraction_cache.run(request("reuse", cache, second, fingerprint=manifest["inputs_fingerprint"]))
    assert taken == {"changed": True, "reused_from": str(first), "owner": "run a"}
    assert load_manifest(second) == manifest
    assert (second / "shard-00000.safetensors").read_bytes() == b"shard"


def test_other_work_right_after_is_named_with_what_differs(tmp_path):
    cache, first, second = tmp_path / "cache", tmp_path / "a" / "hs", tmp_path / "b" / "hs"
    extraction(first, INPUTS)
    extraction_cache.run(request("note", cache, first, owner="run a"))
    other = {**INPUTS, "layer_ids": [1, 3]}
    answer = extraction_cache.run(request("reuse", cache, second, fingerprint="other", inputs=other))
    assert not answer["changed"] and not second.exists()
    recent = answer["recent"]
    assert recent["owner"] == "run a" and recent["same_work"] is False
    assert recent["differs"] == ["the layers ([1, 2] there, [1, 3] here)"]
    # Long ago is not "right after".
    assert "recent" not in extraction_cache.run(
        request("reuse", cache, second, fingerprint="other", inputs=other, recent_s=-1)
    )


def test_a_changed_output_and_a_turned_off_take_over_are_not_taken(tmp_path):
    cache, first, second = tmp_path / "cache", tmp_path / "a" / "hs", tmp_path / "b" / "hs"
    fingerprint = extraction(first, INPUTS)["inputs_fingerprint"]
    extraction_cache.run(request("note", cache, first))
    off = extraction_cache.run(request("reuse", cache, second, fingerprint=fingerprint, take_over=False))
    assert not off["changed"] and off["recent"]["same_work"] is True
    (first / "shard-00000.safetensors").write_bytes(b"edited")
    assert not extraction_cache.run(request("reuse", cache, second, fingerprint=fingerprint))["changed"]
    assert not second.exists()
