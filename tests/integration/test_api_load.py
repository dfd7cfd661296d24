"""`fusuma serve` under load (bounded, UNIX socket only).

For RUN_S seconds, CLIENTS concurrent clients (each its own connection) GET /1.0/vms
and /metrics back to back while, beside them:

- a mover moves running vm0 between p0 and p1 through the API, each move waited for;
- two writers change the same stopped VM, vm2, through PATCH: one cycles its QoS
  class, the other attaches and detaches disk d2. Both go through the host lock and
  conditional column updates; a blind write of the whole record would make one of
  them undo the other's change (a lost update).

Checked: no 5xx anywhere, no transport error, every move Success; the vm-moved events
on /1.0/events and the growth of fusuma_vm_moves_total{mode="zero-copy",result="ok"}
both equal the number of moves; every PATCH answer shows its own change, and at the
end the record (through the API, and through the CLI, which reads the state file in
another process) holds the last QoS class and the last disk list sent, vm0 is where
the last move put it, and vm1 was never touched. Counts and latency percentiles go
to test-output/api-load.json.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fusuma_bench.api import load, summarize_ms
from tests.apikit import Api
from tests.conftest import REPO, Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RUN_S = 20.0
CLIENTS = 100
# Transport errors (a refused or reset connection, a timeout) tolerated among the
# clients' requests: none.
MAX_TRANSPORT_ERRORS = 0
QOS_CYCLE = ("best-effort", "guaranteed", "burstable")


def moves_ok(metrics_text: str) -> float:
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == "fusuma_vm_moves":
            for s in fam.samples:
                if (s.name == "fusuma_vm_moves_total" and s.labels.get("mode") == "zero-copy"
                        and s.labels.get("result") == "ok"):
                    return s.value
    raise AssertionError("no fusuma_vm_moves_total{mode=zero-copy,result=ok} in /metrics")


class Worker(threading.Thread):
    """A thread with its own client that records every answer's status and any
    exception, so the test can assert on them afterwards."""

    def __init__(self, api: Api, stop: threading.Event, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.api = api
        self.halt = stop
        self.statuses: Counter[int] = Counter()
        self.failures: list[str] = []
        self.latencies: list[float] = []

    def call(self, c: httpx.Client, method: str, path: str, **kw: Any) -> httpx.Response:
        t0 = time.perf_counter()
        r = c.request(method, path, **kw)
        self.latencies.append(time.perf_counter() - t0)
        self.statuses[r.status_code] += 1
        return r

    def run(self) -> None:
        try:
            with self.api.unix(timeout=300) as c:
                self.loop(c)
        except BaseException as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")

    def loop(self, c: httpx.Client) -> None:
        raise NotImplementedError


class Mover(Worker):
    def __init__(self, api: Api, stop: threading.Event) -> None:
        super().__init__(api, stop, "mover")
        self.moves: list[dict[str, Any]] = []

    def loop(self, c: httpx.Client) -> None:
        to = "p1"
        while not self.halt.is_set():
            r = self.call(c, "POST", "/1.0/vms/vm0/move",
                          json={"partition": to, "mode": "zero-copy"})
            if r.status_code != 202:
                self.failures.append(f"move to {to}: {r.status_code} {r.text}")
                return
            t0 = time.perf_counter()
            op = c.get(f"/1.0/operations/{r.json()['id']}/wait",
                       params={"timeout": 240}, timeout=250).json()
            self.statuses[200] += 1
            self.moves.append({"to": to, "status": op["status"], "err": op["err"],
                               "wait_s": round(time.perf_counter() - t0, 3),
                               "downtime_ms": (op["result"] or {}).get("downtime_ms"),
                               "total_ms": (op["result"] or {}).get("total_ms")})
            if op["status"] != "Success":
                self.failures.append(f"move to {to}: {op['status']}: {op['err']}")
                return
            to = "p0" if to == "p1" else "p1"


class QosWriter(Worker):
    def __init__(self, api: Api, stop: threading.Event) -> None:
        super().__init__(api, stop, "qos-writer")
        self.sent: list[str] = []

    def loop(self, c: httpx.Client) -> None:
        i = 0
        while not self.halt.is_set():
            qos = QOS_CYCLE[i % len(QOS_CYCLE)]
            i += 1
            r = self.call(c, "PATCH", "/1.0/vms/vm2", json={"qos": qos})
            if r.status_code != 200:
                self.failures.append(f"PATCH qos={qos}: {r.status_code} {r.text}")
                return
            self.sent.append(qos)
            if r.json()["qos"] != qos:
                self.failures.append(f"PATCH qos={qos} answered qos={r.json()['qos']}")


class DiskWriter(Worker):
    def __init__(self, api: Api, stop: threading.Event) -> None:
        super().__init__(api, stop, "disk-writer")
        self.sent: list[list[str]] = []

    def loop(self, c: httpx.Client) -> None:
        i = 0
        while not self.halt.is_set():
            disks = ["d2"] if i % 2 == 0 else []
            i += 1
            r = self.call(c, "PATCH", "/1.0/vms/vm2", json={"disks": disks})
            if r.status_code != 200:
                self.failures.append(f"PATCH disks={disks}: {r.status_code} {r.text}")
                return
            self.sent.append(disks)
            if r.json()["disks"] != disks:
                self.failures.append(f"PATCH disks={disks} answered {r.json()['disks']}")


def test_api_under_load_no_5xx_no_lost_update(host: Host, tmp_path: Path) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024")
    api = Api(host)
    report: dict[str, Any] = {"run_s": RUN_S, "clients": CLIENTS}
    try:
        with api.unix() as c:
            for name, part, start in (("vm0", "p0", True), ("vm1", "p1", True),
                                      ("vm2", "p0", False)):
                Api.ok(c, c.post("/1.0/vms", json={"name": name, "partition": part,
                                                    "memory_mib": 128, "start": start}))
            r = c.post("/1.0/disks", json={"name": "d2",
                                           "path": str(host.home / "disks" / "d2.img"),
                                           "partition": "p0", "size_mib": 1})
            assert r.status_code == 201, r.text
            vm1_before = c.get("/1.0/vms/vm1").json()
            assert vm1_before["state"] == "running"
            moved_before = moves_ok(c.get("/metrics").text)

        stop = threading.Event()
        mover, qos, disks = Mover(api, stop), QosWriter(api, stop), DiskWriter(api, stop)
        with api.events("lifecycle") as events:
            t0 = time.monotonic()
            for w in (mover, qos, disks):
                w.start()
            try:
                res = load(api.socket, ["/1.0/vms", "/metrics"], CLIENTS, RUN_S)
            finally:
                stop.set()
                for w in (mover, qos, disks):
                    w.join(120)
            elapsed = time.monotonic() - t0
            assert not any(w.is_alive() for w in (mover, qos, disks)), "a worker hung"
            n_moves = len(mover.moves)
            # The hub polls the event log every 50 ms: give the last event a moment.
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                seen = [e for e in events if e["metadata"]["action"] == "vm-moved"]
                if len(seen) >= n_moves:
                    break
                time.sleep(0.1)
            time.sleep(0.5)       # and time for a surplus event to show, if any
            moved_events = [e for e in events if e["metadata"]["action"] == "vm-moved"]

        with api.unix() as c:
            moved_after = moves_ok(c.get("/metrics").text)
            vm0, vm1, vm2 = (c.get(f"/1.0/vms/{n}").json() for n in ("vm0", "vm1", "vm2"))
        cli = {v["name"]: v for v in host.ps()["vms"]}

        report.update({
            "elapsed_s": round(elapsed, 1), "load": res.as_json(),
            "moves": {"count": n_moves, "events": len(moved_events),
                      "metric_delta": moved_after - moved_before,
                      "statuses": dict(mover.statuses),
                      "downtime_ms": summarize_ms([m["downtime_ms"] / 1000 for m in
                                                   mover.moves]) if n_moves else None,
                      "wait_ms": summarize_ms([m["wait_s"] for m in mover.moves])
                      if n_moves else None},
            "patch_qos": {"count": len(qos.sent), "statuses": dict(qos.statuses),
                          **(summarize_ms(qos.latencies) if qos.latencies else {})},
            "patch_disks": {"count": len(disks.sent), "statuses": dict(disks.statuses),
                            **(summarize_ms(disks.latencies) if disks.latencies else {})},
            "failures": mover.failures + qos.failures + disks.failures})
    finally:
        api.stop()
        out = REPO / "test-output" / "api-load.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")

    load_json = report["load"]
    assert load_json["status_5xx"] == 0, load_json
    assert load_json["status_non_2xx"] == 0, load_json
    assert sum(res.errors.values()) <= MAX_TRANSPORT_ERRORS, load_json["transport_errors"]
    for path in ("/1.0/vms", "/metrics"):
        assert load_json["paths"][path]["requests"] >= 100, load_json
    assert report["failures"] == [], report["failures"]
    for w in (mover, qos, disks):
        assert set(w.statuses) <= {200, 202}, (w.name, w.statuses)

    # Moves: each one Success, each seen once on the stream and once in the counter.
    assert n_moves >= 4, f"only {n_moves} moves in {RUN_S:g} s"
    assert all(m["status"] == "Success" for m in mover.moves)
    assert len(moved_events) == n_moves, (len(moved_events), n_moves)
    assert [e["metadata"]["context"]["to"] for e in moved_events] == [
        m["to"] for m in mover.moves]
    assert all(e["metadata"]["context"]["vm"] == "vm0" for e in moved_events)
    assert moved_after - moved_before == n_moves

    # No lost update: the record holds the last change of each writer.
    assert len(qos.sent) >= 3 and len(disks.sent) >= 2, (len(qos.sent), len(disks.sent))
    for view in (vm2, cli["vm2"]):
        assert view["qos"] == qos.sent[-1], (view["qos"], qos.sent[-3:])
        assert view["disks"] == disks.sent[-1], (view["disks"], disks.sent[-3:])
        assert view["state"] == "stopped"
    last_to = mover.moves[-1]["to"]
    for view in (vm0, cli["vm0"]):
        assert (view["partition"], view["state"]) == (last_to, "running"), view
    for view in (vm1, cli["vm1"]):
        assert (view["partition"], view["state"], view["pid"]) == (
            "p1", "running", vm1_before["pid"]), view
