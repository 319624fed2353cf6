# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a memory-saver window releases: the KV cache alone (the weights stay on the GPU) where the extraction
fits beside the server's weights, else every tag with the weights' CPU backup.

Releasing the KV cache costs nothing to move: SGLang flushes it at the release and keeps no backup
(sglang 0.5.23 srt/managers/scheduler_components/weight_updater.py:365-366), and torch_memory_saver
unmaps 60 GiB in 0.02 s. Releasing the weights copies them to pinned host memory and back
(27 GiB: 9-12 s out, 3 s in, on an H200), which makes the downtime grow with the model.

The figures, per GPU, come from the server and the device, never from the model's name:
- the server's own accounting, `/server_info` `internal_states[].memory_usage` (GB, per rank):
  `weight`, `kvcache`, `graph` (0.5.23: a dict per phase, `startup_available` the free memory once
  serving; srt/managers/scheduler_components/memory_usage.py:15-43) or (0.5.4: a number;
  srt/managers/scheduler.py:2389-2399);
- the device's total and used memory from nvidia-smi where it is present; else the server's
  `startup_available` (0.5.23) stands in for what is free while serving.
The extraction's needs come from its plan: one copy of the target up to its last captured layer
(`copy_bytes`) plus activations and workspace (`reserve_bytes`), or its body split over the GPUs.
Standard library only: the module runs it on the managed host.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError
from ansible_collections.specops.drafter.plugins.module_utils.service.sglang_api import release_tags_keeping_weights

MIB = 1 << 20
GIB = 1 << 30
CHOICES = ("auto", "kv_cache", "all")


def _gb_to_mib(value) -> float:
    try:
        return float(value) * 1024.0
    except (TypeError, ValueError):
        return 0.0


def server_memory(info: dict) -> dict | None:
    """The server's own accounting of one rank's GPU memory in MiB, or None where it does not say."""
    states = info.get("internal_states")
    if not isinstance(states, list) or not states or not isinstance(states[0], dict):
        return None
    usage = states[0].get("memory_usage")
    if not isinstance(usage, dict) or "weight" not in usage:
        return None
    graph = usage.get("graph") or 0
    graph_gb = sum(float(v) for v in graph.values()) if isinstance(graph, dict) else graph
    found = {"weights_mib": round(_gb_to_mib(usage.get("weight"))),
             "kv_cache_mib": round(_gb_to_mib(usage.get("kvcache"))),
             "cuda_graph_mib": round(_gb_to_mib(graph_gb))}
    if usage.get("startup_available") is not None:
        found["available_mib"] = round(_gb_to_mib(usage.get("startup_available")))
    return found


def _fits(free_mib: list, extraction: dict) -> tuple[bool, str]:
    """Whether the extraction fits in these GPUs' free memory, and how (one copy on one GPU, or split)."""
    copy = float(extraction.get("copy_bytes") or 0) / MIB
    body = float(extraction.get("body_bytes") or copy * MIB) / MIB
    reserve = float(extraction.get("reserve_bytes") or 0) / MIB
    if not free_mib:
        return False, "no GPU figures"
    if any(free >= copy + reserve for free in free_mib):
        return True, "one copy (%.0f MiB + %.0f MiB working memory) fits on one GPU" % (copy, reserve)
    spare = sum(max(0.0, free - reserve) for free in free_mib)
    if len(free_mib) > 1 and spare >= body:
        return True, "split over %d GPUs (%.0f MiB of body in %.0f MiB to spare)" % (len(free_mib), body, spare)
    return False, ("needs %.0f MiB + %.0f MiB working memory on one GPU (or %.0f MiB split), the GPUs would have "
                   "%s MiB free" % (copy, reserve, body, ", ".join("%.0f" % free for free in free_mib)))


