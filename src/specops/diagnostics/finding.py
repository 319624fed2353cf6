"""The diagnostics' names and the report entry each returns: {"name", "status": ok|warning|skipped,
"message", "details"}.
"""

from __future__ import annotations

from typing import Any

DIAGNOSTICS = ("acceptance", "layer_offset", "backend", "vocabulary")
# Not selectable: it runs whenever the score request names the drafter the server ran.
ONLINE_AGREEMENT = "online_agreement"


def finding(name: str, status: str, message: str, **details: Any) -> dict[str, Any]:
    return {"name": name, "status": status, "message": message, "details": details}
