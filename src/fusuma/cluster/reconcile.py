"""One host's half of the cluster: make this host's partitions and VMs what their
objects ask, through fusuma's own operations (the CLI's and the API's), and say so in
their status, conditions and Events.

Level-based: each pass compares an object with the host as it is now (the state file
and the live QEMUs), so a pass after a restart of the agent does only what is still
missing and never acts twice. A refusal (an unknown partition, no room, a name taken)
is a condition with fusuma's own sentence; the operations are transactional, so nothing
is left half made.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusuma.cluster import FINALIZER
from fusuma.cluster.context import AgentContext
from fusuma.cluster.events import WARNING
from fusuma.cluster.kube import PARTITION, SEGMENT, VM, Kind, Obj
from fusuma.cluster.moveslots import unqueued
from fusuma.cluster.owners import Owner, Section
from fusuma.cluster.resources import (
    CREATING,
    FAILED,
    LOST,
    MOVING,
    RUNNING,
    STOPPED,
    VmView,
    deleting,
    has_finalizer,
    now_iso,
    same_conditions,
    set_condition,
)
from fusuma.errors import (
    ConflictError,
    FusumaError,
    NotFoundError,
    ResourceError,
    SpecError,
    StateError,
)

if TYPE_CHECKING:
    from fusuma.migration import MigrationResult
    from fusuma.ops.context import Ctx
    from fusuma.state import VmRecord

LOG = logging.getLogger(__name__)
# A refused object is tried again this often even if its spec did not change (room may
# have been made meanwhile).
RETRY_FAILED_S = 30.0


def reason_of(exc: FusumaError) -> str:
    if isinstance(exc, ResourceError):
        return "InsufficientResources"
    if isinstance(exc, ConflictError):
        return "NameConflict" if "named" in str(exc) else "Conflict"
    if isinstance(exc, NotFoundError):
        return "NotFound"
    if isinstance(exc, SpecError):
        return "InvalidSpec"
    if isinstance(exc, StateError):
        return "WrongState"
    return type(exc).__name__.removesuffix("Error") + "Failed"


def local_state(rec: VmRecord | None) -> str:
    """The FusumaVM state for this host's record (and live QEMU)."""
    if rec is None:
        return CREATING
    from fusuma.vm.view import VmView as LocalView

    s = LocalView(rec).state
    return {"running": RUNNING, "paused": RUNNING, "migrating": MOVING,
            "stopped": STOPPED, "crashed": FAILED, "starting": CREATING,
            "stopping": STOPPED}.get(s, s)


def resident_mib(pid: int | None) -> int | None:
    if not pid:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError):
        return None
    return None


def last_move(host: str, res: MigrationResult, started: str) -> dict[str, Any]:
    """status.lastMove of a move between partitions of this host: its figures as
    `fusuma migrate --json` gives them, the downtime's steps included (MOVE_STEPS)."""
    from fusuma.cluster.crds import MOVE_STEPS

    move: dict[str, Any] = {
        "kind": "in-host", "mode": res.mode, "from": f"{host}/{res.source}",
        "to": f"{host}/{res.to}", "downtimeMs": res.downtime_ms, "totalMs": res.total_ms,
        "prepareMs": res.prepare_ms, "bytesSent": res.bytes_sent, "paused": res.paused,
        "result": "ok", "startedAt": started, "finishedAt": now_iso()}
    if res.steps_ms:
        move["steps"] = {MOVE_STEPS[k][0]: ms for k, ms in res.steps_ms.items()
                         if k in MOVE_STEPS}
    return move


