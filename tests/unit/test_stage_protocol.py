"""The stage protocol's process end: the result is out, flushed, and the exit status kept."""

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def test_exit_now_flushes_the_result_and_keeps_the_status_without_running_exit_handlers():
    code = (
        "import atexit, sys\n"
        "from specops.stage import exit_now\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "print('{\"changed\": true}', end='')\n"
        "sys.stderr.write('last progress line')\n"
        "exit_now(2)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == '{"changed": true}'
    assert proc.stderr == "last progress line"


def test_progress_lines_also_go_to_the_progress_log_a_waiting_play_reads(tmp_path, monkeypatch, capsys):
    from specops.stage import log

    progress = tmp_path / "score.progress.log"
    monkeypatch.setenv("SPECOPS_PROGRESS_LOG", str(progress))
    log("score: 64/128 sequences")
    log("score: 128/128 sequences")
    assert capsys.readouterr().err.splitlines() == ["score: 64/128 sequences", "score: 128/128 sequences"]
    assert progress.read_text().splitlines()[-1].endswith(" score: 128/128 sequences")
