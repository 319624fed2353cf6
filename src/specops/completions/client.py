"""The HTTP client of the completions stage: JSON over one pooled session to the SGLang server, with
connection errors, timeouts and 5xx answers retried under exponential backoff and a 4xx failing at once.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3 import BaseHTTPResponse
from urllib3.exceptions import NewConnectionError
from urllib3.exceptions import TimeoutError as Urllib3Timeout
from urllib3.util.retry import Retry

from specops.completions.request import Settings
from specops.stage import StageError, log

MAX_BACKOFF_S = 30.0


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
            last = f"HTTP {status} {snippet(raw)}".rstrip()
        raise StageError(
            f"{endpoint} failed {attempts} time(s), last: {last}: check that SGLang is up "
            f"(GET {self.url}/health_generate answers 200), or raise timeout/retries"
        )

    def _answer(self, endpoint: str, status: int, raw: bytes) -> Any:
        if status >= 400:
            hint = " (is this an SGLang server?)" if status in (404, 405) else ""
            raise StageError(f"{endpoint} answered HTTP {status}{hint}: {snippet(raw) or '(empty body)'}")
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise StageError(
                f"{endpoint} answered {status} with something that is not JSON "
                f"({snippet(raw) or 'empty body'}): is {self.url} an SGLang server?"
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
                f"GET {self.url}/get_model_info answered {snippet(json.dumps(info))}, without a "
                "'model_path': this is not an SGLang-like server"
            )
        return {"model_path": info["model_path"], "weight_version": info.get("weight_version")}


def snippet(raw: bytes | str, limit: int = 300) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