class VmReconciler:
    def __init__(self, agent: AgentContext) -> None:
        self.a = agent
        self.failed_at: dict[str, float] = {}
        self.create_failed_at: dict[str, float] = {}
        # A between-host move that failed: (the spec generation, when).
        self.move_failed: dict[str, tuple[int, float]] = {}

    # -- status ---------------------------------------------------------------------
    def write_status(self, v: VmView, fields: dict[str, Any],
                     conds: list[tuple[str, bool | None, str, str]]) -> None:
        """Merge ``fields`` and conditions into v's status, if anything changed."""
        st = v.status
        # A move between hosts this host waited to start is no longer wanted here.
        conditions: list[Obj] = list(st.get("conditions") or [])
        conditions = unqueued(st).get("conditions", conditions)
        for ctype, ok, reason, msg in conds:
            conditions = set_condition(conditions, ctype, ok, reason, msg, v.generation)
        fields = {**fields, "observedGeneration": v.generation}
        changed = {k: val for k, val in fields.items() if st.get(k) != val}
        if not changed and same_conditions(conditions, list(st.get("conditions") or [])):
            return
        new = self.a.kube.patch_status(VM, v.name, {**changed, "conditions": conditions},
                                       v.namespace)
        self.a.vms_informer.put(new)

    def fail(self, v: VmView, reason: str, message: str, *, event: bool = True,
             state: str = FAILED, fields: dict[str, Any] | None = None) -> None:
        key = f"{v.namespace}/{v.name}"
        first = not (v.state == state and (v.status.get("message") == message))
        self.failed_at[key] = time.monotonic()
        self.write_status(v, {"state": state, "message": message, **(fields or {})},
                          [("Ready", False, reason, message)])
        if event and first:
            self.a.events.emit(v.obj, reason, message, WARNING)

    def running_status(self, v: VmView, rec: VmRecord) -> None:
        state = local_state(rec)
        want_run = v.running
        ok = (state == RUNNING) if want_run else (state == STOPPED)
        if ok:
            cond = ("Ready", True, "Running" if want_run else "Stopped",
                    f"runs on host {self.a.host} in partition {rec.partition}"
                    if want_run else f"stopped, defined on host {self.a.host}")
        else:
            cond = ("Ready", False, state, rec.error or f"{v.name} is {state.lower()}")
        pid = rec.pid if state in (RUNNING, MOVING) else None
        nics = [{"index": n.index, "network": n.network, "ip": n.ip, "mac": n.mac}
                for n in sorted(self.a.ctx().db.nics(vm=rec.name), key=lambda n: n.index)]
        self.write_status(v, {
            "nics": nics or v.status.get("nics"),
            "state": state, "host": self.a.host, "partition": rec.partition,
            "pid": pid, "accelerator": rec.accel_used, "message": None if ok else
            (rec.error or None), "memoryMiB": resident_mib(pid), "ownerUID": v.uid,
            "qemu": self.a.qemu_version_of(rec.qemu_binary)},
            [cond])

    # -- the pass -------------------------------------------------------------------
    def reconcile(self, obj: Obj) -> None:
        v = VmView(obj)
        c = self.a.ctx()
        owner = self.a.owners.get("vms", v.name)
        mine = owner is not None and owner.uid == v.uid
        local = c.db.find_vm(v.name)
        if deleting(obj):
            self._delete(c, v, mine, local)
            return
        if v.move is not None and self.a.host in (v.move.get("fromHost"),
                                                  v.move.get("toHost")):
            from fusuma.cluster import hostmove

            hostmove.step(self.a, self, v)
            return
        want = v.want_host
        if want != self.a.host:
            if mine and local is not None and v.host == self.a.host and want \
                    and v.state not in (LOST,):
                from fusuma.cluster import hostmove

                hostmove.begin(self.a, self, v, local)
            elif mine and v.host != self.a.host and v.state != CREATING:
                # Stale once the other host holds it; while it creates it (a create
                # that fails gives the status back here), this copy may be the only.
                self._drop_stale(c, v, local)
            return
        if v.host not in (None, self.a.host) and v.state != LOST:
            return       # defined on another host: its agent moves it here (hostmove)
        if local is not None and not mine:
            who = f"FusumaVM {owner.label}" if owner else "the CLI or the API (not the " \
                "cluster)"
            self.fail(v, "NameConflict", f"host {self.a.host} already has a VM named "
                      f"{v.name!r}, made by {who}; rename this one or pin it to another "
                      f"host (VM names are unique per host).")
            return
        part = v.want_partition
        if part is None:
            return       # the placement controller picks one
        if c.db.find_partition(part) is None:
            names = ", ".join(p.name for p in c.db.partitions()) or "none"
            self.fail(v, "UnknownPartition", f"partition {part!r} does not exist on host "
                      f"{self.a.host} (it has: {names}); name one of those in "
                      f"spec.partition or create a FusumaPartition.")
            return
        if local is None:
            # A create that failed is tried again after a while, or at once for a
            # new spec; the controller marking it Lost again (its old host's Lease
            # still expired) is no new spec.
            if v.state in (FAILED, LOST) \
                    and v.status.get("observedGeneration") == v.generation \
                    and time.monotonic() - self.create_failed_at.get(
                        f"{v.namespace}/{v.name}", 0) < RETRY_FAILED_S:
                return
            local = self._create(c, v, part)
            if local is None:
                return
        if local.partition != part:
            local = self._move_partition(c, v, local, part)
            if local is None:
                return
        self._run_state(c, v, local)

    def _create(self, c: Ctx, v: VmView, part: str) -> VmRecord | None:
        from fusuma.spec import VmSpec

        # Where it was defined before (a lost host's copy may still run): a create
        # that fails gives that back, so the status never names a host that holds
        # nothing, and the lost host, back, does not end the only copy as stale.
        was = {"host": v.host, "partition": v.status.get("partition")}
        self.write_status(v, {"state": CREATING, "host": self.a.host, "partition": part,
                              "message": None},
                          [("Ready", False, "Creating", f"creating on {self.a.host}")])
        self.a.owners.set("vms", v.name, Owner(v.uid, v.namespace, v.name))
        try:
            ips = self._addresses(c, v)
            spec = VmSpec.model_validate(v.vm_spec_fields(part, ips))
            rec = c.vms.create(spec)
        except Exception as exc:           # FusumaError, pydantic's ValidationError
            self.a.owners.remove("vms", v.name)
            self.create_failed_at[f"{v.namespace}/{v.name}"] = time.monotonic()
            now = VmView(self.a.vms_informer.get(v.namespace, v.name) or v.obj)
            if isinstance(exc, FusumaError):
                self.fail(now, reason_of(exc), str(exc), fields=was)
            else:
                self.fail(now, "InvalidSpec", f"the VM spec is not valid: {exc}",
                          fields=was)
            return None
        self.a.add_finalizer(VM, v.obj)
        self.a.events.emit(v.obj, "Created", f"defined on host {self.a.host} in partition "
                           f"{part} ({v.vcpus} vCPU, {v.memory_mib} MiB)")
        return rec

    def _addresses(self, c: Ctx, v: VmView) -> dict[int, str]:
        """Hold an address cluster-wide for each NIC on a FusumaNetwork (its own when
        it holds one already) and show them in status.nics, before anything is defined
        here (fusuma.cluster.addresses)."""
        from fusuma.cluster import addresses

        if not v.spec.get("nics"):
            return {}
        local: dict[str, list[str]] = {}
        for n in c.db.nics():
            if n.ip:
                local.setdefault(n.network, []).append(n.ip)
        ips = addresses.allocate(self.a.kube, self.a.host, v, local)
        if ips:
            # The object as last written (Creating), so its conditions stay.
            now = VmView(self.a.vms_informer.get(v.namespace, v.name) or v.obj)
            self.write_status(now, {"nics": addresses.status_nics(ips, v)}, [])
        return ips

    def _move_partition(self, c: Ctx, v: VmView, rec: VmRecord,
                        part: str) -> VmRecord | None:
        from fusuma.vm.view import VmView as LocalView

        state = LocalView(rec).state
        if state in ("running", "paused"):
            from fusuma.migration import migrate

            mode = "zero-copy" if rec.shared_ram else "copy"
            self.write_status(v, {"state": MOVING}, [])
            started = now_iso()
            try:
                res = migrate(c.parts, v.name, part, mode)
            except FusumaError as exc:
                self.fail(v, "MoveFailed", f"move to partition {part!r} failed: {exc}",
                          state=local_state(c.db.find_vm(v.name)))
                return None
            self.write_status(v, {"lastMove": last_move(self.a.host, res, started)}, [])
            self.a.events.emit(v.obj, "Moved", f"moved {mode} {res.source} -> {res.to} "
                               f"on host {self.a.host}: {res.downtime_ms} ms downtime, "
                               f"{res.total_ms} ms total")
            return c.db.vm(v.name)
        if state not in ("stopped", "crashed"):
            return None      # starting or stopping: the next pass
        # A stopped VM carries nothing but its record: it changes partition in place,
        # its files and disks kept (defining it again would make it a new, empty disk).
        from fusuma.migration import move_stopped

        try:
            move_stopped(c.parts, v.name, part)
        except FusumaError as exc:
            self.fail(v, reason_of(exc), str(exc))
            return None
        self.a.events.emit(v.obj, "Moved", f"stopped VM moved to partition {part}")
        return c.db.vm(v.name)

    def _run_state(self, c: Ctx, v: VmView, rec: VmRecord) -> None:
        from fusuma.vm.view import VmView as LocalView

        state = LocalView(rec).state
        key = f"{v.namespace}/{v.name}"
        if v.running and state in ("stopped", "crashed"):
            if state == "crashed" and time.monotonic() - self.failed_at.get(key, 0) \
                    < RETRY_FAILED_S:
                self.running_status(v, rec)
                return
            try:
                c.vms.start(v.name)
            except FusumaError as exc:
                self.fail(v, "StartFailed", f"cannot start {v.name!r} on host "
                          f"{self.a.host}: {exc}", state=local_state(c.db.find_vm(v.name)))
                return
            rec = c.db.vm(v.name)
            self.a.events.emit(v.obj, "Started", f"started on host {self.a.host} in "
                               f"partition {rec.partition} (pid {rec.pid})")
        elif not v.running and state in ("running", "paused"):
            try:
                c.vms.stop(v.name)
            except FusumaError as exc:
                self.fail(v, "StopFailed", str(exc), state=local_state(c.db.find_vm(v.name)))
                return
            rec = c.db.vm(v.name)
            self.a.events.emit(v.obj, "Stopped", f"stopped on host {self.a.host}")
        self.running_status(v, rec)

    def _delete(self, c: Ctx, v: VmView, mine: bool, local: VmRecord | None) -> None:
        if mine and local is not None:
            try:
                c.vms.delete(v.name, force=True)
            except FusumaError as exc:
                self.fail(v, "DeleteFailed", f"cannot delete {v.name!r} on host "
                          f"{self.a.host}: {exc}")
                return
            self.a.events.emit(v.obj, "Deleted", f"deleted on host {self.a.host}")
        if mine:
            self.a.owners.remove("vms", v.name)
        if mine or v.host in (None, self.a.host):
            from fusuma.cluster import addresses

            # Its addresses this host holds; another holder frees its own (sweep).
            for name in addresses.free(self.a.kube, self.a.host, v.uid):
                LOG.info("address %s freed with FusumaVM %s/%s", name, v.namespace,
                         v.name)
        if has_finalizer(v.obj) and (mine or v.host in (None, self.a.host)):
            self.a.remove_finalizer(VM, v.obj)

    def _drop_stale(self, c: Ctx, v: VmView, local: VmRecord | None) -> None:
        """This host's copy of a VM the cluster runs elsewhere now (restarted there
        after this host was lost): end it, so one guest never runs twice."""
        if local is not None:
            from fusuma.vm import shared

            # Files on shared storage are not this copy's alone: they stay.
            shared.detach(c.paths, v.name)
            try:
                c.vms.delete(v.name, force=True)
            except FusumaError as exc:
                LOG.warning("cannot remove the stale copy of %s: %s", v.name, exc)
                return
            self.a.events.emit(v.obj, "StaleCopyRemoved", f"host {self.a.host} came back "
                               f"and removed its old copy: the VM runs on {v.host or '?'}",
                               WARNING)
        self.a.owners.remove("vms", v.name)


