"""How fusuma starts Python processes of its own (a partition's supervisor, a recovery,
the cluster lab's CLI): ``python -P -m MODULE`` with ``/`` as working directory.

``python -m`` puts the working directory first on ``sys.path``: root running ``fusuma
partition create`` in a directory where a user left a ``fusuma/`` package (or a
``fusuma.py``) would start a supervisor that imports the user's code as root. ``-P``
(Python 3.11's ``safe_path``) leaves the working directory out of ``sys.path``, and the
child runs in ``/``, so that nothing it opens by a relative path is the caller's.
PYTHONPATH, root's own setting (a checkout's ``src``), is kept with each entry made
absolute; an empty entry, which Python reads as the working directory, is dropped.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

CWD = "/"


def module_argv(module: str, *args: str) -> list[str]:
    """The argv that runs ``python -m module args`` without the working directory on
    ``sys.path``."""
    return [sys.executable, "-P", "-m", module, *args]


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a child that runs in :data:`CWD`: PYTHONPATH's entries absolute (as
    the caller meant them), empty ones dropped."""
    out = dict(env)
    raw = out.pop("PYTHONPATH", None)
    if raw is not None:
        kept = [os.path.abspath(p) for p in raw.split(os.pathsep) if p]
        if kept:
            out["PYTHONPATH"] = os.pathsep.join(kept)
    return out
