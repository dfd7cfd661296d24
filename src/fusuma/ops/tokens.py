"""API tokens: made here, printed once, only their SHA-256 stored (the state file's
tokens table); the API's TCP listener checks them (``fusuma.api.auth``)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable

PREFIX = "fsm_"


def new_token() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def before_roles_notice(names: Iterable[object]) -> str:
    """The one line said of tokens made before tokens had roles (they keep admin)."""
    listed = ", ".join(repr(str(n)) for n in names)
    return (f"token(s) {listed} were made before tokens had roles and keep the admin role "
            "they had; make narrower ones (`fusuma token create NAME --role ROLE`) and "
            "revoke these.")
