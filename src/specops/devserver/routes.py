"""SGLang's HTTP endpoints mapped onto the engine: one handler, one method per endpoint."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from specops.devserver.engine import Engine
from specops.devserver.memory import MemorySaver, parse_tags
from specops.devserver.protocol import RequestError, error_body, parse_generate

logger = logging.getLogger("specops.devserver")

HEALTH_CHECK_TIMEOUT = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
QUIET_PATHS = ("/health", "/health_generate")


@dataclass
class App:
    engine: Engine
    memory: MemorySaver
    server_args: dict[str, Any]
    strict: bool = True
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

    def _send(self, status: int, body: Any = None) -> None:
        data = b"" if body is None else json.dumps(body).encode("utf-8")
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

    def _dispatch(self, routes: dict[str, Any]) -> None:
        path = self.path.split("?")[0]
        route = routes.get(path)
        try:
            if route is None:
                raise RequestError(404, f"no endpoint {self.command} {path} on this server")
            route()
        except RequestError as error:
            self._send(error.status, error_body(error.status, error.message))
        except Exception as error:  # a bug, not the client's fault: say so and keep serving
            logger.exception("%s %s failed", self.command, path)
            self._send(500, error_body(500, f"internal error: {error}"))

    def do_GET(self) -> None:
        self._dispatch(
            {
                "/health": self.health,
                "/health_generate": self.health,
                "/v1/models": self.models,
                "/get_model_info": self.model_info,
                "/model_info": self.model_info,
                "/get_server_info": self.server_info,
                "/server_info": self.server_info,
                "/get_weight_version": self.weight_version,
                "/get_load": self.load,
                "/flush_cache": self.flush_cache,
            }
        )

    def do_POST(self) -> None:
        self._dispatch(
            {
                "/generate": self.generate,
                "/flush_cache": self.flush_cache,
                "/release_memory_occupation": self.release_memory,
                "/resume_memory_occupation": self.resume_memory,
                "/pause_generation": self.pause_generation,
                "/continue_generation": self.continue_generation,
            }
        )

    do_PUT = do_POST

    # -- endpoints ---------------------------------------------------------------------------
    def health(self) -> None:
        healthy = self.app.engine.health(HEALTH_CHECK_TIMEOUT)
        self._send(200 if healthy else 503)

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
        self._send(
            200,
            {
                **self.app.server_args,
                "status": engine.status.value,
                "internal_states": [
                    {"pending_requests": engine.pending, "released_memory_tags": sorted(engine.released_tags)}
                ],
                "version": "specops-devserver",
            },
        )

    def load(self) -> None:
        # One entry per data-parallel rank, as SGLang's GetLoadReqOutput (managers/io_struct.py):
        # a router drain waits on it until no request is left in flight.
        self._send(
            200, [{"dp_rank": 0, "num_reqs": self.app.engine.pending, "num_waiting_reqs": 0, "num_tokens": 0}]
        )

    def flush_cache(self) -> None:
        # SGLang refuses to flush while requests run or wait, and answers plain text either way
        # (entrypoints/http_server.py `flush_cache` at sgl-project/sglang 0025436e).
        if self.app.strict:
            self._send_text(
                400 if self.app.engine.pending else 200,
                "Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n",
            )
        elif self.app.engine.pending:
            self._send(
                400, error_body(400, f"{self.app.engine.pending} request(s) pending: cache not flushed")
            )
        else:
            self._send(200, {"success": True, "message": "Cache flushed."})

    def generate(self) -> None:
        request = parse_generate(self._body())
        results = self.app.engine.generate(request.items)
        self._send(200, results if request.batched else results[0])

    def pause_generation(self) -> None:
        # JSON body as in http_server.py `pause_generation` at 0025436e.
        self.app.engine.pause()
        self._send(200, {"message": "Generation paused successfully.", "status": "ok"})

    def continue_generation(self) -> None:
        self.app.engine.resume_generation()
        self._send(200, {"message": "Generation continued successfully.", "status": "ok"})

    def release_memory(self) -> None:
        self._send(200, self.app.memory.release(parse_tags(self._body())))

    def resume_memory(self) -> None:
        self._send(200, self.app.memory.resume(parse_tags(self._body())))
