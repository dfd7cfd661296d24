"""The kill matrix of a move between hosts (issue 27, "Recovery between hosts"): at each
phase of a live move from one lab host to another, ``kill -9`` of one actor, by pid:
the source host's agent, the destination's agent (each started again at once, as
systemd would), the source's QEMU, the destination's QEMU, or the API server (killed
and started again a second later on the same etcd: every agent's connection to it is
lost, and each agent's next call in the move fails until it is back).

Each phase is reached by holding one side there for a moment (``fusuma.cluster.hostmove``
``FAULT_*``: an environment variable of the agents, a sleep at a named point) and
seeing the move's record, and the QEMUs the kernel runs, show it:

    Preparing   the destination's incoming QEMU started, the record not yet Prepared
    Prepared    the destination waits for the stream, the source not yet streaming
    Streaming   the stream runs (slowed down)
    Streamed    the destination holds the whole stream and has not decided yet
    Committed   "forward" recorded, the destination's QEMU not yet running the guest
    Releasing   the destination runs the guest (Switched), the source's QEMU not yet ended

After each case: at most one QEMU runs the guest across the three hosts (the kernel's
view); where one runs, the FusumaVM says so (host, pid, Running and Ready), that host's
``fusuma ps`` too, the other hosts keep nothing of the guest, and the data written before
the move reads back with the same md5 through the guest agent; where none runs, the
FusumaVM says Failed; the move's lastMove says where it ended; the next move of the
same VM works. One lab and one guest serve every case (module-scoped); a guest that a
case lost is started again (and its data written anew) for the next. Each case's
outcome goes to test-output/host-move-matrix.jsonl. Of the 30 cases, 22 run here: eight
that take the path of another case, or have no process to kill, are left out
(``LEFT_OUT``) to keep the module within its share of the suite's time.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from fusuma.cluster.hostmove import (
    FAULT_DECIDED_DELAY,
    FAULT_PREPARE_DELAY,
    FAULT_RELEASE_DELAY,
    FAULT_STREAM_DELAY,
    FAULT_STREAMED_DELAY,
)
from fusuma.migration import FAULT_STREAM_BPS
from tests.cluster.conftest import Cluster, wait_for
from tests.cluster.test_cluster import vm_yaml
from tests.cluster.test_move_tls import patch_host, restart_agents
from tests.conftest import REPO
from tests.fault.movekit import qemu_pids

pytestmark = [pytest.mark.cluster, pytest.mark.fault, pytest.mark.timeout(240)]

VM = "kv"
HOSTS = ("h0", "h1", "h2")
WRITE = ("dd if=/dev/urandom of=/tmp/blob bs=1M count=8 2>/dev/null && "
         "md5sum /tmp/blob > /tmp/blob.md5 && cat /tmp/blob.md5")
HOLD = "1.5"                    # seconds a side is held at a phase
SLOW = str(12 * 2**20)          # bytes/s: a stream that lasts a few seconds
FAST = str(2**40)               # a source QEMU keeps a limit: lifted elsewhere

Move = dict[str, Any]
Qemus = dict[str, list[int]]


@dataclass(frozen=True)
class Phase:
    env: dict[str, str]                               # both agents' environment
    held: Callable[[Move, Qemus, str, str], object]   # (record, QEMUs, src, dst): there


PHASES: dict[str, Phase] = {
    "Preparing": Phase({FAULT_PREPARE_DELAY: HOLD},
                       lambda m, q, s, d: m.get("phase") == "Preparing" and q.get(d)),
    "Prepared": Phase({FAULT_STREAM_DELAY: HOLD},
                      lambda m, q, s, d: m.get("phase") == "Prepared"),
    "Streaming": Phase({FAULT_STREAM_BPS: SLOW},
                       lambda m, q, s, d: m.get("phase") == "Streaming"),
    # The destination waits from its prepare on: the stream (a second or so) ends first.
    "Streamed": Phase({FAULT_STREAMED_DELAY: "3"},
                      lambda m, q, s, d: m.get("phase") == "Streamed"
                      and not m.get("decision")),
    "Committed": Phase({FAULT_DECIDED_DELAY: HOLD},
                       lambda m, q, s, d: m.get("decision") == "forward"
                       and m.get("phase") != "Switched"),
    "Releasing": Phase({FAULT_RELEASE_DELAY: HOLD},
                       lambda m, q, s, d: m.get("phase") == "Switched" and q.get(s)),
}
ACTORS = ("source-agent", "destination-agent", "source-qemu", "destination-qemu",
          "apiserver")
# Left out, to keep the module within its share of the suite's time: cases that take
# the very path of a case kept (measured, all passed: test-output/host-move-matrix.jsonl
# of the full 30), and one with nothing to kill.
LEFT_OUT = {
    # The source QEMU dead before the stream: the stream fails to start, as Preparing's.
    ("Prepared", "source-qemu"),
    # The source agent restarted before the stream: it decides back, as at Preparing.
    ("Prepared", "source-agent"),
    # The source ends its QEMU as soon as it sees "forward": none is left at Committed
    # (Releasing holds the source there and kills it).
    ("Committed", "source-qemu"),
    # The destination's half is over at the switch: its restarted agent finds the VM
    # running and returns, as after any restart.
    ("Releasing", "destination-agent"),
    # The restarted destination waits for the stream's end and decides, as at Streamed.
    ("Streaming", "destination-agent"),
    # The API server: one case per group of phases (before the stream: Preparing; the
    # stream: Streaming; after "forward": Committed); the others went as those did.
    ("Prepared", "apiserver"), ("Streamed", "apiserver"), ("Releasing", "apiserver"),
}
CASES = [(p, a) for p in PHASES for a in ACTORS if (p, a) not in LEFT_OUT]


def qemus(c: Cluster) -> Qemus:
    """Each host's QEMUs of the guest (the kernel's view), hosts that have one."""
    out = {h: qemu_pids(c.host(h), VM) for h in HOSTS}
    return {h: p for h, p in out.items() if p}


def guest(c: Cluster, host: str, script: str) -> str:
    return c.host(host).run("vm", "exec", VM, "--timeout", "60", "--", "/bin/sh", "-c",
                            script, timeout=90).out.strip()


@dataclass
class Guest:
    c: Cluster
    md5: str = ""                 # the data's md5 line, as written in the guest
    env: dict[str, str] | None = None     # the agents' fault environment now
    checked: int | None = None    # the QEMU whose guest's data a case last read back

    def agents(self, env: dict[str, str]) -> None:
        """h0's and h1's agents run with ``env`` (restarted only if it changes; idle,
        no move under way: killed, which is quicker than their orderly stop)."""
        if env != self.env:
            for h in ("h0", "h1"):
                self.c.lab.stop_agent(self.c.lab_host(h), signal.SIGKILL)
            restart_agents(self.c, env, "h0", "h1")
            self.env = env

    def write(self, host: str) -> None:
        self.md5 = guest(self.c, host, WRITE)

    def ready(self) -> None:
        """The start of a case: the guest runs where its spec says, with the data
        written before (written anew if a case before failed and left it otherwise)."""
        c = self.c
        o = wait_for(lambda: (o := c.running(VM)) and not o["status"].get("move")
                     and qemus(c) == {o["status"]["host"]: [o["status"]["pid"]]} and o,
                     180, f"{VM} running, and only it")
        st = o["status"]
        if o["spec"].get("host") != st["host"]:
            patch_host(c, VM, st["host"])
        if st["pid"] != self.checked \
                and guest(c, st["host"], "md5sum /tmp/blob 2>&1 || true") != self.md5:
            self.write(st["host"])
        self.checked = None


@pytest.fixture(scope="module")
def kv(cluster: Cluster) -> Iterator[Guest]:
    """One guest on h0 with 8 MiB of known data, for every case of the module."""
    c = cluster
    g = Guest(c)
    c.apply(vm_yaml(VM, host="h0", partition="p0", memoryMiB=128))
    wait_for(lambda: c.running(VM), 180, f"{VM} running on h0")
    g.write("h0")
    yield g
    for lh in c.lab.hosts:
        c.lab.stop_agent(lh)
        c.lab.start_agent(lh)
    c.delete_all_vms()


def kill_actor(c: Cluster, g: Guest, actor: str, src: str, dst: str,
               q: Qemus) -> int | None:
    """kill -9 ``actor``; the pid killed (None: it had no process then)."""
    if actor in ("source-agent", "destination-agent"):
        lh = c.lab_host(src if actor == "source-agent" else dst)
        assert lh.agent is not None and lh.agent.poll() is None
        pid = lh.agent.pid
        c.lab.stop_agent(lh, signal.SIGKILL)
        c.lab.start_agent(lh, env=g.env)
        return pid
    if actor == "apiserver":
        pid = c.lab.apiserver.pid
        c.lab.restart_apiserver(down_s=1.0)
        return pid
    pids = q.get(src if actor == "source-qemu" else dst) or []
    assert len(pids) <= 1, q
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return pid
    return None


def settled(c: Cluster, move_id: str) -> dict[str, Any] | None:
    """The FusumaVM's status once move ``move_id`` is over and the guest runs (or is
    reported failed), and the hosts hold what the status says: one QEMU on its host,
    none elsewhere, no other host defining it."""
    o = c.vm(VM)
    st = o.get("status") or {}
    if st.get("move") or (st.get("lastMove") or {}).get("id") != move_id:
        return None
    q = qemus(c)
    if st.get("state") == "Running":
        if c.cond(o, "Ready").get("status") != "True" or q != {st["host"]: [st["pid"]]}:
            return None
    elif st.get("state") != "Failed" or q:
        return None
    held = [h for h in HOSTS if VM in [v["name"] for v in c.host(h).ps()["vms"]]]
    return st if held == [st["host"]] else None


@pytest.mark.parametrize(("phase", "actor"), CASES, ids=[f"{p}-{a}" for p, a in CASES])
def test_kill_during_a_move_between_hosts(kv: Guest, phase: str, actor: str) -> None:
    c, g = kv.c, kv
    ph = PHASES[phase]
    g.agents({FAULT_STREAM_BPS: FAST, **ph.env})
    t0 = time.monotonic()
    g.ready()
    q0 = qemus(c)
    ((src, (pid0,)),) = q0.items()
    st0 = c.vm(VM)["status"]
    assert (st0["host"], st0["pid"], st0["state"]) == (src, pid0, "Running"), st0
    dst = "h1" if src == "h0" else "h0"
    patch_host(c, VM, dst)

    def there() -> tuple[Move, Qemus] | None:
        m = (c.vm(VM).get("status") or {}).get("move") or {}
        q = qemus(c)
        return (m, q) if m and ph.held(m, q, src, dst) else None

    move, q_held = wait_for(there, 60, f"the move held at {phase}", every=0.05)
    if phase == "Streaming":
        time.sleep(0.3)
    t_kill = time.monotonic()
    killed = kill_actor(c, g, actor, src, dst, q_held)
    st = wait_for(lambda: settled(c, move["id"]), 150, f"the end of move {move['id']}",
                  every=0.2)
    recovered_s = time.monotonic() - t_kill
    last = st["lastMove"]

    # At most one QEMU runs the guest; the FusumaVM and that host's ps say where.
    q = qemus(c)
    assert sum(len(p) for p in q.values()) <= 1, f"two QEMUs run the guest: {q}"
    host = st["host"]
    ps = [v for v in c.host(host).ps()["vms"] if v["name"] == VM]
    ours = {pid0, *q_held.get(dst, [])}     # the move's two QEMUs
    if st["state"] == "Running" and st["pid"] in ours:
        assert (last["result"], last.get("decision")) == (
            ("ok", "forward") if host == dst else ("failed", "back")), last
        assert q == {host: [st["pid"]]}, (q, st)
        assert [(v["state"], v["pid"]) for v in ps] == [("running", st["pid"])], ps
        assert guest(c, host, "md5sum /tmp/blob") == g.md5, "the guest's data changed"
        outcome = "moved" if host == dst else "stayed"
    else:
        # The guest is lost: only when the QEMU that held its only copy was killed.
        # The FusumaVM says Failed, or Running in a new QEMU an agent started from its
        # image (where its spec names: a crashed VM is handed to the move's
        # destination). The move went back unless the lost QEMU was the destination's
        # after "forward".
        assert actor.endswith("-qemu"), (actor, st)
        assert (last["result"], last.get("decision")) in (
            ("failed", "back"), ("ok", "forward")), last
        assert last["decision"] == "back" or actor == "destination-qemu", last
        if st["state"] == "Running":
            assert q == {host: [st["pid"]]}, (q, st)
            assert [(v["state"], v["pid"]) for v in ps] == [("running", st["pid"])], ps
            outcome = f"guest lost, started again on {host}"
        else:
            assert not q and [v["state"] for v in ps] == ["crashed"], (q, ps)
            outcome = f"guest lost on {host}"
    # The spec names where the guest is (a move that went back leaves it naming dst).
    patch_host(c, VM, host)
    if outcome.startswith("guest lost"):
        # What an operator does after a lost guest: start it again (no data now).
        if st["state"] != "Running":
            c.host(host).run("vm", "start", VM, check=False)
        wait_for(lambda: c.running(VM), 180, f"{VM} running again")
        g.write(host)

    # The next move of the same VM works (held at the same phase, nothing killed).
    here = host
    there_ = "h1" if here == "h0" else "h0"
    patch_host(c, VM, there_)
    nxt = wait_for(lambda: (v := c.vm(VM)["status"]).get("host") == there_
                   and not v.get("move") and c.running(VM) and v, 120,
                   f"the next move to {there_}", every=0.2)
    assert (nxt["lastMove"]["result"], nxt["lastMove"]["decision"]) == ("ok", "forward")
    assert qemus(c) == {there_: [nxt["pid"]]}
    assert guest(c, there_, "md5sum /tmp/blob") == g.md5
    g.checked = nxt["pid"]
    row = {"phase": phase, "killed": actor if killed else f"{actor} (no process)",
           "from": src, "to": dst, "outcome": outcome, "decision": last.get("decision"),
           "message": last.get("message"), "recovered_s": round(recovered_s, 2),
           "case_s": round(time.monotonic() - t0, 2)}
    (REPO / "test-output").mkdir(exist_ok=True)
    with open(REPO / "test-output" / "host-move-matrix.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
