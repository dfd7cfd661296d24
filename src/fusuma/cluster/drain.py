"""Draining a host: every VM off it, live, to the other hosts (`fusuma host drain`).

A FusumaHost whose ``spec.drain`` is true takes no new VM (placement counts it
unschedulable, ``fusuma.cluster.placement``), and its own agent moves its VMs away: each
pass (``run``) it re-places each VM not pinned by ``spec.host`` on the other host and
partition with the most room (``placement.choose``, the capacity arithmetic every
placement uses), at most ``MAX_MOVING`` at a time, by writing the VM's
``status.placement``. The VM's reconciler on this host then moves it live exactly as
for a change of ``spec.host`` (``fusuma.cluster.hostmove``). What is left, moving, moved
and refused (with one sentence per VM) goes to the FusumaHost's ``status.drain``.

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

import logging
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
    set_condition,
)
from fusuma.frozen import frozen

if TYPE_CHECKING:
    from fusuma.cluster.context import AgentContext

LOG = logging.getLogger(__name__)
# VMs of a draining host that move at once: each move streams the guest's RAM out of
# this host, so a few at a time finish sooner than all at once, and each one reserves
# its room at its destination only when it is sent.
MAX_MOVING = 2
# status.drain.state values.
DRAINING, DRAINED, BLOCKED = "Draining", "Drained", "Blocked"
DONE = (DRAINED, BLOCKED)


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


def _failed_move(v: VmView) -> str | None:
    """The sentence of a move off this host that failed and is waiting to be tried
    again (hostmove retries it), if that is where ``v`` stands."""
    last = v.status.get("lastMove") or {}
    if v.move is None and last.get("result") == "failed" \
            and str(last.get("to") or "").split("/")[0] == v.want_host:
        return (f"{last.get('message') or 'the move failed'} It is tried again within "
                "a minute.")
    reason = (condition(v.obj, "Ready") or {}).get("reason")
    if v.move is None and reason == "MoveFailed":
        return str(v.status.get("message") or "the move failed.")
    return None


@dataclass
class _Pass:
    me: str
    hosts: dict[str, HostView]
    # The VMs (namespace, name) each host has or is to have: VM names are unique per
    # host.
    taken: dict[str, set[tuple[str, str]]]
    lost: set[str]
    moving: list[Obj] = field(default_factory=list)
    refused: list[Obj] = field(default_factory=list)
    waiting: int = 0
    sends: list[Send] = field(default_factory=list)

    def where(self, v: VmView) -> Choice | str:
        if not self.hosts:
            return (f"no other host can take it: {self.me} is the cluster's only host; "
                    "add one (`fusuma cluster join`, then `fusuma agent` on it).")
        me = (v.namespace, v.name)
        others = {h: {n for ns, n in vms if (ns, n) != me} for h, vms in self.taken.items()}
        return choose(v, self.hosts, exclude=self.lost, taken_names=others)

    def send(self, v: VmView, got: Choice) -> None:
        self.sends.append(Send(v.namespace, v.name, got.host, got.partition))
        self.moving.append({"vm": label(v.obj), "to": f"{got.host}/{got.partition}"})
        # Counted at once, so the next VM of this pass sees the room this one takes.
        h = self.hosts[got.host]
        h.vms.append(record(v, got.partition, h.accelerator))
        self.taken.setdefault(got.host, set()).add((v.namespace, v.name))


def plan(me: str, hosts: list[Obj], vms: list[Obj], lost: set[str], now: str,
         limit: int = MAX_MOVING) -> Plan:
    """What host ``me``'s agent does about a drain this pass: the VMs to re-place and
    the FusumaHost's ``status.drain``. ``hosts`` and ``vms`` are every FusumaHost and
    FusumaVM as the informers hold them; ``lost`` the hosts whose Lease expired."""
    mine = next((h for h in hosts if h["metadata"]["name"] == me), None)
    if mine is None or not (mine.get("spec") or {}).get("drain"):
        return Plan((), None)
    prev = dict((mine.get("status") or {}).get("drain") or {})
    views = {h["metadata"]["name"]: HostView.from_obj(
        h, h["metadata"]["name"] not in lost and _ready(h))
        for h in hosts if h["metadata"]["name"] != me}
    live = [VmView(o) for o in vms if not deleting(o)]
    load(views, live)
    taken: dict[str, set[tuple[str, str]]] = {}
    for v in live:
        if v.want_host:
            taken.setdefault(v.want_host, set()).add((v.namespace, v.name))
    p = _Pass(me, views, taken, lost)
    here = sorted((v for v in live if _here(v, me)), key=lambda v: label(v.obj))
    todo: list[VmView] = []
    for v in here:
        who = label(v.obj)
        failed = _failed_move(v) if v.want_host != me else None
        if v.move is not None:
            p.moving.append({"vm": who, "to": str(v.move.get("to") or v.want_host)})
        elif v.spec.get("host") == me:
            p.refused.append({"vm": who, "message": f"pinned to {me} by spec.host; clear "
                              "it or name another host."})
        elif failed is not None:
            p.refused.append({"vm": who, "message": failed})
        elif v.want_host and v.want_host != me:
            p.moving.append({"vm": who, "to": f"{v.want_host}/{v.want_partition or '?'}"})
        else:
            todo.append(v)
    for v in todo:
        got = p.where(v)
        if isinstance(got, str):
            p.refused.append({"vm": label(v.obj), "message": got})
        elif len(p.moving) < limit:
            p.send(v, got)
        else:
            p.waiting += 1
    status = _status(me, mine, prev, p, live, len(here), now)
    return Plan(tuple(p.sends), status)


def _status(me: str, mine: Obj, prev: Obj, p: _Pass, live: list[VmView], left: int,
            now: str) -> Obj:
    """status.drain: what moved since the drain began (the VMs it listed as moving
    that now run elsewhere), what moves, what cannot leave, and one sentence."""
    by_label = {label(v.obj): v for v in live}
    moving_now = {m["vm"] for m in p.moving}
    moved = [dict(m) for m in prev.get("moved") or []]
    seen = {m["vm"] for m in moved}
    for m in prev.get("moving") or []:
        v = by_label.get(m["vm"])
        if v is None or m["vm"] in seen or m["vm"] in moving_now or _here(v, me):
            continue
        entry = {"vm": m["vm"], "to": f"{v.host or v.want_host}/"
                 f"{v.status.get('partition') or v.want_partition or '?'}"}
        last = v.status.get("lastMove") or {}
        if last.get("downtimeMs") is not None:
            entry["downtimeMs"] = last["downtimeMs"]
        moved.append(entry)
        seen.add(m["vm"])
    if left == 0:
        state = DRAINED
        msg = (f"no VM is left on host {me} ({len(moved)} moved); `fusuma host uncordon "
               f"{me}` lets VMs be placed here again.")
    elif p.moving or p.waiting or left > len(p.refused):
        state = DRAINING
        msg = (f"{left} VM(s) left on host {me}: {len(p.moving)} moving, {p.waiting} "
               f"waiting, {len(p.refused)} that cannot leave.")
    else:
        state = BLOCKED
        msg = (f"{len(p.refused)} VM(s) cannot leave host {me} (status.drain.refused "
               f"says why for each); fix them, or `fusuma host uncordon {me}`.")
    return {"state": state, "message": msg, "startedAt": prev.get("startedAt") or now,
            "observedGeneration": int(mine["metadata"].get("generation") or 0),
            "remaining": left, "waiting": p.waiting, "moving": p.moving, "moved": moved,
            "refused": p.refused}


def _ready(h: Obj) -> bool:
    c = condition(h, "Ready")
    return c is not None and c.get("status") == "True"


def run(a: AgentContext) -> None:
    """The agent's pass: re-place what the plan sends, and show the drain's status."""
    hosts = a.hosts_informer.items()
    lost = {h["metadata"]["name"] for h in hosts
            if h["metadata"]["name"] != a.host and a.host_lost(h["metadata"]["name"])}
    p = plan(a.host, hosts, a.vms_informer.items(), lost, now_iso())
    for s in p.sends:
        obj = a.vms_informer.get(s.namespace, s.name)
        if obj is None:
            continue
        v = VmView(obj)
        msg = f"host {a.host} is drained: moving live to {s.host}/{s.partition}"
        conds = set_condition(list(v.status.get("conditions") or []), "Placed", True,
                              "Drained", msg, v.generation)
        new = a.kube.patch_status(VM, s.name, {
            "placement": {"host": s.host, "partition": s.partition, "at": now_iso(),
                          "reason": "Drained"}, "conditions": conds}, s.namespace)
        a.vms_informer.put(new)
        a.events.emit(obj, "Drained", msg)
    mine = a.hosts_informer.get("", a.host) or {}
    if (mine.get("status") or {}).get("drain") != p.status:
        a.hosts_informer.put(a.kube.patch_status(HOST, a.host, {"drain": p.status}))


def wanted(host: Obj) -> bool:
    """Whether the agent has a drain to run or a drain's status to clear on ``host``."""
    return bool((host.get("spec") or {}).get("drain")
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
    out += [f"moving {m['vm']} to {m['to']}" for m in st.get("moving") or []]
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
