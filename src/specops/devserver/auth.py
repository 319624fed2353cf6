"""`--api-key` and `--admin-api-key`: which key a request needs, as SGLang decides."""

from __future__ import annotations

import secrets

from specops.devserver.versions import SGLangVersion

# utils/auth.py:192-201 (0.5.23): 401 for a missing or wrong key, 403 where no key could open it.
REFUSALS = {401: {"error": "Unauthorized"}, 403: {"error": "Forbidden"}}


def _bearer_matches(version: SGLangVersion, authorization: str | None, key: str) -> bool:
    if not authorization:
        return False
    if version.name == "0.5.4":
        # 0.5.4 utils/common.py:1129 compares the header as is.
        return authorization == "Bearer " + key
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and bool(token) and secrets.compare_digest(token, key)


def auth_status(
    version: SGLangVersion,
    api_key: str | None,
    admin_api_key: str | None,
    method: str,
    path: str,
    authorization: str | None,
) -> int:
    """200 when the request may pass, else 401 (0.5.23 utils/auth.py `decide_request_auth`:74-151)."""
    if method == "OPTIONS":
        return 200
    # Probes and metrics stay open so a load balancer needs no secret; matched by prefix (:101-106).
    if path.startswith(version.open_prefixes):
        return 200
    if path in version.admin_paths:
        # ADMIN_OPTIONAL (:133-143): the admin key alone when it is set, the plain key refused.
        key = admin_api_key or api_key
        return 200 if not key or _bearer_matches(version, authorization, key) else 401
    # Normal endpoints (:148-151): the api key when set, even beside an admin key; open otherwise.
    if api_key:
        return 200 if _bearer_matches(version, authorization, api_key) else 401
    return 200
