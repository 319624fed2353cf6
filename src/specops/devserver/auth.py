"""`--api-key`: which requests need `Authorization: Bearer <key>`, as SGLang decides it."""

from __future__ import annotations

import secrets

from specops.devserver.versions import SGLangVersion

UNAUTHORIZED = {"error": "Unauthorized"}  # 401, utils/auth.py `add_api_key_middleware` (0.5.23)


def is_authorized(
    version: SGLangVersion, api_key: str | None, method: str, path: str, authorization: str | None
) -> bool:
    """0.5.23 utils/auth.py `decide_request_auth`; 0.5.4 utils/common.py:1129 compares the header as is."""
    if not api_key or method == "OPTIONS":
        return True
    # Probes and metrics stay open so a load balancer needs no secret; matched by prefix.
    if path.startswith(version.open_prefixes):
        return True
    if not authorization:
        return False
    if version.name == "0.5.4":
        return authorization == "Bearer " + api_key
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and bool(token) and secrets.compare_digest(token, api_key)
