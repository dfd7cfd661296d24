"""API tokens: made here, printed once, only their SHA-256 stored (the state file's
tokens table); the API's TCP listener checks them (``fusuma.api.auth``)."""

from __future__ import annotations

import hashlib
import secrets

PREFIX = "fsm_"


def new_token() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
