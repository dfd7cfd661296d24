"""A list-then-watch cache of one kind, in a thread: what the agent reconciles from.

On start and whenever a watch's resourceVersion is too old (410 Gone), it lists again;
a watch that ends is resumed from the last version seen. Every change calls
``on_change`` (the agent's wake-up), so reconciling is level-based: the agent compares
the whole cache with the host, never replays events.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable

from fusuma.cluster import ApiError
from fusuma.cluster.kube import Kind, Kube, Obj
from fusuma.cluster.resources import key

LOG = logging.getLogger(__name__)


class Informer:
    def __init__(self, kube: Kube, kind: Kind, namespace: str | None = None,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.kube = kube
        self.kind = kind
        self.namespace = namespace
        self.on_change = on_change
        self._objs: dict[tuple[str, str], Obj] = {}
        self._lock = threading.Lock()
        self.synced = threading.Event()
        self.stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"watch-{kind.plural}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def items(self) -> list[Obj]:
        with self._lock:
            return [copy.deepcopy(o) for o in self._objs.values()]

    def get(self, namespace: str, name: str) -> Obj | None:
        with self._lock:
            o = self._objs.get((namespace, name))
            return copy.deepcopy(o) if o is not None else None

    def put(self, obj: Obj) -> None:
        """Take an object this process just wrote (newer than the watch may be yet)."""
        k = key(obj)
        with self._lock:
            old = self._objs.get(k)
            if old is None or _rv(obj) >= _rv(old):
                self._objs[k] = obj

    def _relist(self) -> str:
        items, rv = self.kube.list(self.kind, self.namespace)
        with self._lock:
            self._objs = {key(o): o for o in items}
        self.synced.set()
        self.on_change()
        return rv

    def _run(self) -> None:
        rv = ""
        while not self.stopped.is_set():
            try:
                if not rv:
                    rv = self._relist()
                for typ, obj in self.kube.watch(self.kind, rv, self.namespace, 30):
                    if self.stopped.is_set():
                        return
                    new_rv = str(obj.get("metadata", {}).get("resourceVersion") or rv)
                    if typ == "BOOKMARK":
                        rv = new_rv
                        continue
                    obj.setdefault("apiVersion", self.kind.api_version)
                    obj.setdefault("kind", self.kind.kind)
                    with self._lock:
                        if typ == "DELETED":
                            self._objs.pop(key(obj), None)
                        else:
                            self._objs[key(obj)] = obj
                    rv = new_rv
                    self.on_change()
            except ApiError as exc:
                if exc.code == 410:
                    rv = ""
                    continue
                LOG.warning("watch of %s: %s", self.kind.plural, exc)
                rv = ""
                time.sleep(1)
            except Exception as exc:
                LOG.warning("watch of %s ended: %s", self.kind.plural, exc)
                time.sleep(1)


def _rv(obj: Obj) -> int:
    try:
        return int(obj.get("metadata", {}).get("resourceVersion") or 0)
    except ValueError:
        return 0
