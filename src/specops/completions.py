"""Stage `completions`: the target's own greedy tokens for every prompt, fetched from SGLang's /generate.

Prompts are tokenized here with the target's tokenizer and sent as `input_ids`, and the answer's
`output_ids` are stored as they come: scoring later needs the exact tokens, which a text round-trip
through a tokenizer does not guarantee. Finished records are appended to a partial file one by one,
so an interrupted run resumes where it stopped; the final file and the manifest are written last.

Request (JSON on stdin, see specops.stage): `REQUEST` below, the one declaration of its options.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from concurrent.futures import CancelledError, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3 import BaseHTTPResponse
from urllib3.exceptions import NewConnectionError
from urllib3.exceptions import TimeoutError as Urllib3Timeout
from urllib3.util.retry import Retry

from specops.manifest import (
    MANIFEST_NAME,
    atomic_write_text,
    fingerprint,
    is_up_to_date,
    load_manifest,
    remove_stale_temporaries,
    sha256_file,
    staleness,
    write_manifest,
)
from specops.schema import Option, Schema
from specops.stage import StageError, log, serve

STAGE = "completions"
OUTPUT_NAME = "completions.jsonl"
PARTIAL_NAME = "completions.partial.jsonl"
TEMPERATURE = 0.0  # greedy: the only setting under which offline scoring can reproduce the server
MAX_BACKOFF_S = 30.0
MAX_ERRORS_SHOWN = 10
# Files that decide how text becomes token ids; their contents identify the tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
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
DEFAULTS: dict[str, Any] = REQUEST.defaults
REQUIRED = REQUEST.required


# -- request ---------------------------------------------------------------------------------
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(request: dict[str, Any]) -> Settings:
    unknown = REQUEST.unknown(request)
    if unknown:
        raise StageError(f"unknown request key(s) {', '.join(unknown)}: expected {', '.join(REQUEST.names)}")
    missing = [key for key in REQUIRED if not request.get(key)]
    if missing:
        raise StageError(f"missing required key(s) {', '.join(missing)}")
    values = {**DEFAULTS, **{k: v for k, v in request.items() if v is not None}}
    url = str(values["server_url"]).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise StageError(
            f"server_url {url!r} must start with http:// or https:// (e.g. http://127.0.0.1:30000)"
        )
    for key, minimum in (("max_new_tokens", 1), ("concurrency", 1), ("retries", 0)):
        if not _is_int(values[key]) or values[key] < minimum:
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


# -- prompts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    id: str
    line: int
    text: str | None = None
    messages: list[dict[str, Any]] | None = None


def _prompt_problem(record: Any) -> str | None:
    """What is wrong with one parsed JSONL record, or None when it is a valid prompt."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    pid = record.get("id")
    if not isinstance(pid, str) or not pid.strip():
        return f"'id' must be a non-empty string (got {pid!r}); write numeric ids as strings, e.g. \"17\""
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        return "give exactly one of 'prompt' (text) or 'messages' (chat)"
    if has_prompt:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            return "'prompt' must be a non-empty string"
        return None
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        return '\'messages\' must be a non-empty list of {"role", "content"} objects'
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] must be an object with 'role' and 'content'"
        if not isinstance(message.get("role"), str) or not message["role"]:
            return f"messages[{index}].role must be a non-empty string (system, user, assistant)"
        if not isinstance(message.get("content"), str):
            return f"messages[{index}].content must be a string"
    return None


