"""Draining a host: every VM off it, live, to the other hosts (`fusuma host drain`), or
the VMs of some of its partitions into its other partitions, zero-copy, when only their
hypervisor (QEMU) is to be upgraded (`fusuma host drain HOST --partition P`).

A FusumaHost whose ``spec.drain`` is true takes no new VM (placement counts it
unschedulable, ``fusuma.cluster.placement``), and its own agent moves its VMs away: each
pass (``run``) it re-places each VM not pinned by ``spec.host`` on the other host and
partition with the most room (``placement.choose``, the capacity arithmetic every
placement uses), at most ``MAX_MOVING`` at a time, by writing the VM's
``status.placement``. The VM's reconciler on this host then moves it live exactly as
for a change of ``spec.host`` (``fusuma.cluster.hostmove``). A partition named in
``spec.drainPartitions`` takes no new VM either, and the agent re-places each VM in it
not pinned by ``spec.partition`` on another partition of the same host: the VM's
reconciler moves it as for a change of ``spec.partition`` (zero-copy, the guest's RAM
never copied). What is left, moving, moved and refused (with one sentence per VM) goes
to the FusumaHost's ``status.drain``.

A move that fails (or that the destination refuses) is not tried again at the same
place while the drain can send the VM elsewhere: the destination (a host, or a
partition for a move inside the host) is avoided for ``AVOID_S`` (``status.drain.failed``
keeps it, with the reason), the VM is re-placed, and its entry says so in a sentence.

Room is reserved before a placement is written (``fusuma.cluster.room``): the placement
controller chooses room for new and lost VMs at the same time, and two writers each
counting from their own informer could otherwise fill the same last room.

Why the drained host's agent decides, and not the placement controller: the admission
policy (``fusuma.cluster.policy``) lets the controller place only a VM that has no
place or is lost, because any host's identity may act as the controller and
re-placing a placed VM would let one host pull any guest (its RAM) to itself. A host
may always give away what it holds: its agent writes these placements under the rules
it already has. A host that is down cannot; its restartable VMs are started elsewhere
by the controller (failover, ``fusuma.cluster.controller``), and ``progress`` reads
each VM's own sentence for `fusuma host drain`.

``plan`` is the decision as data (no API call), ``run`` the agent's pass, ``progress``
what the CLI shows.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fusuma.cluster.kube import HOST, VM, Obj
from fusuma.cluster.placement import Choice, HostView, choose, load, record
from fusuma.cluster.resources import (
    LOST,
    PENDING,
    RUNNING,
    VmView,
    condition,
    deleting,
    label,
    now_iso,
    parse_time,
    set_condition,
)
from fusuma.frozen import frozen

if TYPE_CHECKING:
    from fusuma.cluster.context import AgentContext
    from fusuma.cluster.room import Hold

LOG = logging.getLogger(__name__)
# VMs of a draining host that move at once: each move streams the guest's RAM out of
# this host, so a few at a time finish sooner than all at once, and each one reserves
# its room at its destination only when it is sent.
MAX_MOVING = 2
# How long a destination where a VM's move failed is not chosen for it again.
AVOID_S = 300.0
# status.drain.state values.
DRAINING, DRAINED, BLOCKED = "Draining", "Drained", "Blocked"
DONE = (DRAINED, BLOCKED)
# The sentence the VM reconciler writes when a move between partitions fails
# (fusuma.cluster.reconcile): what names the partition that failed.
PARTITION_MOVE_FAILED = "move to partition {!r} failed"


@frozen
class Send:
    """Re-place VM ``namespace/name`` on ``host``/``partition``."""

    namespace: str
    name: str
    host: str
    partition: str


@frozen
class Plan:
    sends: tuple[Send, ...]
    # The FusumaHost's status.drain as it should be (None: no drain, none shown).
    status: Obj | None


def _here(v: VmView, me: str) -> bool:
    """Whether VM ``v`` is (or is being made) on host ``me``, or still moving off it:
    a move from ``me`` ends when its source cleared the record (the guest runs at the
    destination before that, but this host still holds its copy until then)."""
    if v.move is not None and v.move.get("fromHost") == me:
        return True
    if v.host is not None:
        return v.host == me
    return v.want_host == me and v.state != LOST


def _in_parts(v: VmView, me: str, parts: set[str]) -> bool:
    """Whether VM ``v`` is (or is being made) in one of partitions ``parts`` of ``me``."""
    if v.move is not None:
        return bool(v.move.get("fromHost") == me
                    and str(v.move.get("from") or "").split("/")[-1] in parts)
    if v.host is not None:
        return v.host == me and v.status.get("partition") in parts
    return v.want_host == me and v.want_partition in parts and v.state != LOST


def _failure(v: VmView, me: str) -> tuple[str, str] | None:
    """Where a move of ``v`` off here failed, as the place to avoid (a host, or
    ``host/partition`` for a move inside ``me``), and its sentence; None when its last
    try at its current destination did not fail. A refusal that does not name the
    destination is the VM's own (its snapshots, its storage): see ``_refusal``."""
    if v.move is not None:
        return None
    last = v.status.get("lastMove") or {}
    if v.want_host and v.want_host != me and last.get("result") == "failed" \
            and str(last.get("to") or "").split("/")[0] == v.want_host:
        return v.want_host, str(last.get("message") or "the move failed.")
    ready = condition(v.obj, "Ready") or {}
    msg = str(ready.get("message") or "")
    if ready.get("reason") != "MoveFailed":
        return None
    if v.want_host and v.want_host != me and f"to host {v.want_host!r}" in msg:
        return v.want_host, msg
    part = v.want_partition
    if v.want_host == me and part and part != v.status.get("partition") \
            and msg.startswith(PARTITION_MOVE_FAILED.format(part)):
        return f"{me}/{part}", msg
    return None


