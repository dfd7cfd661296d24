"""Which cluster object each of this host's VMs and partitions belongs to.

One name per host: two FusumaVMs of one name (in two namespaces) cannot both be this
host's VM of that name, and a VM or partition made with the CLI is not the cluster's
to change or delete. The agent records an owner before it makes an object and removes
it after it deleted one, in ``FUSUMA_HOME/cluster/owners.json`` (replaced atomically),
so a restarted agent knows what it made without asking anyone.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Literal

from fusuma.frozen import frozen

Section = Literal["vms", "partitions", "segments", "networks"]


@frozen
class Owner:
    uid: str
    namespace: str
    name: str

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


class Owners:
    def __init__(self, home: Path) -> None:
        self.path = home / "cluster" / "owners.json"
        self._lock = threading.Lock()

    def _read(self) -> dict[str, dict[str, dict[str, str]]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"vms": {}, "partitions": {}, "segments": {}, "networks": {}}
        for section in ("vms", "partitions", "segments", "networks"):
            data.setdefault(section, {})
        return dict(data)

    def _write(self, data: dict[str, dict[str, dict[str, str]]]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.replace(self.path)

    def get(self, section: Section, name: str) -> Owner | None:
        with self._lock:
            o = self._read()[section].get(name)
        return Owner(o["uid"], o.get("namespace", ""), o.get("name", name)) if o else None

    def all(self, section: Section) -> dict[str, Owner]:
        with self._lock:
            return {k: Owner(o["uid"], o.get("namespace", ""), o.get("name", k))
                    for k, o in self._read()[section].items()}

    def set(self, section: Section, name: str, owner: Owner) -> None:
        with self._lock:
            data = self._read()
            data[section][name] = {"uid": owner.uid, "namespace": owner.namespace,
                                   "name": owner.name}
            self._write(data)

    def remove(self, section: Section, name: str) -> None:
        with self._lock:
            data = self._read()
            if data[section].pop(name, None) is not None:
                self._write(data)
