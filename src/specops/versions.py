"""Versions of the installed libraries, as manifests and reports record them."""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata


def distribution_version(name: str) -> str | None:
    """The installed version of a distribution (pip's name), or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed_versions(names: Iterable[str]) -> dict[str, str | None]:
    """{name: version or None} for each distribution, in the order given."""
    return {name: distribution_version(name) for name in names}
