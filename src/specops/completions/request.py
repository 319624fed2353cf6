"""The completions stage's request: its declared options (REQUEST), the parsed Settings, and the
checks that turn a request into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specops.schema import Option, Schema
from specops.stage import StageError

STAGE = "completions"
REQUEST = Schema(
    STAGE,
    (
        # SGLang's default port (ServerArgs.port in python/sglang/srt/server_args.py, sglang@001067ff).
        Option(
            "server_url",
            "str",
            "Base URL of the SGLang server (no trailing path).",
            default="http://127.0.0.1:30000",
        ),
        Option(
            "prompts",
            "path",
            'JSONL prompts on the managed host, {"id", "prompt"} or {"id", "messages"} per line.',
            required=True,
        ),
        Option(
            "tokenizer",
            "path",
            "The target model directory SGLang serves; its tokenizer makes input_ids.",
            required=True,
        ),
        Option(
            "out_dir", "path", "Directory that receives completions.jsonl and manifest.json.", required=True
        ),
        Option("max_new_tokens", "int", "Greedy tokens per prompt at most.", default=256),
        Option("concurrency", "int", "Requests in flight at once.", default=4),
        Option("timeout", "float", "Seconds to wait for one answer before it is retried.", default=300.0),
        Option(
            "retries",
            "int",
            "Retries per request after a connection error, a timeout or a 5xx answer.",
            default=5,
        ),
        Option(
            "backoff",
            "float",
            "Seconds before the first retry; each further retry waits twice as long.",
            default=1.0,
        ),
        # SGLang started with --api-key answers 401 without it (entrypoints/http_server.py, 0.5.23:
        # add_api_key_middleware); never written to the manifest or the output.
        Option(
            "api_key", "str", "Sent as Authorization: Bearer on every request; empty sends none.", default=""
        ),
    ),
)


@dataclass(frozen=True)
class Settings:
    server_url: str
    prompts: Path
    tokenizer: Path
    out_dir: Path
    max_new_tokens: int
    concurrency: int
    timeout: float
    retries: int
    backoff: float
    api_key: str = field(default="", repr=False)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(request: dict[str, Any]) -> Settings:
    values = REQUEST.merged(request)
    url = str(values["server_url"]).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise StageError(
            f"server_url {url!r} must start with http:// or https:// (e.g. http://127.0.0.1:30000)"
        )
    for key, minimum in (("max_new_tokens", 1), ("concurrency", 1), ("retries", 0)):
        if not is_int(values[key]) or values[key] < minimum:
            raise StageError(f"{key} must be an integer >= {minimum}, got {values[key]!r}")
    for key, positive in (("timeout", True), ("backoff", False)):
        value = values[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value < 0
            or (positive and value == 0)
        ):
            raise StageError(
                f"{key} must be a number {'> 0' if positive else '>= 0'} (seconds), got {value!r}"
            )
    prompts, tokenizer = Path(values["prompts"]), Path(values["tokenizer"])
    if not prompts.is_file():
        raise StageError(
            f'prompts file {prompts} does not exist: give a JSONL file of {{"id", "prompt"}} '
            'or {"id", "messages"} records'
        )
    if not tokenizer.is_dir():
        raise StageError(
            f"tokenizer {tokenizer} is not a directory: give the target model's directory "
            "(the one SGLang serves) on this host"
        )
    return Settings(
        server_url=url,
        prompts=prompts,
        tokenizer=tokenizer,
        out_dir=Path(values["out_dir"]),
        max_new_tokens=values["max_new_tokens"],
        concurrency=values["concurrency"],
        timeout=float(values["timeout"]),
        retries=values["retries"],
        backoff=float(values["backoff"]),
        api_key=str(values["api_key"] or ""),
    )