def load_prompts(path: Path) -> list[Prompt]:
    """Every record checked; all problems reported together, each with its line number."""
    prompts: list[Prompt] = []
    errors: list[str] = []
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                # Some of json's messages end in "at" ("Unterminated string starting at"): one "at" only.
                where = f"{error.msg.removesuffix(' at')} at column {error.colno}"
                errors.append(f"{path}:{number}: not valid JSON ({where})")
                continue
            problem = _prompt_problem(record)
            if problem:
                errors.append(f"{path}:{number}: {problem}")
                continue
            pid = record["id"]
            if pid in first_line:
                errors.append(
                    f"{path}:{number}: duplicate id {pid!r} (first on line {first_line[pid]}): "
                    "ids must be unique"
                )
                continue
            first_line[pid] = number
            prompts.append(
                Prompt(id=pid, line=number, text=record.get("prompt"), messages=record.get("messages"))
            )
    if errors:
        shown = errors[:MAX_ERRORS_SHOWN]
        more = f"; and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        raise StageError(f"{len(errors)} invalid prompt record(s): " + "; ".join(shown) + more)
    if not prompts:
        raise StageError(f"prompts file {path} holds no prompts: add one JSON object per line")
    return prompts


# -- tokenizer -------------------------------------------------------------------------------
def tokenizer_identity(directory: Path) -> dict[str, str]:
    """Content digests of the tokenizer's files: cheap, and enough to know the ids would not change."""
    identity = {
        name: sha256_file(directory / name) for name in TOKENIZER_FILES if (directory / name).is_file()
    }
    if not any(name in identity for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise StageError(
            f"{directory} holds no tokenizer (tokenizer.json / tokenizer_config.json): "
            "point 'tokenizer' at the target model's directory"
        )
    return identity


def tokenize(prompts: list[Prompt], directory: Path, prompts_path: Path) -> dict[str, list[int]]:
    """Plain prompts as text (what SGLang does with `text`); chat prompts through the chat template."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as error:  # transformers raises many types for a broken directory
        raise StageError(f"cannot load the tokenizer from {directory}: {error}") from None
    ids: dict[str, list[int]] = {}
    for prompt in prompts:
        if prompt.messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise StageError(
                    f"{prompts_path}:{prompt.line}: chat prompt {prompt.id!r} but the tokenizer in "
                    f"{directory} has no chat template: use a plain 'prompt' or a chat model"
                )
            encoded: Any = tokenizer.apply_chat_template(
                prompt.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
                encoded = encoded["input_ids"]
        else:
            encoded = tokenizer.encode(prompt.text)
        token_ids = [int(t) for t in encoded]
        if not token_ids:
            raise StageError(f"{prompts_path}:{prompt.line}: prompt {prompt.id!r} tokenizes to nothing")
        ids[prompt.id] = token_ids
    return ids


# -- server ----------------------------------------------------------------------------------
class StageRetry(Retry):
    """urllib3's retry policy as the stage wants it: each retry is logged, the first one waits
    `backoff` too (urllib3 retries it at once), and a wait ends when another request has failed."""

    def __init__(self, *args: Any, abort: threading.Event | None = None, server: str = "", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.abort = abort or threading.Event()
        self.server = server

    def new(self, **kw: Any) -> StageRetry:
        return super().new(abort=self.abort, server=self.server, **kw)

    def get_backoff_time(self) -> float:
        return float(min(self.backoff_factor * 2 ** (len(self.history) - 1), self.backoff_max))

    def sleep(self, response: BaseHTTPResponse | None = None) -> None:
        last = self.history[-1]
        endpoint = f"{last.method} {self.server}{last.url}"
        delay = self.get_backoff_time()
        attempt = len(self.history)
        what = f"HTTP {last.status}" if last.status else f"connection failed ({last.error})"
        log(f"{endpoint}: {what}; retry {attempt}/{attempt + (self.total or 0)} in {delay:.1f} s")
        if self.abort.wait(delay):
            raise StageError(f"{endpoint}: stopped after another request failed")


def _failure(error: requests.RequestException, timeout: float) -> str:
    """What went wrong on the last attempt, in the words of the stage's errors."""
    reason = error.args[0] if error.args else error
    reason = getattr(reason, "reason", reason)  # MaxRetryError holds the last attempt's failure
    if isinstance(reason, NewConnectionError):
        return f"connection failed ({reason})"
    if isinstance(error, requests.Timeout) or isinstance(reason, (TimeoutError, Urllib3Timeout)):
        return f"no answer within {timeout:g} s"
    return f"connection failed ({reason})"


class ServerClient:
    """JSON over one pooled HTTP session; connection errors, timeouts and 5xx are retried with
    exponential backoff, a 4xx fails at once."""

    def __init__(self, settings: Settings, abort: threading.Event | None = None):
        self.url = settings.server_url
        self.timeout = settings.timeout
        self.retries = settings.retries
        retry = StageRetry(
            total=settings.retries,
            status_forcelist=range(500, 600),
            allowed_methods=None,  # POST /generate too: a greedy generation gives the same answer again
            backoff_factor=settings.backoff,
            backoff_max=MAX_BACKOFF_S,
            raise_on_status=False,  # the last 5xx comes back, so its body can go into the error
            respect_retry_after_header=False,
            abort=abort,
            server=self.url,
        )
        self.session = requests.Session()
        if settings.api_key:
            self.session.headers["Authorization"] = f"Bearer {settings.api_key}"
        adapter = HTTPAdapter(max_retries=retry, pool_maxsize=settings.concurrency)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.close()

    def request(self, method: str, path: str, body: Any = None) -> Any:
        endpoint = f"{method} {self.url}{path}"
        attempts = self.retries + 1
        try:
            response = self.session.request(method, self.url + path, json=body, timeout=self.timeout)
            status, raw = response.status_code, response.content
        except requests.RequestException as error:
            last = _failure(error, self.timeout)
        else:
            if status < 500:
                return self._answer(endpoint, status, raw)
            last = f"HTTP {status} {_snippet(raw)}".rstrip()
        raise StageError(
            f"{endpoint} failed {attempts} time(s), last: {last}: check that SGLang is up "
            f"(GET {self.url}/health_generate answers 200), or raise timeout/retries"
        )

    def _answer(self, endpoint: str, status: int, raw: bytes) -> Any:
        if status >= 400:
            hint = " (is this an SGLang server?)" if status in (404, 405) else ""
            raise StageError(f"{endpoint} answered HTTP {status}{hint}: {_snippet(raw) or '(empty body)'}")
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise StageError(
                f"{endpoint} answered {status} with something that is not JSON "
                f"({_snippet(raw) or 'empty body'}): is {self.url} an SGLang server?"
            ) from None

    def model_info(self) -> dict[str, Any]:
        """SGLang's /get_model_info (newer: /model_info): which weights produce the tokens."""
        try:
            info = self.request("GET", "/get_model_info")
        except StageError as error:
            if "HTTP 404" not in str(error):
                raise
            info = self.request("GET", "/model_info")
        if not isinstance(info, dict) or not isinstance(info.get("model_path"), str):
            raise StageError(
                f"GET {self.url}/get_model_info answered {_snippet(json.dumps(info))}, without a "
                "'model_path': this is not an SGLang-like server"
            )
        return {"model_path": info["model_path"], "weight_version": info.get("weight_version")}


def _snippet(raw: bytes | str, limit: int = 300) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def check_generation(
    answer: Any, prompt: Prompt, prompt_ids: list[int], max_new_tokens: int, endpoint: str
) -> dict[str, Any]:
    """Turn one /generate answer into a record, refusing anything SGLang would not have said."""

    def inconsistent(problem: str) -> StageError:
        return StageError(
            f"{endpoint} for prompt {prompt.id!r}: {problem}; got {_snippet(json.dumps(answer))}"
        )

    if not isinstance(answer, dict) or "output_ids" not in answer:
        return_keys = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
        raise inconsistent(
            f"the answer has no 'output_ids' (keys: {return_keys}): the server is not "
            "SGLang-like or too old to return token ids"
        )
    output_ids = answer["output_ids"]
    meta = answer.get("meta_info")
    if not isinstance(output_ids, list) or not all(_is_int(t) and t >= 0 for t in output_ids):
        raise inconsistent("'output_ids' is not a list of token ids")
    if not isinstance(meta, dict):
        raise inconsistent("the answer has no 'meta_info' object")
    reason = meta.get("finish_reason")
    reason_type = reason.get("type") if isinstance(reason, dict) else reason
    if reason_type == "abort":
        raise inconsistent("the server aborted the request")
    if not output_ids:
        raise inconsistent(
            f"empty output_ids where at least one token was expected (max_new_tokens={max_new_tokens})"
        )
    if len(output_ids) > max_new_tokens:
        raise inconsistent(f"{len(output_ids)} output tokens for max_new_tokens={max_new_tokens}")
    if meta.get("completion_tokens") is not None and meta["completion_tokens"] != len(output_ids):
        raise inconsistent(
            f"meta_info.completion_tokens={meta['completion_tokens']} but {len(output_ids)} output_ids"
        )
    if meta.get("prompt_tokens") is not None and meta["prompt_tokens"] != len(prompt_ids):
        raise inconsistent(
            f"meta_info.prompt_tokens={meta['prompt_tokens']} for the {len(prompt_ids)} "
            "input_ids sent: the server did not use them as given"
        )
    if not isinstance(reason_type, str):
        raise inconsistent("meta_info.finish_reason is missing")
    return {
        "id": prompt.id,
        "prompt_ids": prompt_ids,
        "output_ids": output_ids,
        "text": answer.get("text") if isinstance(answer.get("text"), str) else "",
        "finish_reason": reason_type,
        "meta_info": meta,
    }


# -- partial output --------------------------------------------------------------------------
def _matches(record: Any, prompt_ids: dict[str, list[int]]) -> bool:
    """A stored record of one of these prompts, made from the same prompt tokens."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return False
    return prompt_ids.get(record["id"]) == record.get("prompt_ids")


def read_partial(path: Path, inputs_fingerprint: str, prompt_ids: dict[str, list[int]]) -> dict[str, dict]:
    """Records a previous run of the same inputs finished; a torn last line is dropped."""
    if not path.is_file():
        return {}
    kept: dict[str, dict] = {}
    with open(path, encoding="utf-8") as handle:
        header_line = handle.readline()
        try:
            header = json.loads(header_line)
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("inputs_fingerprint") != inputs_fingerprint:
            log(f"{path.name} was made from other inputs: starting over")
            return {}
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # written when the run was interrupted: everything before it is whole
            if _matches(record, prompt_ids):
                kept[record["id"]] = record
    return kept


class PartialWriter:
    """Appends one record per line and flushes it to disk, so a kill loses at most the one in flight."""

    def __init__(self, path: Path, inputs_fingerprint: str, kept: list[dict]):
        header = json.dumps({"inputs_fingerprint": inputs_fingerprint, "partial_of": OUTPUT_NAME})
        # Rewrite first: this drops a torn last line before anything is appended after it.
        lines = [header, *(json.dumps(record, sort_keys=True) for record in kept)]
        atomic_write_text(path, "\n".join(lines) + "\n")
        self.handle = open(path, "a", encoding="utf-8")

    def append(self, record: dict) -> None:
        self.handle.write(json.dumps(record, sort_keys=True) + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        self.handle.close()


# -- the stage -------------------------------------------------------------------------------
@dataclass
class Prepared:
    settings: Settings
    prompts: list[Prompt]
    model_info: dict[str, Any]
    inputs: dict[str, Any]
    inputs_fingerprint: str


def prepare(request: dict[str, Any]) -> Prepared:
    """Everything that decides the output, without generating: cheap enough for check mode."""
    settings = parse_request(request)
    prompts = load_prompts(settings.prompts)
    identity = tokenizer_identity(settings.tokenizer)
    with ServerClient(settings) as client:
        model_info = client.model_info()
    inputs = {
        "prompts": {"sha256": sha256_file(settings.prompts), "size": settings.prompts.stat().st_size},
        "tokenizer": identity,
        "server": model_info,
        "sampling": {"temperature": TEMPERATURE, "max_new_tokens": settings.max_new_tokens},
    }
    return Prepared(settings, prompts, model_info, inputs, fingerprint(inputs))


def _summary(prepared: Prepared, changed: bool, **extra: Any) -> dict[str, Any]:
    out = prepared.settings.out_dir
    return {
        "changed": changed,
        "count": len(prepared.prompts),
        "path": str(out / OUTPUT_NAME),
        "manifest": str(out / MANIFEST_NAME),
        "inputs_fingerprint": prepared.inputs_fingerprint,
        "model_path": prepared.model_info["model_path"],
        "weight_version": prepared.model_info["weight_version"],
        **extra,
    }


def _recorded(out: Path) -> dict[str, Any]:
    """What an up-to-date output's manifest says about it, so a no-op run reports the same figures."""
    manifest = load_manifest(out) or {}
    return {
        "sha256": manifest.get("files", {}).get(OUTPUT_NAME, {}).get("sha256"),
        "finish_reasons": manifest.get("finish_reasons", {}),
    }


def plan(request: dict[str, Any]) -> dict[str, Any]:
    prepared = prepare(request)
    out = prepared.settings.out_dir
    reason = staleness(out, prepared.inputs_fingerprint)
    if reason is None:
        return _summary(prepared, False, generated=0, resumed=0, **_recorded(out))
    damaged = damaged_records(out, prepared.inputs_fingerprint, [p.id for p in prepared.prompts])
    return _summary(
        prepared,
        True,
        generated=None,
        resumed=None,
        reason=reason + (f" ({'; '.join(damaged)})" if damaged else ""),
        msg=f"would fetch {len(prepared.prompts)} completion(s) into {out / OUTPUT_NAME}",
    )


def _line_sha256(line: str) -> str:
    import hashlib

    return hashlib.sha256(line.encode("utf-8")).hexdigest()


def _recorded_lines(out: Path, inputs_fingerprint: str) -> tuple[dict[str, str], list[str]]:
    """(the manifest's sha256 per record id, the output's lines) when the manifest is of these inputs."""
    manifest = load_manifest(out) or {}
    path = out / OUTPUT_NAME
    if manifest.get("inputs_fingerprint") != inputs_fingerprint or not path.is_file():
        return {}, []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    return manifest.get("records_sha256") or {}, lines[:-1] if lines[-1] == "" else lines


def damaged_records(out: Path, inputs_fingerprint: str, ids: list[str]) -> list[str]:
    """Which lines of an output of these inputs differ from what was fetched, with the record's id.

    `ids` is the prompts' order, which is the output's: the manifest's JSON has its keys sorted, so the
    order of its per-record digests says nothing about lines."""
    recorded, lines = _recorded_lines(out, inputs_fingerprint)
    damaged = []
    for number, line in enumerate(lines, start=1):
        record_id = ids[number - 1] if number <= len(ids) else None
        if record_id is None or _line_sha256(line + "\n") != recorded.get(record_id):
            damaged.append(f"{out / OUTPUT_NAME} line {number} (id {record_id!r}) is damaged or edited")
    return damaged


def intact_records(out: Path, inputs_fingerprint: str, prompt_ids: dict[str, list[int]]) -> dict[str, dict]:
    """Records of an earlier output of these inputs that still match their sha256: a repair refetches the
    others only."""
    recorded, lines = _recorded_lines(out, inputs_fingerprint)
    kept: dict[str, dict] = {}
    for line in lines:
        digest = _line_sha256(line + "\n")
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if _matches(record, prompt_ids) and recorded.get(record["id"]) == digest:
            kept[record["id"]] = record
    return kept


def _generate(
    prepared: Prepared, prompt_ids: dict[str, list[int]], done: dict[str, dict], writer: PartialWriter
) -> None:
    settings = prepared.settings
    pending = [p for p in prepared.prompts if p.id not in done]
    abort = threading.Event()
    client = ServerClient(settings, abort)
    endpoint = f"POST {settings.server_url}/generate"
    total, first_error = len(prepared.prompts), None
    step = max(1, len(pending) // 10)

    def one(prompt: Prompt) -> dict[str, Any]:
        body = {
            "input_ids": prompt_ids[prompt.id],
            "sampling_params": {"temperature": TEMPERATURE, "max_new_tokens": settings.max_new_tokens},
        }
        answer = client.request("POST", "/generate", body)
        return check_generation(answer, prompt, prompt_ids[prompt.id], settings.max_new_tokens, endpoint)

    with client, ThreadPoolExecutor(settings.concurrency, thread_name_prefix="completions") as pool:
        futures = [pool.submit(one, prompt) for prompt in pending]
        try:
            for count, future in enumerate(as_completed(futures), start=1):
                try:
                    record = future.result()
                except CancelledError:
                    continue
                except StageError as error:
                    if first_error is None:
                        first_error = error
                        abort.set()  # in-flight retries stop; queued prompts are not sent
                        for other in futures:
                            other.cancel()
                    continue
                writer.append(record)
                done[record["id"]] = record
                if count % step == 0 or count == len(pending):
                    log(f"completions: {len(done)}/{total}")
        finally:
            abort.set()
    if first_error is not None:
        raise StageError(
            f"{first_error} ({len(done)} of {total} completions kept in "
            f"{settings.out_dir / PARTIAL_NAME}: rerun to resume)"
        )


def run(request: dict[str, Any]) -> dict[str, Any]:
    prepared = prepare(request)
    settings, out = prepared.settings, prepared.settings.out_dir
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    if is_up_to_date(out, prepared.inputs_fingerprint):
        log(f"completions: {out / OUTPUT_NAME} is up to date")
        return _summary(prepared, False, generated=0, resumed=0, **_recorded(out))

    previous = load_manifest(out)
    reason = staleness(out, prepared.inputs_fingerprint)
    damaged = damaged_records(out, prepared.inputs_fingerprint, [p.id for p in prepared.prompts])
    log(f"completions: fetching, {reason}" + "".join(f"; {problem}" for problem in damaged))
    prompt_ids = tokenize(prepared.prompts, settings.tokenizer, settings.prompts)
    intact = intact_records(out, prepared.inputs_fingerprint, prompt_ids)
    # The manifest means "complete": it goes first, so a crash below never pairs it with a new file.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    partial = out / PARTIAL_NAME
    done = {**intact, **read_partial(partial, prepared.inputs_fingerprint, prompt_ids)}
    resumed = len(done)
    if resumed:
        log(f"completions: resuming, {resumed} of {len(prepared.prompts)} already fetched")
    writer = PartialWriter(partial, prepared.inputs_fingerprint, list(done.values()))
    try:
        _generate(prepared, prompt_ids, done, writer)
    finally:
        writer.close()

    records = [done[prompt.id] for prompt in prepared.prompts]
    lines = [json.dumps(r, sort_keys=True) + "\n" for r in records]
    atomic_write_text(out / OUTPUT_NAME, "".join(lines))
    manifest = write_manifest(
        out,
        STAGE,
        prepared.inputs,
        [OUTPUT_NAME],
        count=len(records),
        server_url=settings.server_url,
        prompts_path=str(settings.prompts.resolve()),
        tokenizer_path=str(settings.tokenizer.resolve()),
        finish_reasons=dict(Counter(r["finish_reason"] for r in records)),
        # Per record, so a damaged line is named and refetched alone.
        records_sha256={r["id"]: _line_sha256(line) for r, line in zip(records, lines, strict=True)},
    )
    partial.unlink(missing_ok=True)
    log(
        f"completions: wrote {len(records)} record(s) to {out / OUTPUT_NAME}"
        + (" (replacing an output made from other inputs)" if previous else "")
    )
    return _summary(
        prepared,
        True,
        generated=len(records) - resumed,
        resumed=resumed,
        reason=reason,
        damaged=damaged,
        sha256=manifest["files"][OUTPUT_NAME]["sha256"],
        finish_reasons=manifest["finish_reasons"],
    )


def main(argv: list[str] | None = None) -> int:
    return serve(STAGE, plan, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
