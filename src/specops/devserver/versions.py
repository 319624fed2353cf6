"""What differs between the SGLang releases the strict server imitates (`--sglang-version`)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_VERSION = "0.5.23"


@dataclass(frozen=True)
class SGLangVersion:
    name: str
    # PauseGenerationReqInput.mode (managers/io_struct.py:1946 in 0.5.23); 0.5.4 takes no body
    # and always aborts (managers/tokenizer_manager.py:1090 in 0.5.4).
    pause_modes: tuple[str, ...]
    # 0.5.23 asserts `is_fully_idle` before a release (scheduler_components/weight_updater.py:339);
    # 0.5.4 pauses the pools under running requests (scheduler_update_weights_mixin.py:101).
    release_asserts_idle: bool
    # GPU_MEMORY_ALL_TYPES, what `[]` means (constants.py:6 in 0.5.23; the default list in 0.5.4's
    # scheduler_update_weights_mixin.py:107).
    all_tags: tuple[str, ...]
    # 0.5.23 answers a busy /flush_cache with "Flush cache failed." (entrypoints/http_server.py:1037);
    # 0.5.4 with the success text (entrypoints/http_server.py:613).
    flush_failure_text: bool
    # Info endpoints: 0.5.23 serves /server_info and /model_info beside the deprecated get_ names
    # (http_server.py:853-863); 0.5.4 only /get_server_info and /get_model_info (http_server.py:475,496).
    info_paths: tuple[str, ...]
    # 0.5.23 reports load at /v1/loads (entrypoints/v1_loads.py:96) and has no /get_load;
    # 0.5.4 answers /get_load (http_server.py:510).
    load_path: str
    # Paths served without the API key: 0.5.23 /health*, /ready*, /metrics* (utils/auth.py
    # `decide_request_auth`); 0.5.4 /health* and /metrics* (utils/common.py:1129).
    open_prefixes: tuple[str, ...]
    # Endpoints that only --admin-api-key opens when it is set, the plain --api-key refused there
    # (0.5.23 utils/auth.py:133-141, AuthLevel.ADMIN_OPTIONAL on entrypoints/http_server.py:1026 flush,
    # 1301 update_weights_from_disk, 1576 release, 1588 resume, 1600 weights_checker, 1832 pause,
    # 1845 continue). Empty: the release has no --admin-api-key (0.5.4 utils/common.py:1129).
    admin_paths: tuple[str, ...]
    # /ready: 503 while paused or after a failed health check (0.5.23 entrypoints/http_server.py:714,
    # managers/tokenizer_manager.py:733-734); 0.5.4 has no /ready.
    has_ready: bool
    # Whether the load endpoint asks the scheduler, whose answer a health check waiting at a pause
    # takes for a sign of life (0.5.23 http_server.py:779-785 reads last_receive_tstamp): 0.5.4's
    # /get_load is a scheduler round trip (tokenizer_communicator_mixin.py:629-631); 0.5.23's
    # /v1/loads reads a shared snapshot (tokenizer_control_mixin.py:1001-1028).
    load_asks_scheduler: bool
    # /weights_checker, checksums of the loaded weights (0.5.23 entrypoints/http_server.py:1599-1620,
    # utils/weight_checker.py:206-235); 0.5.4 has none.
    has_weights_checker: bool
    # --weight-cache-mode choices (0.5.23 arg_groups/fields/model.py:377-389); 0.5.4 has no such flag.
    weight_cache_modes: tuple[str, ...]
    # Flush and release idleness require an empty grammar queue (0.5.23 managers/scheduler.py:5369-5372);
    # 0.5.4's flush_cache looks only at the waiting queue and the running batch (scheduler.py:2305-2311).
    idle_needs_empty_grammar_queue: bool
    # SGLANG_REQ_WAITING_TIMEOUT aborts long-waiting requests with 503 (0.5.23 environ.py:685,
    # managers/scheduler.py:3605-3620); 0.5.4 reads no such variable.
    reads_waiting_timeout: bool


# Admin endpoints this server serves (the subset of 0.5.23's ADMIN_OPTIONAL routes it has).
ADMIN_PATHS_0_5_23 = (
    "/flush_cache",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/weights_checker",
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
)


VERSIONS = {
    "0.5.23": SGLangVersion(
        name="0.5.23",
        pause_modes=("abort", "retract", "in_place"),
        release_asserts_idle=True,
        all_tags=("kv_cache", "weights", "cuda_graph"),
        flush_failure_text=True,
        info_paths=("/server_info", "/get_server_info", "/model_info", "/get_model_info"),
        load_path="/v1/loads",
        open_prefixes=("/health", "/ready", "/metrics"),
        admin_paths=ADMIN_PATHS_0_5_23,
        has_ready=True,
        load_asks_scheduler=False,
        has_weights_checker=True,
        weight_cache_modes=("off", "daemon", "client"),
        idle_needs_empty_grammar_queue=True,
        reads_waiting_timeout=True,
    ),
    "0.5.4": SGLangVersion(
        name="0.5.4",
        pause_modes=("abort",),
        release_asserts_idle=False,
        all_tags=("weights", "kv_cache"),
        flush_failure_text=False,
        info_paths=("/get_server_info", "/get_model_info"),
        load_path="/get_load",
        open_prefixes=("/health", "/metrics"),
        admin_paths=(),
        has_ready=False,
        load_asks_scheduler=True,
        has_weights_checker=False,
        weight_cache_modes=("off",),
        idle_needs_empty_grammar_queue=False,
        reads_waiting_timeout=False,
    ),
}
