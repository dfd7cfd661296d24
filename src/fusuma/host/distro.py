"""This host's distribution as fusuma's package fetching needs it: the Debian release
and the archive its apt sources name. The guest image builder (fusuma.images) and the
QEMU installer (fusuma.qemu.fetch) both ask it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

DEFAULT_MIRROR = "http://deb.debian.org/debian"


def debian_source(os_release: Path = Path("/etc/os-release"),
                  sources: Path = Path("/etc/apt")) -> tuple[str, str]:
    """The suite and mirror for Debian packages fusuma fetches (a guest's debootstrap,
    a newer QEMU): this host's Debian release and the first Debian archive in its apt
    sources (``FUSUMA_DEBIAN_MIRROR`` overrides)."""
    suite = "bookworm"
    try:
        for line in os_release.read_text().splitlines():
            if line.startswith("VERSION_CODENAME=") and line.split("=", 1)[1].strip('"'):
                suite = line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    mirror = os.environ.get("FUSUMA_DEBIAN_MIRROR", "")
    if not mirror:
        files = [sources / "sources.list", *sorted((sources / "sources.list.d").glob("*"))]
        for f in files:
            try:
                text = f.read_text()
            except OSError:
                continue
            for m in re.finditer(r"(?:^deb\s+(?:\[[^]]*\]\s+)?|^URIs:\s*)(\S+)", text, re.M):
                uri = m.group(1).rstrip("/")
                if "security" not in uri and uri.startswith(("http://", "https://")):
                    mirror = uri
                    break
            if mirror:
                break
    return suite, mirror or DEFAULT_MIRROR
