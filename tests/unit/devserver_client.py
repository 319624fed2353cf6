"""A minimal HTTP client for the development server's tests: status and decoded body, errors included."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def call(
    url: str,
    path: str,
    body: object = None,
    method: str | None = None,
    timeout: float = 120,
    headers: dict[str, str] | None = None,
) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path,
        data=data,
        method=method or ("POST" if data else "GET"),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, _decoded(response.read())
    except urllib.error.HTTPError as error:
        return error.code, _decoded(error.read())


def _decoded(raw: bytes) -> object:
    """JSON where the endpoint answers JSON; plain text (SGLang's /flush_cache) otherwise."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.decode("utf-8")
