"""Network namespaces of a test's own: the network rule says every test that uses
fusuma's networks runs them inside namespaces it creates itself, with traffic only to
loopback or to addresses inside them."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator


def add(ns: str) -> None:
    """Create namespace ``ns`` with its loopback up."""
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)


def delete(ns: str) -> None:
    """Remove namespace ``ns`` (what is left in it goes with it); quiet when gone."""
    subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


@contextlib.contextmanager
def netns(prefix: str = "fusuma-t") -> Iterator[str]:
    """A new namespace named ``PREFIX-xxxxxxxx``, loopback up, removed on the way out."""
    ns = f"{prefix}-{uuid.uuid4().hex[:8]}"
    add(ns)
    try:
        yield ns
    finally:
        delete(ns)


def wrap(ns: str) -> list[str]:
    """What a Host's CLI runs under to be inside ``ns`` (Host.wrap)."""
    return ["nsenter", f"--net=/run/netns/{ns}", "--"]
