"""Stage extract_hidden_states: the target's hidden states at the drafter's layers, streamed to shards.

`python -m specops.extract --plan|--run` runs the stage (stage.py). The modules, in the order a run
uses them: request (options), target (model, completions, layers), shards (plan, resume state),
prepared (the validated request), devices (where it runs), backend_guard (require_backend),
capture (the layers' outputs), pipeline (host copies, shard writers, timing, progress), extraction
(the batch loop), parity (the probe), parallel (several devices), outputs (manifest, result).
"""

from specops.extract.backend_guard import backend_plan, check_backend
from specops.extract.capture import LayerCapture, decoder_body, pad_batch, unpadded_mask_mapping
from specops.extract.devices import DevicePlan, describe_device, plan_for, resolve_device_dtype
from specops.extract.extraction import ExtractionSettings, extract_shards
from specops.extract.outputs import finish_manifest, library_versions, stage_result
from specops.extract.parity import parity_probe
from specops.extract.pipeline import DeviceTimer, HostCopier, Progress, ShardWriter
from specops.extract.prepared import Prepared, prepare
from specops.extract.request import STAGE, parse_request
from specops.extract.shards import STATE_NAME, ResumeState, ShardPlan, plan_shards
from specops.extract.stage import main, plan, run
from specops.extract.target import Record, TargetInfo, inspect_target, read_completions

__all__ = [
    "STAGE",
    "STATE_NAME",
    "DevicePlan",
    "DeviceTimer",
    "ExtractionSettings",
    "HostCopier",
    "LayerCapture",
    "Prepared",
    "Progress",
    "Record",
    "ResumeState",
    "ShardPlan",
    "ShardWriter",
    "TargetInfo",
    "backend_plan",
    "check_backend",
    "decoder_body",
    "describe_device",
    "extract_shards",
    "finish_manifest",
    "inspect_target",
    "library_versions",
    "main",
    "pad_batch",
    "parity_probe",
    "parse_request",
    "plan",
    "plan_for",
    "plan_shards",
    "prepare",
    "read_completions",
    "resolve_device_dtype",
    "run",
    "stage_result",
    "unpadded_mask_mapping",
]
