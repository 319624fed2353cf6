"""A DFlash drafter's settings as its config.json states them, read without torch: planning and check
mode read them before any model is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class DrafterError(ValueError):
    """A drafter checkpoint that cannot be used as it is; the message names the file and the fix."""


def dflash_value(config: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """A DFlash setting from `dflash_config`, else from the top level (older layouts)."""
    dflash = config.get("dflash_config") or {}
    if name in dflash:
        return dflash[name]
    return config.get(name, default)


def target_layer_ids(config: Mapping[str, Any], where: str = "config.json") -> list[int]:
    """The target layers the drafter reads (layer k is HF's hidden_states[k + 1])."""
    layer_ids = dflash_value(config, "target_layer_ids")
    if (
        not isinstance(layer_ids, list)
        or not layer_ids
        or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in layer_ids)
    ):
        raise DrafterError(
            f"{where}: dflash_config.target_layer_ids is missing or not a list of layer "
            f"indices (got {layer_ids!r}); set it to the target layers the drafter was "
            "trained on"
        )
    return list(layer_ids)
