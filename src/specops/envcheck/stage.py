"""What the ML environment can really run: imports, GPUs, and fla's gated delta rule against torch.

Run inside the environment as `python -m specops.envcheck --run` (the stage protocol, see
docs/architecture.md). The report says which backend extraction will use. `fla-cuda` is claimed
only after fla's `chunk_gated_delta_rule` ran on the GPU and matched transformers' torch reference
(computed in fp32 on the same inputs) within GDR_TOLERANCE; anything less is `torch-cuda` or
`torch-cpu`, so a silent fallback can no longer pass for the fast, checked path.

`require_backend` takes the extraction's values (specops.backend.REQUIRE_BACKENDS): `fla`, and `auto`
where torch sees a CUDA GPU, fail unless the backend is `fla-cuda`; `torch` and `any` report what
there is (the default is `any`).

torch is imported lazily: `decide()` and the constants are usable without it (the control node
tests them with injected facts).

This module holds the stage (its options, report, plan and run); the facts are gathered in
facts, the kernel check is in kernel and the decision in decision.
"""

from __future__ import annotations

from typing import Any

from specops.backend import check_require_backend
from specops.envcheck.decision import (
    decide,
)
from specops.envcheck.facts import collect_facts
from specops.envcheck.kernel import (
    normalize_sizes,
    run_gdr_checks,
)
from specops.stage import StageError, log, serve


def parse_request(request: dict[str, Any]) -> tuple[str, list[dict[str, Any]], int]:
    require = check_require_backend(request.get("require_backend", "any"))
    seed = request.get("gdr_seed", 0)
    if not isinstance(seed, int):
        raise StageError(f"gdr_seed must be an integer, got {seed!r}")
    return require, normalize_sizes(request.get("gdr_sizes")), seed


def report(facts: dict[str, Any], gdr: dict[str, Any] | None, verdict: dict[str, Any]) -> dict[str, Any]:
    gdr = gdr or {"ran": False}
    return {
        "changed": False,
        **facts,
        "backend": verdict["backend"],
        "backend_expected": verdict["backend_expected"],
        "require_backend": verdict["require_backend"],
        "gdr_max_abs_error": gdr.get("max_abs_error"),
        "gdr_rel_error": gdr.get("rel_error"),
        "gdr": gdr,
        "notes": verdict["notes"],
        "warnings": verdict["warnings"],
    }


def _check(request: dict[str, Any], planning: bool) -> dict[str, Any]:
    require, sizes, seed = parse_request(request)
    facts = collect_facts()
    gdr = None
    if not planning and facts["cuda_available"] and facts["fla_importable"]:
        try:
            gdr = run_gdr_checks(sizes, seed)
        except StageError:
            raise
        except Exception as error:  # a kernel that cannot compile or launch here is a finding, not a crash
            gdr = {"ran": True, "ok": False, "error": f"{type(error).__name__}: {error}", "checks": []}
    verdict = decide(facts, gdr, require, planning=planning)
    if verdict["error"]:
        raise StageError(verdict["error"])
    result = report(facts, gdr, verdict)
    for line in verdict["warnings"]:
        log(f"envcheck: WARNING {line}")
    log(f"envcheck: backend {result['backend'] or result['backend_expected'] + ' (expected)'}")
    return result


def plan(request: dict[str, Any]) -> dict[str, Any]:
    return _check(request, planning=True)


def run(request: dict[str, Any]) -> dict[str, Any]:
    return _check(request, planning=False)


def main(argv: list[str] | None = None) -> int:
    return serve("envcheck", plan, run, argv)
