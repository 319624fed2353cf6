"""`"stream": true` on /generate: server-sent events shaped as SGLang sends them.

entrypoints/http_server.py:951 (0.5.23): every chunk is `data: <json>\n\n`, the stream ends with
`data: [DONE]\n\n`, also after an abort (whose last chunk carries finish_reason type "abort") and
after an error (a chunk `{"error": {...}}`). Without --incremental-streaming-output (the default)
each chunk holds the text and output_ids decoded so far (tokenizer_manager.py:2650).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import IO, Any

DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed the stream; the request is aborted."""


def event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode("utf-8") + b"\n\n"


def error_event(status: int, message: str) -> bytes:
    """http_server.py:963: the error chunk of a stream that failed after it started."""
    return event(
        {"error": {"message": message, "type": "invalid_request_error", "code": status, "retryable": False}}
    )


class TokenStream:
    """Writes one chunk per decoded step: the text and ids so far, finish_reason null until the end."""

    def __init__(
        self, out: IO[bytes] | Any, decode: Callable[[list[int]], str], rid: str, prompt_tokens: int
    ):
        self.out = out
        self.decode = decode
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.sent = 0
        self.gone = False

    def __call__(self, output_ids: list[int]) -> None:
        if self.gone or len(output_ids) <= self.sent:
            return
        self.sent = len(output_ids)
        self.write(
            {
                "text": self.decode(output_ids),
                "output_ids": list(output_ids),
                "meta_info": {
                    "id": self.rid,
                    "finish_reason": None,
                    "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": len(output_ids),
                },
            }
        )

    def write(self, payload: Any) -> None:
        self.send(event(payload))

    def send(self, data: bytes) -> None:
        if self.gone:
            return
        try:
            self.out.write(data)
            self.out.flush()
        except OSError as error:
            # Raised inside the decode, it ends the request as SGLang aborts a disconnected one.
            self.gone = True
            raise ClientGone(str(error)) from error
