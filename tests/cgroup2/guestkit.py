"""Host side of the cgroup v2 tests: fusuma installed on a disk for a stock-host guest.

These machines mount cgroup v1, so the cgroup v2 tests run inside a guest that has
cgroup v2 (the ``debian-host`` image: Debian 12 with systemd as init, QEMU and python3).
fusuma reaches it on a disk of its own (ext4, label ``fusuma-cg2``, mounted at
/opt/fusuma in the guest)::

    venv/                  a venv for the guest's /usr/bin/python3 (3.11, as here):
                           fusuma's wheel built from this checkout and its dependencies'
                           wheels (pip wheel, cached under FUSUMA_CACHE/cgroup2), with
                           pytest; byte-compiled here so the guest's imports are quick
    tests/                 tests/cgroup2/guest (the tests run inside the guest)
    cache/images/          the minimal image, for the one nested VM
    run.sh                 runs them and writes /run/fusuma-cg2/results.json

Dependencies are downloaded once (their set's hash names the directory), installed and
byte-compiled once beside them (``site-*``, linked into each disk's venv), and so is
the build backend (``build-*``); fusuma's own wheel is rebuilt from the checkout for
every disk, offline, and unpacked into the venv (what pip's install of a wheel without
scripts or data does): ~8 s instead of ~32 s for pip's isolated build and installs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUEST_TESTS = Path(__file__).resolve().parent / "guest"
PIP = [sys.executable, "-m", "pip"]
LABEL = "fusuma-cg2"
MOUNT = "/opt/fusuma"
PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
EXTRA = ["pytest>=8", "pytest-timeout>=2.2"]
BUILD = ["setuptools>=68", "wheel"]
RESULTS = "/run/fusuma-cg2/results.json"
CALLS = "/run/fusuma-cg2/calls.json"       # each fusuma CLI call's seconds (guest/kit.py)


def requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return sorted(project["dependencies"]) + EXTRA


def _pip(*args: str, timeout: float = 900) -> None:
    p = subprocess.run([*PIP, "--disable-pip-version-check", *args], capture_output=True,
                       text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args[:3])} ... failed:\n{p.stdout[-2000:]}\n"
                           f"{p.stderr[-3000:]}")


def wheels(cache: Path) -> Path:
    """Wheels of fusuma's dependencies, pytest and the build backend (downloaded once)."""
    reqs = requirements() + BUILD
    tag = hashlib.sha256(json.dumps([PYVER, *reqs]).encode()).hexdigest()[:12]
    final = cache / "cgroup2" / f"wheels-{tag}"
    if final.is_dir():
        return final
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _pip("wheel", "--quiet", "--wheel-dir", str(tmp), *reqs)
    tmp.rename(final)
    return final


def _installed(wheel_dir: Path, kind: str, reqs: list[str]) -> Path:
    """``reqs`` installed from ``wheel_dir`` into a directory of their own beside it
    (``pip install --target``, byte-compiled), once per wheel set."""
    final = wheel_dir.with_name(wheel_dir.name.replace("wheels-", f"{kind}-"))
    if final.is_dir():
        return final
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _pip("install", "--quiet", "--no-index", "--find-links", str(wheel_dir), "--target",
         str(tmp), *reqs)
    shutil.rmtree(tmp / "bin", ignore_errors=True)   # scripts for this host's python
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(tmp)],
                   check=False, capture_output=True)
    tmp.rename(final)
    return final


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _venv(stage: Path, wheel_dir: Path, fusuma_whl: Path) -> None:
    """A venv for the guest's python (same minor version): pyvenv.cfg, the interpreter
    link, and site-packages: the dependencies (installed once) and fusuma's wheel."""
    venv = stage / "venv"
    site = venv / "lib" / f"python{PYVER}" / "site-packages"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n"
                                     f"version = {PYVER}\n")
    (venv / "bin" / "python3").symlink_to(f"/usr/bin/python{PYVER}")
    (venv / "bin" / "python").symlink_to("python3")
    shutil.copytree(_installed(wheel_dir, "site", requirements()), site,
                    copy_function=_link_or_copy)
    with zipfile.ZipFile(fusuma_whl) as whl:
        whl.extractall(site)
    for name, module in (("fusuma", "fusuma.cli.main"), ("pytest", "pytest")):
        script = venv / "bin" / name
        script.write_text(f"#!{MOUNT}/venv/bin/python3\nimport runpy\n"
                          f"runpy.run_module({module!r}, run_name='__main__')\n")
        script.chmod(0o755)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0",
                    *(str(site / top) for top in _tops(fusuma_whl))],
                   check=False, capture_output=True)
    # And the __init__ of fusuma's @frozen classes, as `make bytecode` does (the guest's
    # python is 3.11 too): each CLI call there imports them under TCG.
    subprocess.run([sys.executable, "-m", "fusuma.frozen"], env={**os.environ,
                   "PYTHONPATH": str(site)}, cwd=stage, check=False, capture_output=True)