def _refusal(v: VmView, me: str) -> str | None:
    """The sentence of a move this host refuses to begin for reasons of the VM's own
    (they hold wherever it is sent)."""
    ready = condition(v.obj, "Ready") or {}
    msg = str(ready.get("message") or "")
    # One that names its destination is that destination's (``_failure``, or an
    # earlier destination's, the VM since sent elsewhere).
    if v.move is None and ready.get("reason") == "MoveFailed" \
            and "to host '" not in msg and not msg.startswith("move to partition "):
        return str(v.status.get("message") or msg or "the move failed.")
    return None


@dataclass
class _Pass:
    me: str
    hosts: dict[str, HostView]
    # The VMs (namespace, name) each host has or is to have: VM names are unique per
    # host.
    taken: dict[str, set[tuple[str, str]]]
    lost: set[str]
    inside: bool                  # moves between this host's partitions
    failed: list[Obj]             # status.drain.failed: where not to send whom
    moving: list[Obj] = field(default_factory=list)
    refused: list[Obj] = field(default_factory=list)
    waiting: int = 0
    sends: list[Send] = field(default_factory=list)

    def avoided(self, who: str) -> list[str]:
        return [str(f["avoid"]) for f in self.failed if f["vm"] == who]

    def where(self, v: VmView) -> Choice | str:
        avoid = self.avoided(label(v.obj))
        if self.inside:
            h = self.hosts[self.me]
            parts = [q for q in h.partitions if f"{self.me}/{q.name}" not in avoid]
            return choose(v, {self.me: dataclasses.replace(h, partitions=parts)})
        if not self.hosts:
            return (f"no other host can take it: {self.me} is the cluster's only host; "
                    "add one (`fusuma cluster join`, then `fusuma agent` on it).")
        me = (v.namespace, v.name)
        others = {h: {n for ns, n in vms if (ns, n) != me} for h, vms in self.taken.items()}
        return choose(v, self.hosts, exclude=self.lost, taken_names=others,
                      avoid={h: "where its move just failed" for h in avoid})

    def send(self, v: VmView, got: Choice, note: str | None = None) -> None:
        self.sends.append(Send(v.namespace, v.name, got.host, got.partition))
        entry = {"vm": label(v.obj), "to": f"{got.host}/{got.partition}"}
        self.moving.append({**entry, "message": note} if note else entry)
        # Counted at once, so the next VM of this pass sees the room this one takes.
        h = self.hosts[got.host]
        h.vms.append(record(v, got.partition, h.accelerator))
        self.taken.setdefault(got.host, set()).add((v.namespace, v.name))


def _note(avoid: str, msg: str) -> str:
    """The sentence of a VM sent elsewhere after its move to ``avoid`` failed."""
    return (f"{msg.rstrip('.')}; sent elsewhere instead ({avoid} is not tried for it "
            f"again for {AVOID_S / 60:g} minutes).")


def _views(me: str, mine: Obj, hosts: list[Obj], lost: set[str],
           inside: bool) -> dict[str, HostView]:
    """The hosts a drain may send VMs to: the others, or for a drain of partitions
    this host itself (its drained partitions left out; cordoned or not, a VM already
    here is no new VM)."""
    if inside:
        return {me: dataclasses.replace(HostView.from_obj(mine, True), schedulable=True)}
    return {h["metadata"]["name"]: HostView.from_obj(
        h, h["metadata"]["name"] not in lost and _ready(h))
        for h in hosts if h["metadata"]["name"] != me}


