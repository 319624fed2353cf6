"""Run one of the collection's modules as a managed host runs it, without starting Ansible's controller.

A module is a program that reads its arguments as JSON and prints its result as JSON; the controller
wraps it (AnsiballZ), copies it to the host and reads the answer back. The module tests are about the
module, so they call it directly: `python -m ansible_collections.specops.drafter.plugins.modules.NAME
ARGS_FILE`, the same AnsibleModule argument checks, check mode and no_log masking, at a tenth of the
CPU (`ansible localhost -m` spent about 2 CPU-s per call starting the controller, 0.2 CPU-s here). The
playbook tests run every module through the controller.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COLLECTIONS = ROOT / "collections"
COLLECTION = "specops.drafter"


def call_module(
    name: str,
    args: dict,
    check: bool = False,
    env: dict | None = None,
    timeout: float = 600,
    python: str = sys.executable,
) -> dict:
    """Run specops.drafter.NAME with ARGS; its JSON result, with `failed` set from its exit status (as
    `ansible --tree` results were read before)."""
    module = name.removeprefix(COLLECTION + ".")
    environment = dict(os.environ if env is None else env)
    # The collection from this checkout first, as collections_path in ansible.cfg says; the rest of the
    # path (the working tree's src under make test) is kept for the processes the module starts.
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(COLLECTIONS)] + [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix=f"{module}-args-") as handle:
        # What the controller adds to every module's arguments that these modules read.
        json.dump({"ANSIBLE_MODULE_ARGS": dict(args, _ansible_check_mode=check)}, handle)
        handle.flush()
        proc = subprocess.run(
            [python, "-m", f"ansible_collections.specops.drafter.plugins.modules.{module}", handle.name],
            cwd=ROOT,
            env=environment,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(
            f"{COLLECTION}.{module} printed no JSON result (exit {proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        ) from None
    result["failed"] = proc.returncode != 0
    return result
