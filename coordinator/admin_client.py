"""What the CLI sends to a node's admin port besides the request: the admin token and, for a change, JSON's type.

The token is `REPLICATOR_ADMIN_TOKEN` when that is set, else `listen.admin_token` of the config file given with
`--config` (loaded as `run` loads it, so `REPLICATOR_LISTEN_ADMIN_TOKEN` overrides the file there too), else none.
The variable comes first, as an environment variable comes before the file everywhere else: `clone --config` names
the new node's file while the token it needs is the leader's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from replicator.shared.config import load

ADMIN_TOKEN_ENV = "REPLICATOR_ADMIN_TOKEN"
JSON = "application/json"


def admin_token(config_path: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The token to send ("" for none); shared.config.ConfigError when the config file given does not load."""
    env = os.environ if env is None else env
    given = env.get(ADMIN_TOKEN_ENV, "").strip()
    if given:
        return given
    if config_path:
        return load(config_path, env).listen.admin_token
    return ""


def admin_headers(token: str, *, change: bool = False) -> dict[str, str]:
    """The headers of an admin request: the token when there is one; for a request that changes state (PUT, POST,
    DELETE), `Content-Type: application/json`, which the node requires of those with a body or without."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if change:
        headers["Content-Type"] = JSON
    return headers