def _still_failed(prev: Obj, now: str) -> list[Obj]:
    """status.drain.failed without the entries older than AVOID_S."""
    t = parse_time(now) or time.time()
    return [dict(f) for f in prev.get("failed") or []
            if t - (parse_time(str(f.get("at") or "")) or 0.0) < AVOID_S]


def plan(me: str, hosts: list[Obj], vms: list[Obj], lost: set[str], now: str,
         limit: int = MAX_MOVING, holds: tuple[Hold, ...] = ()) -> Plan:
    """What host ``me``'s agent does about a drain this pass: the VMs to re-place and
    the FusumaHost's ``status.drain``. ``hosts`` and ``vms`` are every FusumaHost and
    FusumaVM as the informers hold them; ``lost`` the hosts whose Lease expired;
    ``holds`` the room other writers reserved (``fusuma.cluster.room``)."""
    from fusuma.cluster import room

    mine = next((h for h in hosts if h["metadata"]["name"] == me), None)
    spec = (mine or {}).get("spec") or {}
    parts = set(spec.get("drainPartitions") or [])
    if mine is None or not (spec.get("drain") or parts):
        return Plan((), None)
    inside = not spec.get("drain")
    prev = dict((mine.get("status") or {}).get("drain") or {})
    views = _views(me, mine, hosts, lost, inside)
    live = [VmView(o) for o in vms if not deleting(o)]
    load(views, live)
    room.count(views, live, holds)
    taken: dict[str, set[tuple[str, str]]] = {}
    for v in live:
        if v.want_host:
            taken.setdefault(v.want_host, set()).add((v.namespace, v.name))
    p = _Pass(me, views, taken, lost, inside, _still_failed(prev, now))
    here = sorted((v for v in live if (_in_parts(v, me, parts) if inside
                                       else _here(v, me))), key=lambda v: label(v.obj))
    todo: list[tuple[VmView, str | None]] = []
    for v in here:
        who = label(v.obj)
        failure = _failure(v, me)
        refusal = _refusal(v, me)
        gone = (v.want_host != me or v.want_partition not in parts) if inside \
            else bool(v.want_host and v.want_host != me)
        if v.move is not None:
            p.moving.append({"vm": who, "to": str(v.move.get("to") or v.want_host)})
        elif not inside and v.spec.get("host") == me:
            p.refused.append({"vm": who, "message": f"pinned to {me} by spec.host; clear "
                              "it or name another host."})
        elif inside and v.spec.get("partition") in parts:
            p.refused.append({"vm": who, "message": f"pinned to partition "
                              f"{v.spec['partition']} by spec.partition; name another "
                              "partition of this host there (the VM moves zero-copy) or "
                              "clear it."})
        elif failure is not None:
            avoid, msg = failure
            if avoid not in p.avoided(who):
                p.failed.append({"vm": who, "avoid": avoid, "at": now, "message": msg})
            todo.append((v, _note(avoid, msg)))
        elif refusal is not None:
            p.refused.append({"vm": who, "message": refusal})
        elif gone:
            entry = {"vm": who, "to": f"{v.want_host}/{v.want_partition or '?'}"}
            f = next((f for f in reversed(p.failed) if f["vm"] == who), None)
            p.moving.append(entry if f is None else
                            {**entry, "message": _note(str(f["avoid"]), str(f["message"]))})
        else:
            todo.append((v, None))
    for v, note in todo:
        got = p.where(v)
        if isinstance(got, str):
            if note is not None:
                # Nowhere else: it stays placed where it failed, and is tried there
                # again (hostmove waits a minute between tries).
                failed = next(f for f in reversed(p.failed) if f["vm"] == label(v.obj))
                got = (f"{str(failed['message']).rstrip('.')}; no other place can take "
                       f"it ({got.rstrip('.')}), so it is tried there again within a "
                       "minute.")
            p.refused.append({"vm": label(v.obj), "message": got})
        elif len(p.moving) < limit:
            p.send(v, got, note)
        else:
            p.waiting += 1
    status = _status(me, mine, prev, p, live, len(here), now, parts if inside else None)
    return Plan(tuple(p.sends), status)


