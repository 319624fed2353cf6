"""One booted container for the whole systemd suite (booting it and converging the role takes a minute)."""

from __future__ import annotations

import pytest
from nspawn_host import SETTINGS, http_status, molecule


@pytest.fixture(scope="session")
def converged_host():
    """A booted container with the team's unit installed and the role converged; powered off afterwards."""
    for step in ("create", "converge"):
        done = molecule(step)
        if done.returncode != 0:
            molecule("destroy")
            pytest.fail(f"molecule {step} failed:\n{done.stdout[-6000:]}{done.stderr[-6000:]}")
    assert http_status(f"http://127.0.0.1:{SETTINGS['sglang_service_port']}/health_generate") == 200
    yield
    molecule("destroy")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests without the shared container first: the molecule test destroys and recreates it."""
    items.sort(key=lambda item: "converged_host" in getattr(item, "fixturenames", ()))
