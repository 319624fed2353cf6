"""What a scoring host is sent (the outputs, the drafters, the target's small files and head shards only),
and the check where it arrives: a file altered or missing on the way stops the scoring, naming it."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest

from specops import shipping
from specops.manifest import sha256_file
from specops.stage import StageError


@pytest.fixture
def source(tmp_path) -> dict[str, Path]:
    hidden = tmp_path / "run" / "hidden_states"
    hidden.mkdir(parents=True)
    (hidden / "shard-0.safetensors").write_bytes(b"states" * 100)
    (hidden / "shard-1.safetensors.tmp123").write_bytes(b"a crashed write")
    digest = {"size": 600, "sha256": sha256_file(hidden / "shard-0.safetensors")}
    (hidden / "manifest.json").write_text(json.dumps({"files": {"shard-0.safetensors": digest}}))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"drafter")
    target = tmp_path / "target"
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (target / name).write_text("{}")
    weight_map = {
        "model.embed_tokens.weight": "model-00001-of-00003.safetensors",
        "model.layers.0.mlp.up_proj.weight": "model-00002-of-00003.safetensors",
        "lm_head.weight": "model-00003-of-00003.safetensors",
    }
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for shard in set(weight_map.values()):
        (target / shard).write_bytes(shard.encode())
    return {"hidden": hidden, "drafter": drafter, "target": target}


def listed(source) -> dict:
    return shipping.listing(
        {
            "hidden_states": str(source["hidden"]),
            "target": str(source["target"]),
            "drafters": [str(source["drafter"])],
        }
    )


def test_the_list_holds_the_outputs_the_drafters_and_only_the_targets_head_shards(source):
    names = {Path(f["path"]).name for f in listed(source)["files"]}
    assert names == {
        "shard-0.safetensors",
        "manifest.json",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        "model-00001-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    }, "the layers' shard and a writer's temporary stay home"


def test_what_arrived_intact_is_verified_and_an_altered_or_missing_file_is_named(source, tmp_path):
    files = listed(source)["files"]
    root = tmp_path / "scoring-root"
    for entry in files:
        arrived = shipping.arrived_at(root, entry["path"])
        arrived.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(entry["path"], arrived)
    assert shipping.verify({"root": str(root), "files": files})["verified"] == len(files)

    shard = shipping.arrived_at(root, str(source["hidden"] / "shard-0.safetensors"))
    shard.write_bytes(b"STATES" * 100)  # the same size, other bytes
    shipping.arrived_at(root, str(source["drafter"] / "config.json")).unlink()
    with pytest.raises(StageError) as refused:
        shipping.verify({"root": str(root), "files": files})
    message = str(refused.value)
    assert message.startswith(
        f"2 of {len(files)} shipped file(s) did not arrive intact, so nothing is scored"
    )
    assert f"{shard} does not match the sha256 it was sent with" in message
    assert "drafter/config.json is missing" in message


def test_a_sharded_target_whose_index_maps_no_head_is_refused(source):
    index = source["target"] / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"weight_map": {"model.layers.0.weight": "model-00002-of-00003.safetensors"}})
    )
    with pytest.raises(StageError, match="maps no token embedding or output head"):
        listed(source)


def test_small_files_travel_in_one_archive_that_unpacks_below_the_root_only(source, tmp_path):
    files = listed(source)["files"]
    archive = tmp_path / "spool" / "out.tar"
    packed = shipping.pack({"archive": str(archive), "files": [f["path"] for f in files]})
    assert packed["files"] == len(files) and archive.is_file()
    root = tmp_path / "scoring-root"
    unpacked = shipping.unpack(
        {"archive": str(archive), "root": str(root), "directories": ["/elsewhere/shards"], "files": files}
    )
    assert unpacked == {"changed": True, "unpacked": len(files), "verified": len(files)}
    assert not archive.exists() and (root / "elsewhere" / "shards").is_dir()

    with tarfile.open(archive, "w") as tar:  # a name that climbs out of the root
        tar.add(str(files[0]["path"]), arcname="../escaped")
    with pytest.raises(StageError, match="outside"):
        shipping.unpack({"archive": str(archive), "root": str(root)})
    assert not (tmp_path / "escaped").exists()
