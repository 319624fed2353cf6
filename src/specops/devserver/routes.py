"""SGLang's HTTP endpoints mapped onto the engine: one handler, one method per endpoint."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from specops.devserver.auth import REFUSALS, auth_status
from specops.devserver.engine import Engine
from specops.devserver.memory import MemorySaver, parse_tags, scheduler_crash
from specops.devserver.protocol import Item, RequestError, error_body, parse_generate
from specops.devserver.release_faults import release_fault
from specops.devserver.streaming import DONE, ClientGone, TokenStream, error_event
from specops.devserver.versions import DEFAULT_VERSION, VERSIONS, SGLangVersion

logger = logging.getLogger("specops.devserver")

# entrypoints/http_server.py:218 (0.5.23): read once, as an integer number of seconds.
HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
QUIET_PATHS = ("/health", "/health_generate")
FLUSHED_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
EMPTY = object()  # no body at all, where `None` is sent as JSON `null`
# FastAPI's answer for a path with no route.
NOT_FOUND = {"detail": "Not Found"}


@dataclass
class App:
    engine: Engine
    memory: MemorySaver
    server_args: dict[str, Any]
    strict: bool = True
    version: SGLangVersion = VERSIONS[DEFAULT_VERSION]
    api_key: str | None = None
    admin_api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def served_model_name(self) -> str:
        return self.server_args.get("served_model_name") or self.engine.model_path


class DevHTTPServer(ThreadingHTTPServer):
    # Join request threads on close, so SIGTERM lets in-flight answers go out before exit.
    daemon_threads = False
    block_on_close = True

    def __init__(self, address: tuple[str, int], app: App | None = None):
        super().__init__(address, Handler)
        self.app = app


class Handler(BaseHTTPRequestHandler):
    server: DevHTTPServer
    server_version = "specops-devserver"
    timeout = 60  # a client that connects and never sends a request does not hold shutdown forever

    # -- plumbing ----------------------------------------------------------------------------
    @property
    def app(self) -> App:
        assert self.server.app is not None
        return self.server.app

    def log_message(self, format: str, *args: Any) -> None:
        path = getattr(self, "path", "").split("?")[0]
        level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
        logger.log(level, "%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: Any = EMPTY) -> None:
        data = b"" if body is EMPTY else json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, status: int, text: str) -> None:
        data = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as error:
            raise RequestError(400, f"the body is not JSON: {error}") from None

    def _query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.path).query)

    def _dispatch(self, routes: dict[str, Any]) -> None:
        path = self.path.split("?")[0]
        app = self.app
        status = auth_status(
            app.version, app.api_key, app.admin_api_key, self.command, path, self.headers.get("Authorization")
        )
        if status != 200:
            self._send(status, REFUSALS[status])
            return
        route = routes.get(path)
        try:
            if route is None:
                if app.strict:
                    self._send(404, NOT_FOUND)
                    return
                raise RequestError(404, f"no endpoint {self.command} {path} on this server")
            route()
        except RequestError as error:
            self._send(error.status, error_body(error.status, error.message))
        except Exception as error:  # a bug, not the client's fault: say so and keep serving
            logger.exception("%s %s failed", self.command, path)
            self._send(500, error_body(500, f"internal error: {error}"))

    def _served(self, routes: dict[str, Any]) -> dict[str, Any]:
        """The version's info and load paths; forgiving serves every name."""
        version = self.app.version
        optional = (
            "/server_info",
            "/get_server_info",
            "/model_info",
            "/get_model_info",
            "/get_load",
            "/v1/loads",
        )
        if self.app.strict:
            keep = set(version.info_paths) | {version.load_path}
            served = {path: route for path, route in routes.items() if path not in optional or path in keep}
            if not version.has_ready:
                served.pop("/ready", None)
            if not version.has_weights_checker:
                served.pop("/weights_checker", None)
            return served
        return routes

    def do_GET(self) -> None:
        self._dispatch(
            self._served(
                {
                    "/health": self.health,
                    "/health_generate": self.health,
                    "/ready": self.ready,
                    "/v1/models": self.models,
                    "/get_model_info": self.model_info,
                    "/model_info": self.model_info,
                    "/get_server_info": self.server_info,
                    "/server_info": self.server_info,
                    "/get_weight_version": self.weight_version,
                    "/get_load": self.load,
                    "/v1/loads": self.loads,
                    "/flush_cache": self.flush_cache,
                    "/weights_checker": self.weights_checker,
                }
            )
        )

    def do_POST(self) -> None:
        self._dispatch(
            self._served(
                {
                    "/generate": self.generate,
                    "/flush_cache": self.flush_cache,
                    "/release_memory_occupation": self.release_memory,
                    "/resume_memory_occupation": self.resume_memory,
                    "/pause_generation": self.pause_generation,
                    "/continue_generation": self.continue_generation,
                    "/weights_checker": self.weights_checker,
                }
            )
        )

    do_PUT = do_POST

    # -- endpoints ---------------------------------------------------------------------------
    def health(self) -> None:
        healthy = self.app.engine.health(HEALTH_CHECK_TIMEOUT)
        self._send(200 if healthy else 503)

    def ready(self) -> None:
        self._send(200 if self.app.engine.is_ready() else 503)

    def weights_checker(self) -> None:
        """0.5.23 entrypoints/http_server.py:1599-1620: action checksum; 400 with success false otherwise."""
        body = self._body() or {}
        action = body.get("action", "checksum") if isinstance(body, dict) else None
        if action != "checksum":
            self._send(400, {"success": False, "message": f"Unsupported action={action!r}"})
            return
        self.app.engine.note_scheduler_message()
        rank = self.app.engine.weights_checksum()
        rank["parallelism_info"] = {
            "role": "target",
            "tp_rank": 0,
            "tp_size": 1,
            "dp_rank": 0,
            "dp_size": 1,
            "pp_rank": 0,
            "pp_size": 1,
            "rank": 0,
            "size": 1,
        }
        # tokenizer_control_mixin.py:890-915: one sha256 over the ranks' per-GPU checksums.
        engine_checksum = hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
        self._send(
            200,
            {"success": True, "message": "Success.", "ranks": [rank], "per_engine_checksum": engine_checksum},
        )

    def models(self) -> None:
        self._send(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": self.app.served_model_name,
                        "object": "model",
                        "created": self.app.created,
                        "owned_by": "sglang",
                        "root": self.app.engine.model_path,
                    }
                ],
            },
        )

    def model_info(self) -> None:
        engine = self.app.engine
        self._send(
            200,
            {
                "model_path": engine.model_path,
                "tokenizer_path": self.app.server_args.get("tokenizer_path") or engine.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": engine.weight_version,
            },
        )

    def weight_version(self) -> None:
        self._send(200, {"weight_version": self.app.engine.weight_version})

    def server_info(self) -> None:
        engine = self.app.engine
        engine.note_scheduler_message()
        # Every server argument, both keys included, as SGLang answers (0.5.23 server_args.py:316-333
        # redacts only watermark secrets).
        args = dict(self.app.server_args)
        self._send(
            200,
            {
                **args,
                "status": engine.status.value,
                "internal_states": [
                    {
                        "pending_requests": engine.pending,
                        "running_requests": engine.count("running"),
                        "waiting_requests": engine.count("waiting"),
                        "paused": engine.paused,
                        "released_memory_tags": sorted(engine.released_tags),
                        "memory_usage": self.app.memory.memory_usage(),
                    }
                ],
                "version": self.app.version.name,
                "memory_saver_backend": self.app.memory.backend_name,
            },
        )

    def load(self) -> None:
        # 0.5.4 scheduler.py:2379 `GetLoadReqOutput`: num_reqs counts running and waiting requests.
        engine = self.app.engine
        if self.app.version.load_asks_scheduler:
            engine.note_scheduler_message()
        running, waiting = engine.count("running"), engine.count("waiting")
        self._send(
            200, [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": 0}]
        )

    def loads(self) -> None:
        # 0.5.23 entrypoints/v1_loads.py:96 and managers/load_snapshot.py `LoadSnapshot` (core keys and
        # queues, :179-186). A snapshot read, not a scheduler answer: no sign of life for a health check.
        engine = self.app.engine
        self._send(
            200,
            {
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "version": self.app.version.name,
                "accelerator": None,
                "num_accelerators": 1,
                "loads": [
                    {
                        "timestamp": time.time(),
                        "dp_rank": 0,
                        "num_running_reqs": engine.count("running"),
                        "num_waiting_reqs": engine.count("waiting"),
                        "num_used_tokens": 0,
                        "num_total_tokens": 0,
                        "queues": {
                            "waiting": engine.count("waiting"),
                            "grammar": engine.count("grammar"),
                            "paused": 0,
                            "retracted": 0,
                            "prealloc_ready": 0,
                        },
                    }
                ],
            },
        )

    def flush_cache(self) -> None:
        """Plain text either way (http_server.py:1025, 0.5.23): 400 unless the scheduler is idle."""
        app, engine = self.app, self.app.engine
        engine.note_scheduler_message()
        if not app.strict:
            if engine.pending:
                self._send(400, error_body(400, f"{engine.pending} request(s) pending: cache not flushed"))
            else:
                self._send(200, {"success": True, "message": "Cache flushed."})
            return
        # flush_wrapper.py (0.5.23): `?timeout=` waits for idleness that long; 0 answers at once.
        timeout = float((self._query().get("timeout") or ["0"])[0]) if app.version.name != "0.5.4" else 0.0
        deadline = time.monotonic() + timeout
        while True:
            idle = self._idle_for_flush()
            if idle or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if idle:
            self._send_text(200, FLUSHED_TEXT)
        elif not app.version.flush_failure_text:
            self._send_text(400, FLUSHED_TEXT)
        else:
            self._send_text(
                400, "Timed out waiting for idle state." if timeout > 0 else "Flush cache failed.\n"
            )

    def _idle_for_flush(self) -> bool:
        """scheduler.py:5520 (0.5.23): idle, ignoring waiting requests while the scheduler is paused."""
        engine = self.app.engine
        if not engine.lock.acquire(blocking=False):
            return False
        try:
            return engine.is_fully_idle(ignore_waiting=engine.scheduler_paused)
        finally:
            engine.lock.release()

    def generate(self) -> None:
        body = self._body()
        request = parse_generate(body)
        if isinstance(body, dict) and body.get("stream"):
            self._generate_stream(request.items)
            return
        results = self.app.engine.generate(request.items)
        self._send(200, results if request.batched else results[0])

    def _generate_stream(self, items: list[Item]) -> None:
        engine = self.app.engine
        engine.wait_unpaused()
        engine.require_available()
        items = [dataclasses.replace(item, rid=item.rid or uuid.uuid4().hex) for item in items]
        prompts = [engine.prompt_ids(item) for item in items]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.close_connection = True
        streams = [
            TokenStream(self.wfile, engine.decode_text, item.rid or "", len(ids))
            for item, ids in zip(items, prompts, strict=True)
        ]
        as_ids = [
            Item(text=None, input_ids=ids, rid=item.rid, params=item.params)
            for item, ids in zip(items, prompts, strict=True)
        ]
        try:
            for item, stream in zip(as_ids, streams, strict=True):
                result = engine.generate([item], on_tokens=[stream])[0]
                stream.write(result)
            streams[0].send(DONE)
        except ClientGone:
            logger.info("client disconnected: stream aborted")
        except RequestError as error:
            streams[0].send(error_event(error.status, error.message) + DONE)

    def pause_generation(self) -> None:
        # http_server.py:1831 (0.5.23): PauseGenerationReqInput, mode abort (default), retract or in_place.
        version, body = self.app.version, self._body()
        mode = "abort"
        if version.name != "0.5.4":
            if body is not None and not isinstance(body, dict):
                raise RequestError(422, 'the body must be a JSON object such as {"mode": "retract"}')
            mode = (body or {}).get("mode", "abort")
            if mode not in version.pause_modes:
                raise RequestError(422, f"mode must be one of {', '.join(version.pause_modes)}, got {mode!r}")
        # Not a sign of life: the retract and in-place pauses are sent to the scheduler, which does not
        # answer them (0.5.23 managers/tokenizer_manager.py:2267-2271, 703-706).
        self.app.engine.pause(mode)
        self._send(200, {"message": "Generation paused successfully.", "status": "ok"})

    def continue_generation(self) -> None:
        # Sent to the scheduler without an answer (tokenizer_manager.py:2282-2286): the health check's own
        # request, let through the door, is what can make it pass.
        self.app.engine.resume_generation()
        self._send(200, {"message": "Generation continued successfully.", "status": "ok"})

    def release_memory(self) -> None:
        tags = parse_tags(self._body())
        fault = release_fault(self.app.server_args.get("release_fault_file"))
        if fault == "busy":
            scheduler_crash(
                "AssertionError: release_memory_occupation should be called only when server is idle."
            )
        if fault == "lost":
            self.close_connection = True
            return
        self.app.memory.release(tags)
        self.app.engine.note_scheduler_message()
        if fault == "unanswered":
            self.close_connection = True
            return
        self._send(200, None if self.app.strict else {"success": True})

    def resume_memory(self) -> None:
        self.app.memory.resume(parse_tags(self._body()))
        self.app.engine.note_scheduler_message()
        self._send(200, None if self.app.strict else {"success": True})