class PartitionReconciler:
    def __init__(self, agent: AgentContext) -> None:
        self.a = agent

    def write_status(self, obj: Obj, fields: dict[str, Any], ok: bool, reason: str,
                     message: str) -> None:
        st = dict(obj.get("status") or {})
        gen = int(obj["metadata"].get("generation") or 0)
        conds = set_condition(list(st.get("conditions") or []), "Ready", ok, reason,
                              message, gen)
        fields = {**fields, "observedGeneration": gen}
        changed = {k: val for k, val in fields.items() if st.get(k) != val}
        if not changed and same_conditions(conds, list(st.get("conditions") or [])):
            return
        new = self.a.kube.patch_status(PARTITION, obj["metadata"]["name"],
                                       {**changed, "conditions": conds})
        self.a.parts_informer.put(new)

    def reconcile(self, obj: Obj) -> None:
        from fusuma import capacity

        c = self.a.ctx()
        spec = obj.get("spec") or {}
        name = str(spec.get("name") or obj["metadata"]["name"])
        uid = str(obj["metadata"]["uid"])
        owner = self.a.owners.get("partitions", name)
        mine = owner is not None and owner.uid == uid
        local = c.db.find_partition(name)
        if deleting(obj):
            if mine and local is not None:
                try:
                    c.parts.delete(name)
                except FusumaError as exc:
                    self.write_status(obj, {"state": "Deleting"}, False, reason_of(exc),
                                      str(exc))
                    return
                self.a.events.emit(obj, "Deleted", f"partition {name} deleted on host "
                                   f"{self.a.host}")
            if mine:
                self.a.owners.remove("partitions", name)
            if FINALIZER in (obj["metadata"].get("finalizers") or []):
                self.a.remove_finalizer(PARTITION, obj)
            return
        if local is not None and not mine:
            self.write_status(obj, {"state": "Failed"}, False, "NameConflict",
                              f"host {self.a.host} already has a partition {name!r} that "
                              "the cluster did not make; pick another name.")
            return
        cpus = [int(x) for x in spec.get("cpus") or []]
        mem = int(spec.get("memoryMiB") or 0)
        if local is None:
            from fusuma.spec import PartitionSpec

            self.a.owners.set("partitions", name, Owner(uid, "", obj["metadata"]["name"]))
            try:
                c.parts.create(PartitionSpec(name=name, cpus=cpus, memory_mib=mem,
                                             qemu=spec.get("qemu") or None))
            except FusumaError as exc:
                self.a.owners.remove("partitions", name)
                self.write_status(obj, {"state": "Failed"}, False, reason_of(exc), str(exc))
                return
            except Exception as exc:
                self.a.owners.remove("partitions", name)
                self.write_status(obj, {"state": "Failed"}, False, "InvalidSpec", str(exc))
                return
            self.a.add_finalizer(PARTITION, obj)
            self.a.events.emit(obj, "Created", f"partition {name} on host {self.a.host}: "
                               f"cores {cpus}, {mem} MiB")
            local = c.db.partition(name)
        elif sorted(local.cpus) != sorted(cpus) or local.memory_mib != mem:
            try:
                c.parts.resize(name, cpus=cpus, memory_mib=mem)
            except FusumaError as exc:
                self.write_status(obj, {"state": "Failed"}, False, reason_of(exc), str(exc))
                return
            self.a.events.emit(obj, "Resized", f"partition {name}: cores {cpus}, {mem} MiB")
            local = c.db.partition(name)
        if c.parts.supervisor_pid(name) is None:
            # Its supervisor died (or the host restarted): a new one adopts its QEMUs.
            try:
                c.parts.start_supervisor(name)
            except FusumaError as exc:
                self.write_status(obj, {"state": "Failed"}, False, reason_of(exc), str(exc))
                return
            self.a.events.emit(obj, "SupervisorStarted", f"partition {name}'s supervisor "
                               f"was not running on host {self.a.host}; started it")
        used = capacity.partition_need(c.db, name).total
        self.write_status(obj, {"state": "Ready",
                                "supervisorPid": c.parts.supervisor_pid(name),
                                "vms": len(c.db.vms(name)), "usedMiB": used},
                          True, "Ready", f"on host {self.a.host}")