def _status(me: str, mine: Obj, prev: Obj, p: _Pass, live: list[VmView], left: int,
            now: str, parts: set[str] | None) -> Obj:
    """status.drain: what moved since the drain began (the VMs it listed as moving
    that now run elsewhere), what moves, what cannot leave, and one sentence."""
    by_label = {label(v.obj): v for v in live}
    moving_now = {m["vm"] for m in p.moving}
    moved = [dict(m) for m in prev.get("moved") or []]
    seen = {m["vm"] for m in moved}
    for m in prev.get("moving") or []:
        v = by_label.get(m["vm"])
        if v is None or m["vm"] in seen or m["vm"] in moving_now or (
                _in_parts(v, me, parts) if parts is not None else _here(v, me)):
            continue
        entry = {"vm": m["vm"], "to": f"{v.host or v.want_host}/"
                 f"{v.status.get('partition') or v.want_partition or '?'}"}
        last = v.status.get("lastMove") or {}
        if last.get("downtimeMs") is not None:
            entry["downtimeMs"] = last["downtimeMs"]
        moved.append(entry)
        seen.add(m["vm"])
    where = f"host {me}" if parts is None else \
        f"partition(s) {', '.join(sorted(parts))} of host {me}"
    if left == 0:
        state = DRAINED
        again = "".join(f" --partition {q}" for q in sorted(parts or ()))
        msg = f"no VM is left on {where} ({len(moved)} moved); `fusuma host uncordon " \
              f"{me}{again}` lets VMs be placed here again."
    elif p.moving or p.waiting or left > len(p.refused):
        state = DRAINING
        msg = (f"{left} VM(s) left on {where}: {len(p.moving)} moving, {p.waiting} "
               f"waiting, {len(p.refused)} that cannot leave.")
    else:
        state = BLOCKED
        msg = (f"{len(p.refused)} VM(s) cannot leave {where} (status.drain.refused "
               f"says why for each); fix them, or `fusuma host uncordon {me}`.")
    out = {"state": state, "message": msg, "startedAt": prev.get("startedAt") or now,
           "observedGeneration": int(mine["metadata"].get("generation") or 0),
           "remaining": left, "waiting": p.waiting, "moving": p.moving, "moved": moved,
           "refused": p.refused}
    if parts is not None:
        out["partitions"] = sorted(parts)
    if p.failed:
        out["failed"] = p.failed
    return out


def _ready(h: Obj) -> bool:
    c = condition(h, "Ready")
    return c is not None and c.get("status") == "True"


def run(a: AgentContext) -> None:
    """The agent's pass: reserve the room the plan sends VMs to (planning again when
    another writer reserved some meanwhile), re-place them, show the drain's status."""
    from fusuma.cluster.room import TRIES, Hold, Ledger

    hosts = a.hosts_informer.items()
    lost = {h["metadata"]["name"] for h in hosts
            if h["metadata"]["name"] != a.host and a.host_lost(h["metadata"]["name"])}
    ledger = Ledger(a.kube, a.host)
    # The ledger is read only when there is something to send: room others hold only
    # lessens what a plan may send.
    p = plan(a.host, hosts, a.vms_informer.items(), lost, now_iso())
    for _ in range(TRIES if p.sends else 0):
        holds = tuple(ledger.read())
        p = plan(a.host, hosts, a.vms_informer.items(), lost, now_iso(), holds=holds)
        views = {h["metadata"]["name"]: HostView.from_obj(h, True) for h in hosts}
        new = [Hold.of(VmView(o), views[s.host], s.partition, ledger.clock())
               for s in p.sends
               if (o := a.vms_informer.get(s.namespace, s.name)) is not None]
        if ledger.take(new):
            break
    else:
        if p.sends:
            # Others kept reserving room under this pass: send nothing now (the rest
            # waits), and try again at the next pass.
            p = plan(a.host, hosts, a.vms_informer.items(), lost, now_iso(), limit=0,
                     holds=tuple(ledger.read()))
    for s in p.sends:
        obj = a.vms_informer.get(s.namespace, s.name)
        if obj is None:
            continue
        v = VmView(obj)
        if s.host != a.host:
            msg = f"host {a.host} is drained: moving live to {s.host}/{s.partition}"
        else:
            msg = (f"partition {v.status.get('partition')} of host {a.host} is drained: "
                   f"moving {'zero-copy' if v.shared_ram else 'by copy'} to {s.partition}")
        conds = set_condition(list(v.status.get("conditions") or []), "Placed", True,
                              "Drained", msg, v.generation)
        new_obj = a.kube.patch_status(VM, s.name, {
            "placement": {"host": s.host, "partition": s.partition, "at": now_iso(),
                          "reason": "Drained"}, "conditions": conds}, s.namespace)
        a.vms_informer.put(new_obj)
        a.events.emit(obj, "Drained", msg)
    mine = a.hosts_informer.get("", a.host) or {}
    if (mine.get("status") or {}).get("drain") != p.status:
        a.hosts_informer.put(a.kube.patch_status(HOST, a.host, {"drain": p.status}))


