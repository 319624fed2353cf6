"""specops.loadgen: loopback only, bounded, and every answer counted."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specops.loadgen import LoadGenerator, percentile, require_loopback, summarize


def test_a_non_loopback_address_is_refused():
    with pytest.raises(SystemExit, match="not a loopback address"):
        require_loopback("http://192.0.2.1:30000")


def test_loopback_addresses_are_accepted():
    require_loopback("http://127.0.0.1:30000")
    require_loopback("http://localhost:30000")


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([], 50) is None


class Flaky(BaseHTTPRequestHandler):
    """Answers every third /generate with 503."""

    count = 0
    lock = threading.Lock()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        with Flaky.lock:
            Flaky.count += 1
            fail = Flaky.count % 3 == 0
        body = json.dumps({"text": "x"}).encode()
        self.send_response(503 if fail else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_generator_stops_at_max_requests_and_counts_failed_answers():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        rows = LoadGenerator(
            url, concurrency=2, max_requests=9, max_seconds=30, max_new_tokens=1, timeout=5, stop_file=None
        ).run()
    finally:
        server.shutdown()
    summary = summarize(rows)
    assert summary["requests"] == 9
    assert summary["failed"] == 3
    assert {f["status"] for f in summary["failures"]} == {503}


def test_a_paced_thread_waits_the_interval_after_each_answer():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        rows = LoadGenerator(
            url,
            concurrency=1,
            max_requests=4,
            max_seconds=30,
            max_new_tokens=1,
            timeout=5,
            stop_file=None,
            interval=0.2,
        ).run()
    finally:
        server.shutdown()
    assert len(rows) == 4
    # Each request starts at least the interval after the previous one was answered (a lower bound:
    # a loaded machine only makes the gap longer).
    for earlier, later in zip(rows, rows[1:], strict=False):
        assert later["start"] - (earlier["start"] + earlier["latency_s"]) >= 0.19


class Recording(BaseHTTPRequestHandler):
    """Keeps every /generate body and answers it complete."""

    bodies: list = []

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Recording.bodies.append(request)
        tokens = request["sampling_params"]["max_new_tokens"]
        meta = {"completion_tokens": tokens, "finish_reason": "length"}
        body = json.dumps({"text": "x", "meta_info": meta})
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_a_constrained_request_carries_a_regex_any_text_meets_and_is_short():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        rows = LoadGenerator(
            url, 1, 2, 30, max_new_tokens=3, timeout=5, stop_file=None, kinds=("short", "constrained")
        ).run()
    finally:
        server.shutdown()
    plain, constrained = Recording.bodies
    assert "regex" not in plain["sampling_params"]
    assert re.fullmatch(constrained["sampling_params"]["regex"], "any\ntext {}") is not None
    assert constrained["sampling_params"]["max_new_tokens"] == 3
    assert [row["complete"] for row in rows] == [True, True]
