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
    ),
}
