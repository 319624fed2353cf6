"""The parity probe: the running backend against the fp32 torch reference, layer by layer."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from specops.backend import BackendMonitor
from specops.extract.backend_guard import check_backend
from specops.extract.capture import LayerCapture
from specops.extract.target import Record
from specops.stage import StageError, log


@contextmanager
def parameters_as(
    module: Any, dtype: Any, skip: Callable[[str], bool] = lambda name: False
) -> Iterator[None]:
    """Temporarily cast floating parameters; bf16/fp16 -> fp32 -> back is exact, so nothing is lost."""
    changed = []
    try:
        for name, parameter in module.named_parameters():
            if parameter.is_floating_point() and parameter.dtype != dtype and not skip(name):
                changed.append((parameter, parameter.dtype))
                parameter.data = parameter.data.to(dtype)
        yield
    finally:
        for parameter, original in changed:
            parameter.data = parameter.data.to(original)


def _errors(candidate: Any, reference: Any) -> tuple[float, float]:
    """(cosine similarity, relative error ||a-b||/||b||) over all tokens and features, in float64."""
    a, b = candidate.double().flatten(), reference.double().flatten()
    cosine = float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))
    return cosine, float((a - b).norm() / b.norm().clamp_min(1e-300))


def parity_probe(
    capture: LayerCapture,
    records: Sequence[Record],
    samples: int,
    device: Any,
    dtype: Any,
    modeling: Any,
    tolerance: float,
) -> dict[str, Any]:
    """Compare the running backend with the torch reference in fp32 on a few records, layer by layer.

    The bf16 noise floor (the torch reference in the run's dtype against fp32) is measured on the same
    records; a layer fails when its error exceeds max(tolerance, 2 x floor).
    """
    import torch

    step = max(1, len(records) // samples)
    chosen = list(records)[::step][:samples]
    last = capture.last
    beyond_last = lambda name: name.startswith("layers.") and int(name.split(".")[1]) > last  # noqa: E731
    # Per record, per captured layer: (cosine, relative error).
    sums: dict[str, list[list[tuple[float, float]]]] = {"primary": [], "floor": []}
    started = time.perf_counter()
    for record in chosen:
        ids = torch.from_numpy(record.input_ids)[None].to(device)
        primary = [t.float() for t in capture(ids)]
        floor = None
        if dtype != torch.float32:
            with BackendMonitor(modeling, force_torch=True):
                floor = [t.float() for t in capture(ids)]
        with (
            BackendMonitor(modeling, force_torch=True),
            parameters_as(capture.body, torch.float32, beyond_last),
        ):
            reference = capture(ids)
        sums["primary"].append([_errors(p, r) for p, r in zip(primary, reference, strict=True)])
        if floor is not None:
            sums["floor"].append([_errors(f, r) for f, r in zip(floor, reference, strict=True)])
        del primary, floor, reference
    layers = []
    for column, layer in enumerate(capture.layer_ids):
        cosine = min(s[column][0] for s in sums["primary"])
        error = max(s[column][1] for s in sums["primary"])
        floor_error = max((s[column][1] for s in sums["floor"]), default=0.0)
        limit = max(tolerance, 2.0 * floor_error)
        layers.append(
            {
                "layer": layer,
                "cosine": cosine,
                "rel_error": error,
                "noise_floor_rel_error": floor_error,
                "limit": limit,
                "passed": error <= limit,
            }
        )
    return {
        "samples": len(chosen),
        "tokens": sum(r.num_tokens for r in chosen),
        "reference": "torch fallback, float32",
        "noise_floor": f"torch fallback, {str(dtype).removeprefix('torch.')}" if sums["floor"] else None,
        "tolerance": tolerance,
        "layers": layers,
        "passed": all(layer["passed"] for layer in layers),
        "seconds": time.perf_counter() - started,
    }


def checked_parity(
    capture: LayerCapture, prep: Any, device: Any, modeling: Any, monitor: BackendMonitor, where: str = ""
) -> dict[str, Any] | None:
    """The parity probe (when asked) and the backend guard on what it ran; refuses wrong hidden states.

    `where` names the device in the error when the extraction runs on several.
    """
    if not prep.req["parity_samples"]:
        return None
    parity = parity_probe(
        capture,
        prep.records,
        prep.req["parity_samples"],
        device,
        prep.dtype,
        modeling,
        prep.req["parity_tolerance"],
    )
    check_backend(prep.require, monitor.summary())
    worst = max(parity["layers"], key=lambda layer: layer["rel_error"] / layer["limit"])
    log(
        f"parity{where}: worst layer {worst['layer']} rel error {worst['rel_error']:.4f} "
        f"(limit {worst['limit']:.4f}), cosine {worst['cosine']:.5f}"
    )
    if not parity["passed"]:
        raise StageError(
            f"parity probe failed{where}: layer {worst['layer']} differs from the fp32 torch reference by "
            f"{worst['rel_error']:.1%} (limit {worst['limit']:.1%}, bf16 noise floor "
            f"{worst['noise_floor_rel_error']:.1%}): the {monitor.summary()['gated_delta_rule']} "
            "implementation gives wrong hidden states; check the fla/transformers versions"
        )
    return parity
