"""C sources of programs that run in guests (and on the host), built static.

``probe.c`` is the Mint evaluation program (papers README §1): register, copy and I/O
loops timed with the TSC. The image builder compiles it into the guest image
(/usr/bin/probe) and keeps the same binary next to the image for host runs.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from fusuma.errors import ImageError

PROBE = "probe.c"
CFLAGS = ("-O2", "-static", "-Wall", "-Wextra")
INSTALL_HINT = "run `apt-get install gcc libc6-dev`"


def source(name: str = PROBE) -> bytes:
    """A C source shipped as package data."""
    return resources.files("fusuma.guest").joinpath(name).read_bytes()


def source_sha256(name: str = PROBE) -> str:
    return hashlib.sha256(source(name)).hexdigest()


def build_static(out: Path, name: str = PROBE, cc: str = "gcc") -> None:
    """Compile ``name`` into the static executable ``out``; ImageError if the compiler or
    the static C library is missing, or the source does not compile."""
    if shutil.which(cc) is None:
        raise ImageError(f"{cc} is not on this host, so the guest probe cannot be built: "
                         f"{INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="fusuma-cc-") as tmp:
        src = Path(tmp) / name
        src.write_bytes(source(name))
        try:
            res = subprocess.run([cc, *CFLAGS, "-o", str(out), str(src)],
                                 capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ImageError(f"cannot run {cc} to build {name} ({exc}): {INSTALL_HINT}"
                             ) from exc
    if res.returncode != 0:
        err = res.stderr.strip()
        if "cannot find -lc" in err or "crt1.o" in err or "No such file" in err:
            raise ImageError(f"{cc} cannot build {name} as a static program (the C "
                             f"library's headers or static libc.a are missing): {INSTALL_HINT}")
        last = err.splitlines()[-1] if err else f"exit status {res.returncode}"
        raise ImageError(f"{cc} failed to build {name}: {last}")
