"""extract_hidden_states module and role: one real extraction on the tiny fixture target, on the CPU.

The fixtures and completions are built with the ML environment's Python (.venv-ml); Ansible runs
from .venv and calls the package in the ML environment, as it does on a real host.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from module_call import call_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = ROOT / ".venv/bin/ansible-playbook"
ML_PYTHON = ROOT / ".venv-ml/bin/python"

pytestmark = pytest.mark.skipif(not ML_PYTHON.exists(), reason="needs the ML environment .venv-ml")

BUILD = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from specops.fixtures import build_fixtures
    paths = build_fixtures(sys.argv[1], train_reference=False)
    out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(paths.target)
    model = AutoModelForCausalLM.from_pretrained(paths.target).eval()
    lines = []
    for number, line in enumerate(paths.prompts.read_text().splitlines()[:3]):
        prompt = json.loads(line)
        text = prompt.get("prompt") or " ".join(m["content"] for m in prompt["messages"])
        ids = tokenizer(text)["input_ids"]
        new = model.generate(torch.tensor([ids]), max_new_tokens=5 + number, do_sample=False)[0, len(ids):]
        lines.append(json.dumps({"id": prompt["id"], "prompt_ids": ids, "output_ids": new.tolist(),
                                 "text": "", "finish_reason": "length", "meta_info": {}}))
    (out / "completions.jsonl").write_text("\\n".join(lines) + "\\n")
    print(json.dumps({"target": str(paths.target), "drafter": str(paths.drafter)}))
""")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("extract")
    fixtures = os.environ.get("SPECOPS_FIXTURES") or str(base / "fixtures")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    built = subprocess.run(
        [str(ML_PYTHON), "-c", BUILD, fixtures, str(base / "completions")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    paths = json.loads(built.stdout.strip().splitlines()[-1])
    return {**paths, "completions": str(base / "completions"), "base": base}


def ansible_env():
    # The ML interpreter finds specops through PYTHONPATH here; fla_env installs it on a real host.
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "ANSIBLE_LOCALHOST_WARNING": "false"}


def run_module(args: dict, tree: Path, check: bool = False) -> tuple[int, dict]:
    """Run the module as a host runs it (module_call); its exit status and JSON."""
    result = call_module("extract_hidden_states", args, check=check, env=ansible_env())
    return (1 if result["failed"] else 0), result


def test_module_extracts_then_reports_unchanged(inputs):
    out_dir = inputs["base"] / "module_out"
    args = {
        "python": str(ML_PYTHON),
        "target": inputs["target"],
        "drafter": inputs["drafter"],
        "completions": inputs["completions"],
        "out_dir": str(out_dir),
        "device": "cpu",
        "shard_tokens": 50,
    }

    tree = inputs["base"] / "tree"
    rc, planned = run_module(args, tree, check=True)
    assert rc == 0 and planned["changed"] is True and not out_dir.exists()

    rc, first = run_module(args, tree)
    assert rc == 0, first
    assert first["changed"] is True and first["layer_ids"] == [1, 3, 5] and first["records"] == 3
    assert first["backend"]["gated_delta_rule"] == "torch"
    assert (out_dir / "manifest.json").is_file() and len(first["shards"]) >= 2

    rc, second = run_module(args, tree)
    assert rc == 0 and second["changed"] is False


def test_module_reports_a_bad_layer_id_with_the_fix(inputs):
    rc, result = run_module(
        {
            "python": str(ML_PYTHON),
            "target": inputs["target"],
            "layer_ids": [9],
            "completions": inputs["completions"],
            "out_dir": str(inputs["base"] / "bad"),
            "device": "cpu",
        },
        inputs["base"] / "tree-bad",
    )
    assert rc != 0
    assert "target layer 9 out of range: the model has 8 layers (0-7)" in result["msg"]


def test_role_runs_the_extraction_as_an_async_job_with_progress(inputs):
    out_dir = inputs["base"] / "role_out"
    playbook = inputs["base"] / "play.yml"
    playbook.write_text(
        textwrap.dedent(f"""
        - hosts: localhost
          gather_facts: false
          roles:
            - role: extract_hidden_states
              vars:
                extract_hidden_states_python: {ML_PYTHON}
                extract_hidden_states_target: {inputs["target"]}
                extract_hidden_states_drafter: {inputs["drafter"]}
                extract_hidden_states_completions: {inputs["completions"]}
                extract_hidden_states_out_dir: {out_dir}
                extract_hidden_states_device: cpu
                extract_hidden_states_parity_samples: 1
                extract_hidden_states_capture_offsets: [0]
                extract_hidden_states_poll_interval: 1
                extract_hidden_states_report_interval: 2
                extract_hidden_states_environment:
                  PYTHONPATH: {ROOT / "src"}
          tasks:
            - name: Show the result
              ansible.builtin.debug:
                msg: "RESULT {{{{ extract_hidden_states_result | to_json }}}}"
    """)
    )
    done = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), str(playbook)],
        cwd=ROOT,
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert "tokens " in done.stdout and "tok/s" in done.stdout  # a progress line was printed
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["parity"]["passed"] is True and manifest["layer_ids"] == [1, 3, 5]
