"""A real Prometheus server scrapes a real `fusuma serve` the way an operator sets it up:
over HTTPS on a loopback port, with a bearer token of the metrics role (`fusuma token
create prom --role metrics`) and the daemon's self-signed certificate as the CA. After a
VM boots and moves, Prometheus' own HTTP API must hold the VM's CPU counters (with their
labels) and the move's downtime histogram."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.apikit import Api
from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
POLL_LIMIT_S = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def scrape_config(target: str, token: str, ca_file: str) -> str:
    # JSON is YAML: no YAML library needed, and quoting is exact.
    import json

    cfg = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                      "evaluation_interval": "1s"},
           "scrape_configs": [{
               "job_name": "fusuma", "scheme": "https", "metrics_path": "/metrics",
               "authorization": {"type": "Bearer", "credentials": token},
               "tls_config": {"ca_file": ca_file},
               "static_configs": [{"targets": [target]}]}]}
    return json.dumps(cfg, indent=2)


@contextlib.contextmanager
def prometheus(tmp: Path, config: str) -> Iterator[str]:
    """A Prometheus server on a free loopback port, its data in ``tmp``; yields its URL
    and ends it by its pid."""
    cfg = tmp / "prometheus.yml"
    cfg.write_text(config)
    port = free_port()
    log = tmp / "prometheus.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}",
             # Debian's defaults point at /etc/prometheus; keep everything in tmp.
             f"--web.console.templates={tmp}", f"--web.console.libraries={tmp}",
             "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, f"prometheus exited:\n{log.read_text()}"
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, f"prometheus not ready:\n{log.read_text()}"
                time.sleep(0.2)
            yield url
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(5)


def query(url: str, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def poll(url: str, promql: str, ready: Any, what: str) -> list[dict[str, Any]]:
    """Query until ``ready(result)`` holds, for at most POLL_LIMIT_S."""
    deadline = time.monotonic() + POLL_LIMIT_S
    result: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        result = query(url, promql)
        if ready(result):
            return result
        time.sleep(0.5)
    raise AssertionError(f"{what}: Prometheus has no such result after {POLL_LIMIT_S:g} s "
                         f"(last answer: {result})")


def test_prometheus_scrapes_vm_cpu_and_move_downtime(host: Host, tmp_path: Path) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024")
    # Prometheus scrapes with a metrics token; the VM is made and moved by an operator.
    token = host.run("token", "create", "prom", "--role", "metrics", "--json").json()["token"]
    ops = host.run("token", "create", "ops", "--role", "operator", "--json").json()["token"]
    api = Api(host, listen=True)
    try:
        assert api.url is not None and api.cert is not None
        with api.tcp(ops) as c:
            Api.ok(c, c.post("/1.0/vms", json={"name": "vm0", "partition": "p0",
                                                "memory_mib": 128, "start": True}))
            target = api.url.removeprefix("https://")
            prom_dir = tmp_path / "prom"
            prom_dir.mkdir()
            with prometheus(prom_dir, scrape_config(target, token, api.cert)) as prom:
                up = poll(prom, 'up{job="fusuma"}',
                          lambda r: bool(r) and r[0]["value"][1] == "1", "up == 1")
                assert up[0]["metric"]["instance"] == target

                moved = Api.ok(c, c.post("/1.0/vms/vm0/move",
                                         json={"partition": "p1", "mode": "zero-copy"}))
                assert moved["downtime_ms"] > 0

                # After the move the VM is in p1: wait for a sample that says so.
                cpu = poll(prom, 'fusuma_vm_cpu_seconds_total{vm="vm0",partition="p1"}',
                           lambda r: len(r) == 2, "fusuma_vm_cpu_seconds_total of vm0 in p1")
                by_thread = {s["metric"]["thread"]: s for s in cpu}
                assert set(by_thread) == {"vcpu", "other"}
                for s in cpu:
                    lab = s["metric"]
                    assert (lab["vm"], lab["partition"], lab["qos"], lab["job"]) == (
                        "vm0", "p1", "burstable", "fusuma"), lab
                    assert float(s["value"][1]) >= 0
                assert float(by_thread["vcpu"]["value"][1]) > 0, "a booted guest used no CPU"
                # Before the move the same VM was scraped under p0 (the series moved).
                earlier = query(prom, 'last_over_time(fusuma_vm_cpu_seconds_total'
                                      '{vm="vm0",thread="vcpu"}[5m])')
                assert {s["metric"]["partition"] for s in earlier} == {"p0", "p1"}

                count = poll(prom, 'fusuma_vm_move_downtime_seconds_count{mode="zero-copy"}',
                             lambda r: bool(r) and float(r[0]["value"][1]) >= 1,
                             "fusuma_vm_move_downtime_seconds_count >= 1")
                assert len(count) == 1 and float(count[0]["value"][1]) == 1.0, count
                total = query(prom, 'fusuma_vm_move_downtime_seconds_sum{mode="zero-copy"}')
                assert abs(float(total[0]["value"][1]) - moved["downtime_ms"] / 1000) < 1e-3
                moves = query(prom, 'fusuma_vm_moves_total{mode="zero-copy",result="ok"}')
                assert float(moves[0]["value"][1]) == 1.0

                # The target is still healthy after all of that.
                up = query(prom, 'up{job="fusuma"}')
                assert up[0]["value"][1] == "1", up
                targets = httpx.get(f"{prom}/api/v1/targets", timeout=5).json()
                active = targets["data"]["activeTargets"]
                assert [t["health"] for t in active] == ["up"], active
            Api.ok(c, c.delete("/1.0/vms/vm0", params={"force": "true"}))
    finally:
        api.stop()
    assert token not in api.log_text() and ops not in api.log_text(), \
        "a token appeared in the daemon's log"