def _tops(whl: Path) -> list[str]:
    """The top-level packages of a wheel."""
    with zipfile.ZipFile(whl) as z:
        return sorted({n.split("/", 1)[0] for n in z.namelist()
                       if "/" in n and not n.split("/", 1)[0].endswith(".dist-info")})


def build_disk(cache: Path, minimal_dir: Path, out: Path, size_mib: int = 1536) -> Path:
    """The ext4 disk image ``out`` holding fusuma, the guest tests and the minimal image."""
    stage = out.with_suffix(".d")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    wheel_dir = wheels(cache)
    # The build backend from a directory of its own (pip's isolated build would install
    # it again for every disk).
    backend = _installed(wheel_dir, "build", BUILD)
    p = subprocess.run([*PIP, "--disable-pip-version-check", "wheel", "--quiet", "--no-deps",
                        "--no-index", "--no-build-isolation", "--wheel-dir",
                        str(stage / "dist"), str(REPO)], capture_output=True, text=True,
                       timeout=900, env={**os.environ, "PYTHONPATH": str(backend)})
    if p.returncode != 0:
        raise RuntimeError(f"pip wheel {REPO} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    whl = next((stage / "dist").glob("fusuma-*.whl"))
    _venv(stage, wheel_dir, whl)
    shutil.rmtree(stage / "dist")
    shutil.copytree(GUEST_TESTS, stage / "tests",
                    ignore=shutil.ignore_patterns("__pycache__"))
    images = stage / "cache" / "images"
    images.mkdir(parents=True)
    shutil.copytree(minimal_dir, images / minimal_dir.name)
    (images / "minimal.json").write_text(json.dumps({"dir": minimal_dir.name}) + "\n")
    run = stage / "run.sh"
    run.write_text(f"""#!/bin/sh
# Runs the cgroup v2 tests in this guest; results in {RESULTS}.
export PATH={MOUNT}/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin
export FUSUMA_CACHE={MOUNT}/cache PYTHONDONTWRITEBYTECODE=1
mkdir -p {Path(RESULTS).parent}
cd {MOUNT}/tests
exec {MOUNT}/venv/bin/python3 -m pytest -p no:cacheprovider -q -rA \\
    --rootdir={MOUNT}/tests -o addopts= "$@"
""")
    run.chmod(0o755)
    out.unlink(missing_ok=True)
    p = subprocess.run(["mkfs.ext4", "-q", "-F", "-L", LABEL, "-E", "root_owner=0:0",
                        "-d", str(stage), str(out), f"{size_mib}M"],
                       capture_output=True, text=True)
    shutil.rmtree(stage, ignore_errors=True)
    if p.returncode != 0:
        raise RuntimeError(f"mkfs.ext4 failed: {p.stderr}")
    os.chmod(out, 0o600)
    return out
