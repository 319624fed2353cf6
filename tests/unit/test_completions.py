"""The completions stage fetches the target's exact greedy tokens from an SGLang-like server."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specops import completions
from specops.devserver.launch import SRC_DIR, DevServerProcess, http_status
from specops.manifest import load_manifest, sha256_file, write_manifest
from specops.stage import StageError

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def server(fixture_models, tmp_path_factory):
    process = DevServerProcess(
        fixture_models.target, log_path=tmp_path_factory.mktemp("sglang") / "server.log"
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def expected(fixture_models):
    """Prompt and output ids computed in the test: the tokenizer's, and transformers' greedy generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # as the server runs, so float reduction order cannot differ
    tokenizer = AutoTokenizer.from_pretrained(fixture_models.target)
    model = AutoModelForCausalLM.from_pretrained(fixture_models.target).eval()
    result = {}
    for line in fixture_models.prompts.read_text().splitlines():
        record = json.loads(line)
        if "messages" in record:
            ids = list(
                tokenizer.apply_chat_template(
                    record["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        else:
            ids = tokenizer(record["prompt"]).input_ids
        inputs = torch.tensor([ids])
        out = model.generate(
            inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=MAX_NEW_TOKENS
        )
        result[record["id"]] = {
            "prompt_ids": ids,
            "output_ids": out[0, len(ids) :].tolist(),
            "chat": "messages" in record,
        }
    return result


def small_prompts(fixture_models, path: Path, count: int = 2) -> Path:
    """The first plain and the first chat prompt (or the first `count` lines): quick to generate."""
    lines = fixture_models.prompts.read_text().splitlines()
    chosen = [next(li for li in lines if '"prompt"' in li), next(li for li in lines if '"messages"' in li)]
    chosen = chosen[:count] if count <= 2 else lines[:count]
    path.write_text("\n".join(chosen) + "\n")
    return path


def make_request(fixture_models, out_dir: Path, url: str, **overrides) -> dict:
    return {
        "server_url": url,
        "prompts": str(fixture_models.prompts),
        "tokenizer": str(fixture_models.target),
        "out_dir": str(out_dir),
        "max_new_tokens": MAX_NEW_TOKENS,
        "concurrency": 2,
        "timeout": 120,
        "retries": 2,
        "backoff": 0.1,
        **overrides,
    }


def read_records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / completions.OUTPUT_NAME).read_text().splitlines()]


@contextlib.contextmanager
def stub_server(routes: dict):
    """A tiny HTTP server answering `routes[(method, path)] -> (status, json body)`; 404 otherwise."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            status, body = routes.get((self.command, self.path), (404, {"detail": "Not Found"}))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


# -- exact tokens ----------------------------------------------------------------------------
def test_plain_and_chat_prompts_get_the_models_own_greedy_tokens(server, fixture_models, expected, tmp_path):
    result = completions.run(make_request(fixture_models, tmp_path / "out", server.url))
    records = read_records(tmp_path / "out")
    assert result["changed"] is True and result["count"] == len(expected) == len(records)
    assert {r["id"]: r["prompt_ids"] for r in records} == {k: v["prompt_ids"] for k, v in expected.items()}
    assert {r["id"]: r["output_ids"] for r in records} == {k: v["output_ids"] for k, v in expected.items()}
    assert any(v["chat"] for v in expected.values()) and not all(v["chat"] for v in expected.values())


def test_records_keep_prompt_order_and_the_manifest_says_what_made_them(server, fixture_models, tmp_path):
    out = tmp_path / "out"
    completions.run(
        make_request(
            fixture_models, out, server.url, prompts=str(small_prompts(fixture_models, tmp_path / "p.jsonl"))
        )
    )
    records = read_records(out)
    prompt_ids = [json.loads(line)["id"] for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == prompt_ids
    assert set(records[0]) == {"id", "prompt_ids", "output_ids", "text", "finish_reason", "meta_info"}
    assert records[0]["finish_reason"] in ("stop", "length")
    manifest = load_manifest(out)
    assert manifest["inputs"]["server"] == {
        "model_path": str(fixture_models.target),
        "weight_version": "default",
    }
    assert manifest["inputs"]["sampling"] == {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}
    assert manifest["count"] == 2
    assert manifest["files"][completions.OUTPUT_NAME]["sha256"] == sha256_file(out / completions.OUTPUT_NAME)
    assert not (out / completions.PARTIAL_NAME).exists()


# -- reruns ----------------------------------------------------------------------------------
def test_a_rerun_with_the_same_inputs_changes_nothing(server, fixture_models, tmp_path):
    request = make_request(
        fixture_models,
        tmp_path / "out",
        server.url,
        prompts=str(small_prompts(fixture_models, tmp_path / "p.jsonl", 1)),
    )
    completions.run(request)
    written = (tmp_path / "out" / completions.OUTPUT_NAME).stat().st_mtime_ns
    again = completions.run(request)
    assert again["changed"] is False and again["generated"] == 0
    assert (tmp_path / "out" / completions.OUTPUT_NAME).stat().st_mtime_ns == written


def test_plan_says_what_would_change_and_writes_nothing(server, fixture_models, tmp_path):
    request = make_request(
        fixture_models,
        tmp_path / "out",
        server.url,
        prompts=str(small_prompts(fixture_models, tmp_path / "p.jsonl", 1)),
    )
    assert completions.plan(request)["changed"] is True
    assert not (tmp_path / "out").exists()
    completions.run(request)
    assert completions.plan(request)["changed"] is False
    assert completions.plan({**request, "max_new_tokens": MAX_NEW_TOKENS + 1})["changed"] is True


def test_an_edited_token_id_of_the_same_size_is_named_and_a_rerun_restores_it(
    server, fixture_models, tmp_path
):
    out = tmp_path / "out"
    request = make_request(
        fixture_models, out, server.url, prompts=str(small_prompts(fixture_models, tmp_path / "p.jsonl", 2))
    )
    completions.run(request)
    path = out / completions.OUTPUT_NAME
    fetched = path.read_bytes()
    lines = fetched.decode().splitlines(keepends=True)
    record = json.loads(lines[1])
    token = record["output_ids"][0]
    record["output_ids"][0] = token - token % 10 + (token + 1) % 10  # another last digit: the same size
    lines[1] = json.dumps(record, sort_keys=True) + "\n"
    path.write_text("".join(lines))
    assert path.stat().st_size == len(fetched)
    planned = completions.plan(request)
    assert planned["changed"] is True
    assert f"{path} line 2 (id {record['id']!r}) is damaged or edited" in planned["reason"]
    repaired = completions.run(request)
    assert repaired["generated"] == 1
    now = path.read_text().splitlines(keepends=True)
    assert now[0] == fetched.decode().splitlines(keepends=True)[0]  # the intact record is kept as it was
    assert tokens_of(now) == tokens_of(fetched.decode().splitlines())


def test_only_the_edited_line_is_named_whatever_the_order_of_the_ids(tmp_path):
    # The output follows the prompts' order; the manifest's JSON sorts its keys: lines are not matched by
    # the position of the manifest's digests (here the ids are in reverse alphabetical order).
    records = [{"id": name, "output_ids": [index, index + 1]} for index, name in enumerate(["c", "b", "a"])]
    lines = [json.dumps(record, sort_keys=True) + "\n" for record in records]
    (tmp_path / completions.OUTPUT_NAME).write_text("".join(lines))
    write_manifest(
        tmp_path,
        completions.STAGE,
        {"prompts": "p"},
        [completions.OUTPUT_NAME],
        records_sha256={
            r["id"]: hashlib.sha256(line.encode()).hexdigest() for r, line in zip(records, lines, strict=True)
        },
    )
    fingerprint = load_manifest(tmp_path)["inputs_fingerprint"]
    ids = [record["id"] for record in records]
    assert completions.damaged_records(tmp_path, fingerprint, ids) == []
    lines[1] = json.dumps(dict(records[1], output_ids=[9, 2]), sort_keys=True) + "\n"
    (tmp_path / completions.OUTPUT_NAME).write_text("".join(lines))

    assert completions.damaged_records(tmp_path, fingerprint, ids) == [
        f"{tmp_path / completions.OUTPUT_NAME} line 2 (id 'b') is damaged or edited"
    ]


def tokens_of(lines):
    return [(json.loads(line)["prompt_ids"], json.loads(line)["output_ids"]) for line in lines]


def test_a_garbled_line_is_refetched_by_a_rerun(server, fixture_models, tmp_path):
    out = tmp_path / "out"
    request = make_request(
        fixture_models, out, server.url, prompts=str(small_prompts(fixture_models, tmp_path / "p.jsonl", 2))
    )
    completions.run(request)
    path = out / completions.OUTPUT_NAME
    fetched = path.read_bytes()
    path.write_bytes(fetched.replace(b"{", b"#", 1))
    assert completions.run(request)["changed"] is True
    assert tokens_of(path.read_text().splitlines()) == tokens_of(fetched.decode().splitlines())


def test_an_interrupted_run_resumes_where_it_stopped(server, fixture_models, expected, tmp_path):
    out = tmp_path / "out"
    request = make_request(fixture_models, out, server.url, concurrency=1)
    partial = out / completions.PARTIAL_NAME
    child = subprocess.Popen(
        [sys.executable, "-m", "specops.completions", "--run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(SRC_DIR)},
    )
    child.stdin.write(json.dumps(request).encode())
    child.stdin.close()
    deadline = time.monotonic() + 300
    # Kill it hard once two records are on disk: header + 2 lines.
    while not (partial.is_file() and len(partial.read_text().splitlines()) >= 3):
        assert child.poll() is None and time.monotonic() < deadline, (
            "the run ended before it could be interrupted"
        )
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not (out / completions.OUTPUT_NAME).exists()
    with open(partial, "a") as handle:
        handle.write('{"id": "torn by the kil')  # a line cut short by the kill

    result = completions.run(request)
    assert result["resumed"] >= 2 and result["generated"] >= 1
    assert result["resumed"] + result["generated"] == len(expected)
    assert {r["id"]: r["output_ids"] for r in read_records(out)} == {
        k: v["output_ids"] for k, v in expected.items()
    }
    assert not partial.exists()


def test_partial_records_from_other_inputs_are_not_reused(server, fixture_models, tmp_path):
    out = tmp_path / "out"
    request = make_request(
        fixture_models, out, server.url, prompts=str(small_prompts(fixture_models, tmp_path / "p.jsonl", 1))
    )
    out.mkdir()
    (out / completions.PARTIAL_NAME).write_text('{"inputs_fingerprint": "something else"}\n')
    assert completions.run(request)["resumed"] == 0


# -- malformed prompts -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"\n', ":2: not valid JSON"),
        ('{"prompt": "x"}\n', ":1: 'id' must be a non-empty string"),
        ('{"id": 7, "prompt": "x"}\n', ":1: 'id' must be a non-empty string"),
        ('{"id": "a", "prompt": "x", "messages": []}\n', ":1: give exactly one of 'prompt'"),
        ('{"id": "a"}\n', ":1: give exactly one of 'prompt'"),
        ('{"id": "a", "prompt": ""}\n', ":1: 'prompt' must be a non-empty string"),
        ('{"id": "a", "messages": "hi"}\n', ":1: 'messages' must be a non-empty list"),
        ('{"id": "a", "messages": [{"content": "hi"}]}\n', ":1: messages[0].role"),
        (
            '{"id": "a", "prompt": "x"}\n\n{"id": "a", "prompt": "y"}\n',
            ":3: duplicate id 'a' (first on line 1)",
        ),
        ('["a", "b"]\n', ":1: expected a JSON object"),
    ],
)
def test_malformed_prompts_are_refused_with_the_line_and_the_problem(
    fixture_models, tmp_path, content, problem
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    request = make_request(fixture_models, tmp_path / "out", "http://127.0.0.1:9", prompts=str(prompts))
    with pytest.raises(StageError) as error:
        completions.plan(request)
    assert f"{prompts}{problem}" in str(error.value)


def test_a_json_error_reads_as_one_sentence(fixture_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "unterminated')
    request = make_request(fixture_models, tmp_path / "out", "http://127.0.0.1:9", prompts=str(prompts))
    with pytest.raises(StageError) as error:
        completions.plan(request)
    assert "(Unterminated string starting at column 23)" in str(error.value)
    assert "at at" not in str(error.value)


def test_every_malformed_line_is_reported_at_once(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a"}\nnot json\n{"id": "b", "prompt": "ok"}\n')
    with pytest.raises(StageError, match=r"2 invalid prompt record\(s\).*:1: .*:2: not valid JSON"):
        completions.load_prompts(prompts)


def test_an_empty_prompts_file_is_refused(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n")
    with pytest.raises(StageError, match="holds no prompts"):
        completions.load_prompts(prompts)


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"concurrency": "4"}, "concurrency must be an integer >= 1"),
        ({"timeout": 0}, "timeout must be a number > 0"),
        ({"server_url": "localhost:30000"}, "must start with http://"),
        ({"temperature": 0.7}, "unknown request keys ['temperature']"),
    ],
)
def test_bad_requests_name_the_key_and_the_fix(fixture_models, tmp_path, overrides, problem):
    with pytest.raises(StageError) as error:
        completions.parse_request(make_request(fixture_models, tmp_path, "http://127.0.0.1:9", **overrides))
    assert problem in str(error.value)


# -- retry policy ------------------------------------------------------------------------------
def _failed_once_more(retry: completions.StageRetry) -> completions.StageRetry:
    return retry.increment(method="POST", url="/generate", error=ConnectionRefusedError("refused"))


def test_retries_wait_backoff_first_then_double_up_to_the_cap():
    retry = completions.StageRetry(total=10, backoff_factor=1.0, backoff_max=completions.MAX_BACKOFF_S)
    waits = []
    for _ in range(7):
        retry = _failed_once_more(retry)
        waits.append(retry.get_backoff_time())

    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_retry_wait_ends_at_once_when_another_request_has_failed():
    abort = threading.Event()
    retry = _failed_once_more(
        completions.StageRetry(total=3, backoff_factor=30.0, abort=abort, server="http://127.0.0.1:9")
    )
    abort.set()
    started = time.monotonic()

    with pytest.raises(StageError, match=r"POST http://127.0.0.1:9/generate: stopped after another request"):
        retry.sleep()
    assert time.monotonic() - started < 5


# -- unhelpful servers -----------------------------------------------------------------------
def test_a_server_answering_503_for_a_while_then_200_is_waited_for(fixture_models, expected, tmp_path):
    with DevServerProcess(fixture_models.target, "--startup-delay", "3") as starting:
        request = make_request(
            fixture_models,
            tmp_path / "out",
            starting.url,
            retries=10,
            backoff=0.5,
            prompts=str(small_prompts(fixture_models, tmp_path / "p.jsonl", 1)),
        )
        # Fires while the server is starting: connection refused, then 503 from /generate, then 200.
        assert http_status(starting.url + "/health_generate") in (-1, 503)
        result = completions.run(request)
    assert result["changed"] is True and result["count"] == 1
    record = read_records(tmp_path / "out")[0]
    assert record["output_ids"] == expected[record["id"]]["output_ids"]


def test_a_server_that_never_answers_fails_naming_the_endpoint(fixture_models, tmp_path):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel accepts connections; nothing ever reads or answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        request = make_request(fixture_models, tmp_path / "out", url, timeout=0.5, retries=1, backoff=0.1)
        started = time.monotonic()
        with pytest.raises(StageError) as error:
            completions.run(request)
    message = str(error.value)
    assert f"GET {url}/get_model_info failed 2 time(s), last: no answer within 0.5 s" in message
    assert time.monotonic() - started < 20


def test_a_server_without_model_info_is_not_sglang_like(fixture_models, tmp_path):
    with stub_server({}) as url:
        with pytest.raises(
            StageError, match=r"GET .*/model_info answered HTTP 404 \(is this an SGLang server\?\)"
        ):
            completions.plan(make_request(fixture_models, tmp_path / "out", url))


def test_empty_output_ids_are_refused_naming_the_endpoint(fixture_models, tmp_path):
    routes = {
        ("GET", "/get_model_info"): (200, {"model_path": "/models/x", "weight_version": "default"}),
        ("POST", "/generate"): (
            200,
            {
                "text": "",
                "output_ids": [],
                "meta_info": {
                    "finish_reason": {"type": "length", "length": 10},
                    "prompt_tokens": 1,
                    "completion_tokens": 0,
                },
            },
        ),
    }
    prompts = small_prompts(fixture_models, tmp_path / "p.jsonl", 1)
    with stub_server(routes) as url:
        with pytest.raises(StageError) as error:
            completions.run(
                make_request(fixture_models, tmp_path / "out", url, prompts=str(prompts), retries=0)
            )
    message = str(error.value)
    assert f"POST {url}/generate" in message and "empty output_ids" in message
    assert "0 of 1 completions kept" in message


def test_an_answer_without_output_ids_is_refused(fixture_models, tmp_path):
    routes = {
        ("GET", "/get_model_info"): (200, {"model_path": "/models/x"}),
        ("POST", "/generate"): (200, {"text": "hello", "meta_info": {}}),
    }
    prompts = small_prompts(fixture_models, tmp_path / "p.jsonl", 1)
    with stub_server(routes) as url, pytest.raises(StageError, match="has no 'output_ids'"):
        completions.run(make_request(fixture_models, tmp_path / "out", url, prompts=str(prompts)))


def test_a_client_error_is_not_retried(fixture_models, tmp_path):
    routes = {
        ("GET", "/get_model_info"): (200, {"model_path": "/models/x"}),
        ("POST", "/generate"): (400, {"message": "input too long"}),
    }
    prompts = small_prompts(fixture_models, tmp_path / "p.jsonl", 1)
    with stub_server(routes) as url, pytest.raises(StageError, match="answered HTTP 400: .*input too long"):
        completions.run(
            make_request(fixture_models, tmp_path / "out", url, prompts=str(prompts), retries=5, backoff=30)
        )


# -- stage protocol --------------------------------------------------------------------------
def test_the_stage_protocol_reports_a_usable_error_with_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "specops.completions", "--plan"],
        input=json.dumps({}),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(SRC_DIR)},
    )
    assert done.returncode == 2
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed"] is True and "missing required keys ['prompts'" in result["msg"]