def host_entry(a: AgentContext, kind: Kind, obj: Obj, entry: dict[str, Any] | None,
               ready: tuple[str, str], not_ready: tuple[str, str]) -> None:
    """Write this host's own entry of ``obj``'s ``status.hosts`` (None: remove it) and
    the Ready condition of all entries (``ready`` / ``not_ready``: reason, message)."""
    from fusuma.cluster import ConflictApiError

    name = obj["metadata"]["name"]
    for _ in range(10):
        cur = a.kube.get(kind, name)
        st = cur.setdefault("status", {})
        hosts = [h for h in st.get("hosts") or [] if h.get("host") != a.host]
        if entry is not None:
            hosts.append({"host": a.host, **entry})
        if sorted(map(str, hosts)) == sorted(map(str, st.get("hosts") or [])):
            return
        st["hosts"] = sorted(hosts, key=lambda h: str(h["host"]))
        ok = all(h.get("ready") for h in hosts) and bool(hosts)
        reason, message = ready if ok else not_ready
        st["conditions"] = set_condition(list(st.get("conditions") or []), "Ready", ok,
                                         reason, message)
        try:
            a.kube.replace(kind, cur, sub="status")
            return
        except ConflictApiError:
            continue


class PerHostReconciler:
    """A cluster-scoped object every host makes a copy of its own (a segment, a
    network): made when missing, kept, removed with its object (or when it no longer
    names this host) unless something here still uses it. Which host-local object the
    cluster made is kept in the owners' ``section``; each agent writes its own entry of
    ``status.hosts`` (:func:`host_entry`). Subclasses say how to make, keep and remove."""

    kind: Kind
    section: Section
    what: str                                   # "segment", "network"
    ready: tuple[str, str]
    not_ready: tuple[str, str]

    def __init__(self, agent: AgentContext) -> None:
        self.a = agent

    def _entry(self, obj: Obj, entry: dict[str, Any] | None) -> None:
        host_entry(self.a, self.kind, obj, entry, self.ready, self.not_ready)

    def exists(self, c: Ctx, name: str) -> bool:
        raise NotImplementedError

    def wanted(self, obj: Obj) -> bool:
        return True

    def make(self, c: Ctx, obj: Obj) -> None:
        """Make it here (and say so in an Event)."""
        raise NotImplementedError

    def keep(self, c: Ctx, obj: Obj) -> dict[str, Any]:
        """Bring it to what the object says; this host's status entry."""
        raise NotImplementedError

    def remove(self, c: Ctx, name: str) -> None:
        raise NotImplementedError

    def reconcile(self, obj: Obj) -> None:
        c = self.a.ctx()
        name = obj["metadata"]["name"]
        uid = str(obj["metadata"]["uid"])
        owner = self.a.owners.get(self.section, name)
        mine = owner is not None and owner.uid == uid
        here = self.exists(c, name)
        if deleting(obj) or not self.wanted(obj):
            if mine and here:
                try:
                    self.remove(c, name)
                except FusumaError as exc:
                    self._entry(obj, {"ready": True, "message": str(exc)})
                    return
            if mine:
                self.a.owners.remove(self.section, name)
            self._entry(obj, None)
            if deleting(obj):
                self.a.remove_finalizer(self.kind, obj)
            return
        if not here:
            self.a.owners.set(self.section, name, Owner(uid, "", name))
            self.a.add_finalizer(self.kind, obj)
            try:
                self.make(c, obj)
            except FusumaError as exc:
                self.a.owners.remove(self.section, name)
                self._entry(obj, {"ready": False, "message": str(exc)})
                return
        elif not mine:
            self._entry(obj, {"ready": False, "message": f"host {self.a.host} already has "
                              f"a {self.what} {name!r} the cluster did not make"})
            return
        try:
            entry = self.keep(c, obj)
        except FusumaError as exc:
            entry = {"ready": False, "message": str(exc)}
        self._entry(obj, entry)


