"""sglang_completions as a host runs it, against the development server: check mode, run, rerun.

The ML environment (.venv-ml) builds the fixture model and runs the development server; the module runs
`python -m specops.completions` there with the checkout's package first on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specops.devserver.launch import DevServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from module_call import call_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ML_PYTHON = ROOT / ".venv-ml/bin/python"

pytestmark = pytest.mark.skipif(not ML_PYTHON.exists(), reason="needs the ML environment (.venv-ml)")


def ml_env() -> dict:
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT / "src"),
    )


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    root = Path(
        os.environ.get("SPECOPS_FIXTURES") or tmp_path_factory.mktemp("completions_module") / "fixtures"
    )
    subprocess.run(
        [
            str(ML_PYTHON),
            "-c",
            "import sys; from specops.fixtures import build_fixtures; "
            "build_fixtures(sys.argv[1], train_reference=False)",
            str(root),
        ],
        check=True,
        env=ml_env(),
        capture_output=True,
        timeout=900,
    )
    return root


def run_module(args: dict, tmp_path: Path, check: bool = False) -> dict:
    """Run specops.drafter.sglang_completions as a host runs it (module_call); its result, with failed set."""
    return call_module("sglang_completions", args, check=check, env=ml_env())


@pytest.fixture(scope="module")
def server(fixtures, tmp_path_factory):
    with DevServerProcess(
        fixtures / "target", python=str(ML_PYTHON), log_path=tmp_path_factory.mktemp("server") / "server.log"
    ) as running:
        running.wait_ready()
        yield running


def module_args(fixtures: Path, server, tmp_path: Path) -> dict:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join((fixtures / "prompts.jsonl").read_text().splitlines()[:2]) + "\n")
    return {
        "python": str(ML_PYTHON),
        "server_url": server.url,
        "prompts": str(prompts),
        "tokenizer": str(fixtures / "target"),
        "out_dir": str(tmp_path / "completions"),
        "max_new_tokens": 8,
        "concurrency": 2,
        "timeout": 120,
        "retries": 2,
        "backoff": 0.2,
    }


def test_check_mode_run_and_rerun(fixtures, server, tmp_path):
    args = module_args(fixtures, server, tmp_path)
    prompts = Path(args["prompts"])

    planned = run_module(args, tmp_path, check=True)
    assert planned["changed"] is True and not planned["failed"], planned.get("msg")
    assert not (tmp_path / "completions").exists()

    first = run_module(args, tmp_path)
    assert first["changed"] is True and not first["failed"], first.get("msg")
    assert first["count"] == first["generated"] == 2 and first["model_path"] == str(fixtures / "target")
    ids = [json.loads(line)["id"] for line in prompts.read_text().splitlines()]
    assert [json.loads(line)["id"] for line in Path(first["path"]).read_text().splitlines()] == ids

    again = run_module(args, tmp_path)
    assert again["changed"] is False and again["sha256"] == first["sha256"]


def test_an_edited_record_is_returned_as_damaged_with_its_file_line_and_id(fixtures, server, tmp_path):
    args = module_args(fixtures, server, tmp_path)
    first = run_module(args, tmp_path)
    assert not first["failed"], first.get("msg")
    path = Path(first["path"])
    lines = path.read_text().splitlines(keepends=True)
    fetched = json.loads(lines[1])
    edited = dict(fetched, output_ids=[fetched["output_ids"][0] ^ 1, *fetched["output_ids"][1:]])
    lines[1] = json.dumps(edited, sort_keys=True) + "\n"
    path.write_text("".join(lines))

    repaired = run_module(args, tmp_path)
    assert repaired["changed"] is True and not repaired["failed"], repaired.get("msg")
    assert repaired["damaged"] == [f"{path} line 2 (id {fetched['id']!r}) is damaged or edited"]
    assert repaired["reason"]
    assert repaired["generated"] == 1 and repaired["resumed"] == 1
    assert json.loads(path.read_text().splitlines()[1])["output_ids"] == fetched["output_ids"]
