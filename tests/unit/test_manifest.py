"""Reuse is decided by content: a file whose bytes changed is not up to date, even at the same size."""

from __future__ import annotations

import os
import stat

import pytest

from specops.manifest import atomic_write_text, fingerprint, is_up_to_date, staleness, write_manifest

INPUTS = {"prompts": "fixed"}


def made(tmp_path):
    (tmp_path / "out.bin").write_bytes(b"0123456789")
    write_manifest(tmp_path, "stage", INPUTS, ["out.bin"])
    return tmp_path


def test_an_untouched_output_is_up_to_date(tmp_path):
    assert is_up_to_date(made(tmp_path), fingerprint(INPUTS))


def test_a_changed_byte_of_the_same_size_is_named(tmp_path):
    out = made(tmp_path)
    (out / "out.bin").write_bytes(b"0123456780")
    expected = f"{out / 'out.bin'} does not match the sha256 its manifest records (damaged or edited)"
    assert staleness(out, fingerprint(INPUTS)) == expected


def test_a_missing_file_is_named(tmp_path):
    out = made(tmp_path)
    (out / "out.bin").unlink()
    assert staleness(out, fingerprint(INPUTS)) == f"{out / 'out.bin'} is missing"


def test_other_inputs_are_said_to_be_other_inputs(tmp_path):
    assert staleness(made(tmp_path), fingerprint({"prompts": "other"})) == "it was made from other inputs"


def test_outputs_are_readable_by_others_under_the_usual_umask(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECOPS_OUTPUT_MODE", raising=False)
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "report.md", "tau\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "report.md").stat().st_mode) == 0o644


def test_the_output_mode_is_configurable(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPS_OUTPUT_MODE", "0640")
    atomic_write_text(tmp_path / "report.md", "tau\n")
    assert stat.S_IMODE((tmp_path / "report.md").stat().st_mode) == 0o640


def test_a_mode_that_is_not_octal_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPS_OUTPUT_MODE", "rw-r--r--")
    with pytest.raises(ValueError, match="SPECOPS_OUTPUT_MODE='rw-r--r--' is not an octal file mode"):
        atomic_write_text(tmp_path / "report.md", "tau\n")
