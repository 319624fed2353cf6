"""job_wait and http_wait: waits that succeed print no FAILED - RETRYING line, and fail naming why."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = ROOT / ".venv/bin/ansible-playbook"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def starting_server():
    """Answers 503 to the first three requests, then 200, like a server warming up."""
    answered = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            answered.append(self.path)
            self.send_response(200 if len(answered) > 3 else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/health_generate"
    server.shutdown()
    server.server_close()


def play(tmp_path: Path, tasks: str) -> subprocess.CompletedProcess:
    book = tmp_path / "play.yml"
    book.write_text(f"- hosts: localhost\n  gather_facts: false\n  tasks:\n{tasks}")
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_LOCALHOST_WARNING="false",
        ANSIBLE_INVENTORY_UNPARSED_WARNING="false",
    )
    command = [
        str(PLAYBOOK),
        "-i",
        "localhost,",
        "-c",
        "local",
        "-e",
        "ansible_python_interpreter={{ ansible_playbook_python }}",
        str(book),
    ]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_http_wait_waits_for_a_starting_server_without_retry_lines(tmp_path, starting_server):
    proc = play(
        tmp_path,
        f"""
    - specops.drafter.http_wait: {{url: "{starting_server}", retries: 30, delay: 0.2}}
      register: waited
    - ansible.builtin.assert: {{that: [waited.status == 200, waited.attempts == 4]}}
""",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED - RETRYING" not in proc.stdout


def test_http_wait_fails_naming_the_last_status(tmp_path, starting_server):
    proc = play(
        tmp_path,
        f"""
    - specops.drafter.http_wait: {{url: "{starting_server}", retries: 1, delay: 0.1}}
""",
    )
    assert proc.returncode != 0
    assert "answered 503 after 2 tries" in proc.stdout


def test_job_wait_waits_for_an_async_job_without_retry_lines(tmp_path):
    proc = play(
        tmp_path,
        """
    - ansible.builtin.command: sleep 2
      async: 60
      poll: 0
      register: job
    - specops.drafter.job_wait: {results_file: "{{ job.results_file }}", timeout: 30, delay: 0.2}
      register: waited
    - ansible.builtin.async_status: {jid: "{{ job.ansible_job_id }}"}
      register: status
    - ansible.builtin.assert: {that: [waited.finished, status.finished]}
""",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED - RETRYING" not in proc.stdout


def test_job_wait_returns_unfinished_when_the_time_is_up(tmp_path):
    # The job runs until the play says so, not for a fixed time a loaded machine could outlast.
    go = tmp_path / "go"
    proc = play(
        tmp_path,
        f"""
    - ansible.builtin.shell: while [ ! -e {go} ]; do sleep 0.1; done
      async: 600
      poll: 0
      register: job
    - specops.drafter.job_wait: {{results_file: "{{{{ job.results_file }}}}", timeout: 1, delay: 0.2}}
      register: waited
    - ansible.builtin.file: {{path: "{go}", state: touch}}
    - ansible.builtin.assert: {{that: [not waited.finished]}}
""",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_job_wait_returns_a_failed_jobs_result_and_removes_its_file(tmp_path):
    progress = tmp_path / "progress.log"
    proc = play(
        tmp_path,
        f"""
    - ansible.builtin.shell: >-
        echo 'step 1 of 2' >> {progress}; echo 'step 2 of 2' >> {progress}; echo broken >&2; exit 3
      async: 60
      poll: 0
      register: job
    - specops.drafter.job_wait:
        results_file: "{{{{ job.results_file }}}}"
        timeout: 30
        delay: 0.1
        cleanup: true
        progress_log: "{progress}"
      register: waited
    - ansible.builtin.stat: {{path: "{{{{ job.results_file }}}}"}}
      register: left
    - ansible.builtin.assert:
        that:
          - waited.finished
          - waited.result.failed
          - waited.result.rc == 3
          - "'broken' in waited.result.stderr"
          - waited.progress == 'step 2 of 2'
          - not left.stat.exists
""",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_job_wait_writes_go_to_the_start_signal_before_it_waits(tmp_path):
    signal = tmp_path / "extract.start"
    proc = play(
        tmp_path,
        f"""
    - ansible.builtin.shell: "until grep -q go {signal} 2>/dev/null; do sleep 0.05; done; cat {signal}"
      async: 60
      poll: 0
      register: job
    - specops.drafter.job_wait:
        go: "{signal}"
        results_file: "{{{{ job.results_file }}}}"
        timeout: 30
        delay: 0.1
      register: waited
    - ansible.builtin.assert:
        that:
          - waited.changed
          - waited.finished
          - (waited.result.stdout | from_json).signal == 'go'
""",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_router_without_healthy_replicas_stops_the_work_and_ends_the_wait_at_once(tmp_path):
    # Nothing listens on the router's port: no healthy replica. The work carrying the window's token is
    # stopped and the task fails saying why, without waiting for a result the stopped job never writes
    # (stop_timeout is the grace before SIGKILL, an hour here; the sleep dies at SIGTERM).
    token = f"quiet-waits-{os.getpid()}"
    proc = play(
        tmp_path,
        f"""
    - ansible.builtin.command: sleep 600
      environment: {{SPECOPS_WINDOW_TOKEN: {token}}}
      async: 900
      poll: 0
      register: job
    - specops.drafter.job_wait:
        results_file: "{{{{ job.results_file }}}}"
        timeout: 900
        delay: 0.1
        watch_router: {{url: "http://127.0.0.1:{free_port()}", min_healthy: 1, stop_timeout: 3600}}
        stop_token: {token}
      environment: {{SPECOPS_WINDOW_TOKEN: {token}}}
      register: waited
      ignore_errors: true
    - ansible.builtin.assert:
        that:
          - waited.failed and waited.ended_early
          - waited.stopped_pids | length > 0
          - "'reports 0 healthy replica(s) besides this batch' in waited.msg"
""",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