def plan_release(info: dict, gpus: list | None, extraction: dict, release: str, reserve_mib: int,
                 explicit_tags: list | None = None) -> dict:
    """The plan: `choice` (kv_cache or all), the `tags` to release, `reason`, and the figures behind them.

    gpus: [{index, total_mib, used_mib}] from nvidia-smi, or None where the host has none to ask.
    Raises ServiceError (before anything is touched) for a forced choice that cannot work.
    """
    version = info.get("version")
    backup = bool(info.get("enable_weights_cpu_backup"))
    server = server_memory(info)
    keep_tags = release_tags_keeping_weights(version)
    plan = {"requested": release, "version": version, "weights_cpu_backup": backup, "server": server,
            "gpus": gpus, "extraction": dict(extraction or {}), "reserve_mib": reserve_mib,
            "kv_cache_tags": list(keep_tags)}
    if explicit_tags:
        plan.update(choice="explicit", tags=list(explicit_tags), reason="the tags were given (sglang_service_tags)")
        return plan
    if release not in CHOICES:
        raise ServiceError("sglang_service_release %r is not one of %s" % (release, ", ".join(CHOICES)))
    released_mib = (server or {}).get("kv_cache_mib", 0) + (server or {}).get("cuda_graph_mib", 0)
    if gpus:
        free = [row["total_mib"] - row["used_mib"] + released_mib - reserve_mib for row in gpus]
        source = "nvidia-smi, and the server's own accounting of its KV cache and CUDA graphs"
    elif server and "available_mib" in server:
        free = [server["available_mib"] + released_mib - reserve_mib]
        source = "the server's own accounting (no nvidia-smi here): free while serving plus KV cache and graphs"
    else:
        free = []
        source = "nothing: neither nvidia-smi nor the server says how much GPU memory there is"
    plan["free_after_kv_release_mib"] = [round(value) for value in free]
    plan["source"] = source
    if not extraction or not (extraction.get("copy_bytes") or extraction.get("body_bytes")):
        fits, how = False, "the extraction's GPU needs are not known (no plan)"
    else:
        fits, how = _fits(free, extraction)
    plan["fits_beside_weights"] = fits
    if release == "kv_cache" and not fits:
        raise ServiceError(
            "sglang_service_release=kv_cache cannot work: with the server's weights resident the extraction %s "
            "(figures from %s; reserve %d MiB). Release every tag with the weights' CPU backup "
            "(sglang_service_release: all or auto), use the stop window, or lower the extraction's "
            "batch_tokens; the service was not touched" % (how, source, reserve_mib), memory_plan=plan)
    if release == "all" or (release == "auto" and not fits and backup):
        if not backup:
            raise ServiceError(
                "sglang_service_release=all needs the server launched with --enable-weights-cpu-backup: without "
                "it the weights' content is thrown away at the release and the server serves garbage after the "
                "resume. Launch it with that flag, or release only the KV cache (sglang_service_release: "
                "kv_cache); the service was not touched", memory_plan=plan)
        why = "asked for" if release == "all" else "the extraction does not fit beside the weights: it %s" % how
        plan.update(choice="all", tags=[], reason="every tag, the weights through their CPU backup: %s" % why)
        return plan
    if not fits:
        # auto, no backup: the weights cannot leave; the extraction must make do beside them.
        plan.update(choice="kv_cache", tags=list(keep_tags),
                    reason="the KV cache only (the server has no weights CPU backup), although the extraction "
                           "%s: it may run out of GPU memory" % how)
        return plan
    plan.update(choice="kv_cache", tags=list(keep_tags),
                reason="%s, the weights stay on the GPU: %s" % (" and ".join(keep_tags), how))
    return plan


def expected_used_after(plan: dict, before: list | None) -> list | None:
    """Per GPU, the most memory still used once the release has taken effect (the weights stay)."""
    if not before or plan.get("choice") != "kv_cache" or not plan.get("server"):
        return None
    released = plan["server"].get("kv_cache_mib", 0) + plan["server"].get("cuda_graph_mib", 0)
    # Half of what is released, at least: the allocator may keep a little, never most of it.
    return [{"index": row["index"], "max_used_mib": int(row["used_mib"] - released / 2)} for row in before]