class SegmentReconciler(PerHostReconciler):
    """A FusumaSegment on this host: built from the named image's root when missing
    (``fusuma segment create NAME --from-image KIND``), removed with its object when no
    VM here uses it."""

    kind = SEGMENT
    section = "segments"
    what = "segment"
    ready = ("Built", "built on every host")
    not_ready = ("NotBuilt", "not built on every host yet")

    def exists(self, c: Ctx, name: str) -> bool:
        return c.db.find_segment(name) is not None

    def wanted(self, obj: Obj) -> bool:
        hosts = (obj.get("spec") or {}).get("hosts")
        return not hosts or self.a.host in hosts

    def make(self, c: Ctx, obj: Obj) -> None:
        from fusuma.ops.segments import segment_manager

        name = obj["metadata"]["name"]
        local = segment_manager(c).create(name, from_image=str(
            (obj.get("spec") or {}).get("fromImage")))
        self.a.events.emit(obj, "Built", f"segment {name} built on host {self.a.host} "
                           f"({local.size_bytes // 2**20} MiB)")

    def keep(self, c: Ctx, obj: Obj) -> dict[str, Any]:
        local = c.db.segment(obj["metadata"]["name"])
        return {"ready": True, "sizeMiB": local.size_bytes // 2**20}

    def remove(self, c: Ctx, name: str) -> None:
        from fusuma.ops.segments import segment_manager

        segment_manager(c).delete(name)