def wanted(host: Obj) -> bool:
    """Whether the agent has a drain to run or a drain's status to clear on ``host``."""
    spec = host.get("spec") or {}
    return bool(spec.get("drain") or spec.get("drainPartitions")
                or (host.get("status") or {}).get("drain"))


# -- what `fusuma host drain` shows --------------------------------------------------------
def down(host: Obj) -> bool:
    """Whether the placement controller marked ``host`` lost (its Lease expired)."""
    c = condition(host, "Ready") or {}
    return c.get("status") == "False" and c.get("reason") == "LeaseExpired"


def progress(host: Obj, vms: list[Obj]) -> Obj | None:
    """The drain of ``host`` as `fusuma host drain` shows it: the agent's status.drain
    once it answered the current spec (None: not yet); for a host that is down, read
    from its VMs, which the placement controller restarts elsewhere or says why not."""
    name = host["metadata"]["name"]
    if down(host):
        since = str((condition(host, "Ready") or {}).get("lastTransitionTime") or "")
        return _down_progress(name, since, vms)
    st = dict((host.get("status") or {}).get("drain") or {})
    if int(st.get("observedGeneration") or -1) < int(host["metadata"].get("generation")
                                                     or 0):
        return None
    return {**st, "down": False}


def _down_progress(name: str, since: str, vms: list[Obj]) -> Obj:
    """The VMs host ``name`` had when it went down (at ``since``: its VMs were marked
    lost then or later, not at an earlier loss), as the controller left them."""
    moving: list[Obj] = []
    moved: list[Obj] = []
    refused: list[Obj] = []
    for o in vms:
        v = VmView(o)
        lost_here = v.status.get("lostFrom") == name \
            and str(v.status.get("lostAt") or "") >= since
        if deleting(o) or not (lost_here or _here(v, name)):
            continue
        who = label(o)
        if v.host and v.host != name and v.state == RUNNING:
            moved.append({"vm": who, "to": f"{v.host}/{v.status.get('partition')}",
                          "restarted": True})
        elif v.state == LOST or (v.state == PENDING and v.status.get("message")):
            refused.append({"vm": who, "message": str(v.status.get("message") or "")})
        else:
            moving.append({"vm": who, "to": f"{v.want_host or '?'}/"
                           f"{v.want_partition or '?'}"})
    left = len(moving) + len(refused)
    state = DRAINED if left == 0 else DRAINING if moving else BLOCKED
    msg = (f"host {name} is down (its Lease expired): its restartable VMs are started "
           f"again on other hosts from their images (their RAM is gone); "
           f"{len(moved)} restarted, {len(moving)} starting, {len(refused)} cannot be.")
    return {"state": state, "message": msg, "remaining": left, "waiting": 0,
            "moving": moving, "moved": moved, "refused": refused, "down": True}


def describe(st: Obj) -> list[str]:
    """One line per VM of a drain's progress, for the terminal."""
    out = [f"moved {m['vm']} to {m['to']}" + (" (restarted from its image)"
           if m.get("restarted") else f" ({m['downtimeMs']} ms downtime)"
           if m.get("downtimeMs") is not None else "") for m in st.get("moved") or []]
    out += [f"moving {m['vm']} to {m['to']}" + (f": {m['message']}" if m.get("message")
                                                 else "") for m in st.get("moving") or []]
    out += [f"cannot move {r['vm']}: {r['message']}" for r in st.get("refused") or []]
    return out


def summary(hosts: list[Obj]) -> list[dict[str, Any]]:
    """`fusuma host list`: each host, whether it takes new VMs, its drain."""
    out = []
    for h in sorted(hosts, key=lambda x: str(x["metadata"]["name"])):
        spec, st = h.get("spec") or {}, h.get("status") or {}
        ready = condition(h, "Ready") or {}
        out.append({"name": h["metadata"]["name"], "ready": ready.get("status") == "True",
                    "schedulable": not (spec.get("unschedulable") or spec.get("drain")),
                    "drain": bool(spec.get("drain")),
                    "drainState": (st.get("drain") or {}).get("state"),
                    "address": st.get("address"), "vms": st.get("vms"),
                    "freeMiB": st.get("freeMiB"), "message": ready.get("message")})
    return out
