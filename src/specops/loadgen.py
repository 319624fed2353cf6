"""A bounded load generator for a loopback SGLang server or router: user traffic during a rollout.

python -m specops.loadgen --url http://127.0.0.1:PORT --out results.jsonl --stop-file F
sends greedy /generate requests from a few threads until the stop file appears, max_requests were
sent or max_seconds passed (each thread back to back, or `--interval` seconds apart); each answer is
one JSON line (start, latency, status, error, and whether the request completed fully), and the
last line of stdout is the summary (requests, failed, incomplete, p50/p99 latency).
`--kinds short,long,stream,constrained` mixes short, long, streaming and constrained (regex: through the
grammar queue) requests, so requests are in flight whenever the service is paused or released. Standard
library only.

A request completed fully when it answered 200 with every token it asked for (`ignore_eos`, so the
count is known) and a finish_reason that is not an abort; a stream also had to end with
`data: [DONE]`. An aborted SGLang request answers 200 too: only the count and finish_reason tell.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

KINDS = ("short", "long", "stream", "constrained")
# A constraint any text meets: the request goes through SGLang's grammar queue (0.5.23
# srt/managers/scheduler.py:4084-4088) and still runs to its max_new_tokens.
ANY_TEXT_REGEX = r"[\s\S]*"

PROMPTS = (
    "def fibonacci(n):",
    "Write a function that reverses a string.",
    "class Stack:",
    "import numpy as np\n",
    "Sort a list of tuples by their second item.",
)


def require_loopback(url: str) -> None:
    """Refuse any address that is not this machine: the generator is for local sites only."""
    host = urlsplit(url).hostname or ""
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as error:
        raise SystemExit(f"cannot resolve {host!r} in {url}: {error}") from None
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise SystemExit(f"{url} is not a loopback address: the load generator only sends to this machine")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ok = [r["latency_s"] for r in rows if r["ok"]]
    failed = [r for r in rows if not r["ok"]]
    starts = [r["start"] for r in rows]
    return {
        "requests": len(rows),
        "failed": len(failed),
        "incomplete": sum(1 for r in rows if not r.get("complete", r["ok"])),
        "failures": [{"status": r["status"], "error": r["error"]} for r in failed[:10]],
        "p50_s": percentile(ok, 50),
        "p99_s": percentile(ok, 99),
        "mean_s": sum(ok) / len(ok) if ok else None,
        "span_s": (max(starts) - min(starts)) if starts else 0.0,
    }


class LoadGenerator:
    def __init__(
        self,
        url: str,
        concurrency: int,
        max_requests: int,
        max_seconds: float,
        max_new_tokens: int,
        timeout: float,
        stop_file: Path | None,
        kinds: Sequence[str] = ("short",),
        long_max_new_tokens: int = 64,
        api_key: str | None = None,
        interval: float = 0.0,
    ):
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown or not kinds:
            raise ValueError(f"request kinds {unknown or kinds} unknown: use some of {', '.join(KINDS)}")
        self.kinds = tuple(kinds)
        self.long_max_new_tokens = long_max_new_tokens
        self.api_key = api_key
        self.interval = interval
        self.url = url.rstrip("/") + "/generate"
        self.concurrency = concurrency
        self.max_requests = max_requests
        self.deadline = time.monotonic() + max_seconds
        self.max_new_tokens = max_new_tokens
        self.timeout = timeout
        self.stop_file = stop_file
        self.rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._sent = 0

    def _next(self) -> int | None:
        with self._lock:
            if self._sent >= self.max_requests or time.monotonic() >= self.deadline:
                return None
            if self.stop_file is not None and self.stop_file.exists():
                return None
            self._sent += 1
            return self._sent - 1

    def _one(self, number: int) -> dict[str, Any]:
        kind = self.kinds[number % len(self.kinds)]
        expected = self.max_new_tokens if kind in ("short", "constrained") else self.long_max_new_tokens
        body: dict[str, Any] = {
            "text": PROMPTS[number % len(PROMPTS)],
            "sampling_params": {"max_new_tokens": expected, "temperature": 0, "ignore_eos": True},
        }
        if kind == "stream":
            body["stream"] = True
        if kind == "constrained":
            body["sampling_params"]["regex"] = ANY_TEXT_REGEX
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), method="POST", headers=headers
        )
        start, status, error = time.time(), -1, None
        began = time.monotonic()
        final: dict[str, Any] = {}
        done = False
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                status = response.status
                if kind == "stream":
                    final, done = read_stream(response)
                else:
                    final = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            status, error = exc.code, exc.read()[:200].decode("utf-8", "replace")
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        meta = (final.get("meta_info") or {}) if isinstance(final, dict) else {}
        finish = meta.get("finish_reason")
        tokens = meta.get("completion_tokens")
        complete = (
            status == 200
            and tokens == expected
            and not (isinstance(finish, dict) and finish.get("type") == "abort")
            and (done or kind != "stream")
        )
        return {
            "n": number,
            "kind": kind,
            "start": start,
            "latency_s": time.monotonic() - began,
            "status": status,
            "ok": status == 200,
            "error": error,
            "expected_tokens": expected,
            "completion_tokens": tokens,
            "finish_reason": finish,
            "done": done if kind == "stream" else None,
            "complete": complete,
        }

    def _worker(self) -> None:
        while (number := self._next()) is not None:
            row = self._one(number)
            with self._lock:
                self.rows.append(row)
            # Paced traffic: a user's requests keep coming without holding the server busy all the time.
            if self.interval > 0:
                time.sleep(self.interval)

    def run(self) -> list[dict[str, Any]]:
        threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(self.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sorted(self.rows, key=lambda r: r["n"])


def read_stream(response: Any) -> tuple[dict[str, Any], bool]:
    """SGLang's server-sent events: (the last JSON chunk, whether `data: [DONE]` ended the stream)."""
    last: dict[str, Any] = {}
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return last, True
        chunk = json.loads(data)
        if isinstance(chunk, dict) and "error" in chunk:
            raise ValueError(f"stream error: {chunk['error']}")
        last = chunk
    return last, False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specops.loadgen", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="base URL of a loopback server or router")
    parser.add_argument("--out", required=True, help="JSONL file for one line per request")
    parser.add_argument("--stop-file", help="stop sending once this file exists")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-requests", type=int, default=2000)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one answer")
    parser.add_argument(
        "--kinds", default="short", help=f"comma-separated request kinds, taken in turn ({', '.join(KINDS)})"
    )
    parser.add_argument(
        "--long-max-new-tokens", type=int, default=64, help="tokens of a long or streaming request"
    )
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    parser.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="seconds each thread waits after an answer before its next request (default 0: back to back)",
    )
    args = parser.parse_args(argv)
    require_loopback(args.url)
    generator = LoadGenerator(
        args.url,
        args.concurrency,
        args.max_requests,
        args.max_seconds,
        args.max_new_tokens,
        args.timeout,
        Path(args.stop_file) if args.stop_file else None,
        kinds=[k.strip() for k in args.kinds.split(",") if k.strip()],
        long_max_new_tokens=args.long_max_new_tokens,
        api_key=args.api_key,
        interval=args.interval,
    )
    rows = generator.run()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps(summarize(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
