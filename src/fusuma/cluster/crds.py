"""The custom resources, the agents' namespace and the view/edit roles: what `fusuma
cluster install` prints (and applies with ``--apply``), with the admission policy
(``fusuma.cluster.policy``).

Every field has a description, so ``kubectl explain fusumavm.spec.memoryMiB`` answers;
printer columns make ``kubectl get`` read like ``fusuma ps``; each kind has a status
subresource (agents write status, users write spec) and conditions in the usual shape.
"""

from __future__ import annotations

from typing import Any

import yaml

from fusuma.cluster import GROUP, SYSTEM_NAMESPACE, VERSION

Obj = dict[str, Any]


def _s(desc: str, **kw: Any) -> Obj:
    return {"type": "string", "description": desc, **kw}


def _i(desc: str, **kw: Any) -> Obj:
    return {"type": "integer", "description": desc, **kw}


def _b(desc: str, **kw: Any) -> Obj:
    return {"type": "boolean", "description": desc, **kw}


def _n(desc: str, **kw: Any) -> Obj:
    return {"type": "number", "description": desc, **kw}


def _obj(desc: str, props: Obj, **kw: Any) -> Obj:
    return {"type": "object", "description": desc, "properties": props, **kw}


def _arr(desc: str, items: Obj, **kw: Any) -> Obj:
    return {"type": "array", "description": desc, "items": items, **kw}


CONDITIONS = _arr(
    "The object's conditions (Kubernetes' usual shape): Ready says whether it is as "
    "asked; reason is one CamelCase word, message one sentence saying what to fix.",
    _obj("One condition.", {
        "type": _s("Condition type: Ready, Placed, ..."),
        "status": _s("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": _s("Why, in one CamelCase word (e.g. UnknownPartition)."),
        "message": _s("What is wrong and how to fix it, in one sentence."),
        "lastTransitionTime": _s("When status last changed.", format="date-time"),
        "observedGeneration": _i("The metadata.generation this condition is about."),
    }, required=["type", "status"]),
    **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})

# A move's downtime step by step (``fusuma.migration.DOWNTIME_STEPS``; `fusuma migrate
# --json`'s steps_ms), as lastMove.steps names them: the CLI's name, its field, what it is.
MOVE_STEPS = {
    "source_saved": ("sourceSaved", "The source QEMU stopping the guest and sending its "
                     "device state (its STOP to its migration's completed)"),
    "dest_loaded": ("destLoaded", "The destination QEMU finishing loading the device "
                    "state"),
    "event": ("event", "The destination's supervisor seeing that its QEMU loaded it"),
    "decision": ("decision", "The destination's supervisor recording the decision "
                 "(forward) in the host's state file"),
    "taps": ("taps", "Handing the guest's tap NICs over to the destination QEMU"),
    "cont": ("cont", "The destination QEMU running the guest (cont to its RESUME)"),
}

MOVE = _obj("A move of the VM: inside a host (zero-copy, between partitions) or "
            "between hosts (live, copy mode over TCP).", {
                "id": _s("The move's id (one per move)."),
                "kind": _s("in-host or between-hosts.", enum=["in-host", "between-hosts"]),
                "mode": _s("QEMU migration mode: zero-copy or copy."),
                "from": _s("Source, as host/partition."),
                "to": _s("Destination, as host/partition."),
                "fromHost": _s("Source host."),
                "toHost": _s("Destination host."),
                "record": _obj("Between hosts: what the destination's definition must "
                               "carry from the source's (the machine type and device set "
                               "the guest booted with).", {
                                   "machine": _s("Versioned machine type."),
                                   "devices": _s("Guest-visible device set (JSON)."),
                                   "accel_used": _s("Accelerator the guest runs under."),
                                   "nics": _arr("Its NICs on the cluster's networks, "
                                                "which the destination gives it (taps "
                                                "of its own).", _obj("One NIC.", {
                                                    "index": _i("Its place (nic0, ...)."),
                                                    "network": _s("FusumaNetwork."),
                                                    "mac": _s("Its MAC."),
                                                    "ip": _s("Its address.")})),
                                   "thinDisk": _obj(
                                       "A VM of an imported disk image: what its thin "
                                       "disk is made on and its cloud-init seed.", {
                                           "image": _s("The image's name at the source."),
                                           "sha256": _s("The image's checksum: the "
                                                        "destination's must have it."),
                                           "virtualSize": _i("The thin disk's size, "
                                                             "bytes."),
                                           "seed": _s("The seed disk (zlib, base64)."),
                                           "seedInputs": _obj(
                                               "What the seed says.", {},
                                               **{"x-kubernetes-preserve-unknown-fields":
                                                  True})}),
                                   "sharedStorage": _obj(
                                       "A VM on shared storage (spec.storage): where its "
                                       "files are and the token the source wrote there, "
                                       "which the destination must read at that path.", {
                                           "path": _s("The directory of its files."),
                                           "token": _s("A random token, hex.")})}),
                "destPid": _i("Between hosts: the destination QEMU's pid."),
                "prepareMs": _n("Time to start the destination QEMU, ready to receive "
                                "the guest (before the stream), ms."),
                "steps": _obj("Inside a host: where the downtime went, ms per step from "
                              "the end of the one before (the same as `fusuma migrate "
                              "--json`'s steps_ms).",
                              {field: _n(f"{desc}, in ms.") for field, desc in
                               MOVE_STEPS.values()}),
                "resumeTs": _n("Between hosts: when the guest resumed at the destination "
                               "(epoch seconds)."),
                "qemuDowntimeMs": _n("Downtime as the source QEMU reports it, in ms."),
                "phase": _s("Between hosts: Preparing, Prepared, Streaming, Streamed, "
                            "Switched, Done, Failed."),
                "uri": _s("Between hosts: where the destination QEMU listens (tcp:ADDR:PORT); "
                          "the source sends only to the port at the destination host's "
                          "registered address."),
                "channels": _i("Between hosts: connections the stream takes (QEMU's "
                               "multifd), as the destination prepared them."),
                "nbd": _s("Between hosts, a VM of an imported disk image: where the "
                          "destination serves its fresh thin disk over NBD "
                          "(tcp:ADDR:PORT) for the source's mirror."),
                "sharedStorage": _b("Between hosts, a VM on shared storage "
                                    "(spec.storage): its files stay where they are, the "
                                    "destination proved it sees the same directory, and "
                                    "no disk is mirrored."),
                "tls": _b("Between hosts: the stream is encrypted and both hosts proved who "
                          "they are with certificates of the cluster's move CA (false only "
                          "in the benchmark's before)."),
                "decision": _s("Between hosts: forward (the destination runs the guest) or "
                               "back (the source does); written once, by whoever decides "
                               "first, with a resourceVersion precondition.",
                               enum=["forward", "back"]),
                "decidedBy": _s("Host whose agent recorded the decision."),
                "downtimeMs": _n("Time the guest did not run, in ms."),
                "totalMs": _n("From the start of the stream to the guest running at the "
                              "destination, in ms."),
                "wallMs": _n("Between hosts: from the source's agent beginning the move "
                             "(before the destination's prepare) to the guest resuming "
                             "at the destination, in ms."),
                "bytesSent": _i("Bytes the migration stream carried."),
                "paused": _b("The guest was paused for the copy (QEMU < 9.0 under TCG)."),
                "result": _s("ok or failed."),
                "message": _s("A failed move's reason."),
                "startedAt": _s("When the move began.", format="date-time"),
                "finishedAt": _s("When the move ended.", format="date-time"),
            })

VM_SPEC = _obj("The VM as asked for: fusuma's VM spec, plus where it runs.", {
    "host": _s("FusumaHost to run on. Empty: the placement controller picks one (written "
               "to status.placement). Changing it moves the running VM live to that host."),
    "partition": _s("Partition on the host (a FusumaPartition's spec.name). Empty: "
                    "placement picks one with room. Changing it moves the VM zero-copy "
                    "inside its host."),
    "vcpus": _i("Virtual CPUs.", minimum=1, maximum=64, default=1),
    "memoryMiB": _i("Guest RAM in MiB.", minimum=64, default=256),
    "image": _s("Guest image kind on the host (fusuma image list), e.g. minimal.",
                default="minimal"),
    "boot": _s("How a guest of an imported disk image boots: bios (SeaBIOS, the "
               "default) or uefi (OVMF, with its own NVRAM variables).",
               enum=["bios", "uefi"]),
    "storage": _s("A guest of an imported disk image: a storage directory every host it "
                  "may run on declared shared (`fusuma storage add DIR --shared`); its "
                  "thin disk, NVRAM and seed live in DIR/vm-NAME and stay there when it "
                  "moves between hosts (no disk is copied). Empty: each host's own "
                  "directory, the disk mirrored over NBD with a move.", maxLength=4096),
    "accel": _s("Accelerator: auto (KVM where it works, else TCG), kvm or tcg.",
                enum=["auto", "kvm", "tcg"], default="auto"),
    "sharedRam": _b("Guest RAM in a named shared file (needed for zero-copy moves).",
                    default=True),
    "mergeable": _b("Private RAM that KSM may merge (moves by copy only).", default=False),
    "qos": _s("CPU QoS class for the governor.",
              enum=["guaranteed", "burstable", "best-effort"], default="burstable"),
    "segments": _arr("Shared segments to attach, as NAME or NAME:MOUNTPOINT.",
                     _s("A segment.")),
    "running": _b("Whether the VM should run (false: stopped, kept defined).",
                  default=True),
    "nics": _arr("NICs on the cluster's networks (FusumaNetwork), as `vm create --nic`: "
                 "each keeps its MAC and address wherever the VM moves.",
                 _obj("One NIC.", {
                     "network": _s("A FusumaNetwork's name."),
                     "ip": _s("Its address in the network's subnet. Empty: one is "
                              "allocated cluster-wide when the VM is first defined "
                              "(status.nics shows it; a FusumaAddress holds it). Either "
                              "way it stays the VM's until the FusumaVM is deleted; an "
                              "address another VM holds is refused."),
                     "mac": _s("Its MAC (default: generated once).")},
                      required=["network"]), maxItems=8),
    "restartable": _b("Start it again from its image on another host when its host is "
                      "lost (its RAM and any disk local to the lost host are gone).",
                      default=False),
}, **{"x-kubernetes-validations": [
    {"rule": "!(has(self.mergeable) && self.mergeable && has(self.sharedRam) && "
             "self.sharedRam)",
     "message": "a mergeable VM has private RAM: set sharedRam to false"}]})

VM_STATUS = _obj("What the agents and the placement controller observed and did.", {
    "state": _s("Pending, Placed, Creating, Running, Stopped, Moving, Lost or Failed."),
    "host": _s("Host the VM is defined on now."),
    "partition": _s("Partition the VM is in now."),
    "pid": _i("Its QEMU's pid on that host."),
    "qemu": _s("Its QEMU binary's version."),
    "accelerator": _s("kvm or tcg."),
    "memoryMiB": _i("Host memory its QEMU holds (resident), MiB."),
    "message": _s("The last error, in one sentence."),
    "placement": _obj("Where the placement controller put a VM with no spec.host.", {
        "host": _s("Chosen host."), "partition": _s("Chosen partition."),
        "at": _s("When.", format="date-time"),
        "reason": _s("Placed, or Restarted after a host loss.")}),
    "move": MOVE,
    "lastMove": MOVE,
    "lostAt": _s("When its host's Lease expired.", format="date-time"),
    "lostFrom": _s("The lost host."),
    "ownerUID": _s("UID of the object the host's VM belongs to (one name per host)."),
    "nics": _arr("Its NICs on the cluster's networks as defined: the address each holds "
                 "(given in spec.nics or allocated), written by its host's agent.",
                 _obj("One NIC.", {
                     "index": _i("Its place (nic0, ...)."),
                     "network": _s("FusumaNetwork."),
                     "ip": _s("Its address (a FusumaAddress named NETWORK.ADDRESS holds "
                              "it)."),
                     "mac": _s("Its MAC, once the VM is defined.")})),
    "observedGeneration": _i("The metadata.generation the status is about."),
    "conditions": CONDITIONS,
})

PARTITION_INFO = _obj("One partition of the host.", {
    "name": _s("Partition name."),
    "cpus": _arr("Its cores.", _i("A core.")),
    "memoryMiB": _i("Its memory budget."),
    "usedMiB": _i("What its supervisor and VMs count against it."),
    "vms": _i("VMs defined in it."),
    "state": _s("Its supervisor's state."),
    "qemu": _s("QEMU binary it runs (empty: the host's default)."),
})

HOST_STATUS = _obj("Written by the host's agent.", {
    "address": _s("Address other hosts reach this host's migration listener at."),
    "uplinkMtu": _i("MTU of the link that holds the address (a network spanning hosts "
                    "takes the smallest host's, less the VXLAN's headers)."),
    "cores": _i("Cores of the host."),
    "accelerator": _s("kvm or tcg (and why, when tcg)."),
    "memoryMiB": _i("Host memory."),
    "availableMiB": _i("Memory fusuma may give partitions and guest RAM."),
    "freeMiB": _i("What is left of it beside the partitions and guest RAM."),
    "partitions": _arr("Its partitions.", PARTITION_INFO),
    "vms": _i("VMs defined on it."),
    "qemuVersions": _arr("Installed QEMU versions.", _s("A version.")),
    "agentVersion": _s("fusuma version of the agent."),
    "lease": _s("Its heartbeat Lease (namespace/name)."),
    "heartbeat": _s("Last status write.", format="date-time"),
    "moveTLS": _obj("The host's certificate for moves between hosts, as its agent holds it "
                    "(from Secret fusuma-system/fusuma-host-HOST).", {
                        "cert": _s("SHA-256 fingerprint of the host's certificate."),
                        "issuer": _s("SHA-256 fingerprint of the CA that signed it."),
                        "notAfter": _s("When it expires.", format="date-time"),
                        "trust": _arr("SHA-256 fingerprints of the CAs the host trusts.",
                                      _s("A fingerprint."))}),
    "drain": _obj("While spec.drain or spec.drainPartitions is set: how moving the VMs "
                  "off the host (or off those partitions) goes.", {
        "state": _s("Draining, Drained (no VM left), or Blocked (the VMs left cannot "
                    "leave: refused says why).", enum=["Draining", "Drained", "Blocked"]),
        "message": _s("The drain in one sentence."),
        "startedAt": _s("When the drain began.", format="date-time"),
        "observedGeneration": _i("The FusumaHost's metadata.generation it answers."),
        "remaining": _i("VMs still on the host."),
        "waiting": _i("VMs that will be moved once a move under way ends."),
        "partitions": _arr("While only partitions are drained (spec.drainPartitions, "
                           "spec.drain unset): those partitions.", _s("A partition.")),
        "moving": _arr("VMs moving off now.", _obj("One VM.", {
            "vm": _s("namespace/name."), "to": _s("Destination, as host/partition."),
            "message": _s("Why it goes there, when an earlier move failed.")})),
        "moved": _arr("VMs moved off since the drain began.", _obj("One VM.", {
            "vm": _s("namespace/name."), "to": _s("Where it runs now, host/partition."),
            "downtimeMs": _n("Its move's downtime, ms.")})),
        "refused": _arr("VMs that cannot leave, each with the reason.", _obj("One VM.", {
            "vm": _s("namespace/name."),
            "message": _s("Why, and what to do, in one sentence.")})),
        "failed": _arr("Moves that failed in the last five minutes: the drain sends "
                       "that VM elsewhere, and not there again for that long.",
                       _obj("One failed move.", {
                           "vm": _s("namespace/name."),
                           "avoid": _s("Where it failed: a host, or host/partition "
                                       "for a move inside the host."),
                           "at": _s("When the drain saw it fail.", format="date-time"),
                           "message": _s("The failure, in one sentence.")})),
    }),
    "conditions": CONDITIONS,
})

PARTITION_SPEC = _obj("A partition on one host: exclusive cores, a memory budget, its own "
                      "supervisor.", {
                          "host": _s("The FusumaHost it lives on."),
                          "name": _s("Its name on the host (default: metadata.name); VMs "
                                     "name it in spec.partition."),
                          "cpus": _arr("Its cores.", _i("A core.", minimum=0), minItems=1),
                          "memoryMiB": _i("Memory budget (supervisor + VMs' QEMUs).",
                                          minimum=128),
                          "qemu": _s("QEMU its VMs run: a version `fusuma qemu list` "
                                     "shows (e.g. 10.0), never a binary's path; empty: "
                                     "the host's own. Set when the partition is made."),
                      }, required=["host", "cpus", "memoryMiB"])

PARTITION_STATUS = _obj("Written by its host's agent.", {
    "state": _s("Ready, Failed or Deleting."),
    "supervisorPid": _i("Its supervisor's pid."),
    "vms": _i("VMs in it."),
    "usedMiB": _i("Memory its supervisor and VMs count against it."),
    "observedGeneration": _i("The metadata.generation the status is about."),
    "conditions": CONDITIONS,
})

SEGMENT_SPEC = _obj("A read-only shared segment (erofs) built on each host.", {
    "fromImage": _s("Build it from this guest image kind's root filesystem."),
    "hosts": _arr("Hosts to build it on (empty: every host).", _s("A host.")),
}, required=["fromImage"])

NETWORK_SPEC = _obj("A managed network on every host, one layer-2 segment across them "
                    "(a VXLAN between the hosts' bridges; fusuma.network.span).", {
                        "subnet": _s("Its IPv4 subnet, e.g. 10.0.5.0/24 (the gateway is "
                                     "its .1 on every host)."),
                        "vni": _i("Its VXLAN id, unique in the cluster.", minimum=1,
                                  maximum=2**24 - 1),
                        "nat": _b("NAT to each host's uplink.", default=True),
                        "mtu": _i("The MTU of its bridges, taps and guests (told by "
                                  "DHCP). Unset: the most each host's uplink carries "
                                  "after the VXLAN's 50 bytes of headers (1450 on a "
                                  "1500-byte uplink); larger than that is refused.",
                                  minimum=1280, maximum=9000),
                    }, required=["subnet", "vni"])

NETWORK_STATUS = _obj("Per-host state, written by each agent.", {
    "hosts": _arr("One entry per host.", _obj("One host's part of the network.", {
        "host": _s("Host."), "ready": _b("Its bridge, dnsmasq and VXLAN port are up."),
        "message": _s("Why not, when not.")})),
    "conditions": CONDITIONS,
})

ADDRESS_SPEC = _obj("An address of a FusumaNetwork held by one NIC of one FusumaVM. Its "
                    "name is NETWORK.ADDRESS, so the API server's rule that a name exists "
                    "once makes two holders impossible; made by the agent of the host "
                    "that defines the VM, freed (deleted) by the agent of the host "
                    "that holds it once the FusumaVM is gone.", {
                        "network": _s("The FusumaNetwork."),
                        "address": _s("The IPv4 address, inside the network's subnet."),
                        "vm": _obj("The FusumaVM that holds it.", {
                            "namespace": _s("Its namespace."), "name": _s("Its name."),
                            "uid": _s("Its metadata.uid (a VM made again under the "
                                      "same name is another VM).")},
                                   required=["namespace", "name", "uid"]),
                        "nic": _i("The index of the VM's NIC (nic0, ...).", minimum=0),
                        "static": _b("Asked for in the VM's spec.nics[].ip (else "
                                     "allocated).", default=False),
                        "host": _s("The host whose agent may hand it on or free it: the "
                                   "one that made it, then the host the VM runs on "
                                   "(handed on after a move by the host that had it)."),
                    }, required=["network", "address", "vm", "nic", "host"])

ADDRESS_STATUS = _obj("Nothing is written here: an address is held while it exists.", {
    "conditions": CONDITIONS,
})

SEGMENT_STATUS = _obj("Per-host state, written by each agent.", {
    "hosts": _arr("One entry per host.", _obj("One host's copy.", {
        "host": _s("Host."), "ready": _b("Built."), "sizeMiB": _i("Its size."),
        "message": _s("Why not, when not.")})),
    "conditions": CONDITIONS,
})


def _col(name: str, path: str, typ: str = "string", priority: int = 0,
         desc: str = "") -> Obj:
    col: Obj = {"name": name, "type": typ, "jsonPath": path}
    if priority:
        col["priority"] = priority
    if desc:
        col["description"] = desc
    return col


AGE = _col("Age", ".metadata.creationTimestamp", "date")


def _crd(kind: str, plural: str, singular: str, short: list[str], scope: str,
         spec: Obj | None, status: Obj, columns: list[Obj], desc: str) -> Obj:
    props: Obj = {"status": status}
    if spec is not None:
        props["spec"] = spec
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": singular,
                      "shortNames": short, "listKind": f"{kind}List",
                      "categories": ["fusuma"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [*columns, AGE],
                "schema": {"openAPIV3Schema": {
                    "type": "object", "description": desc,
                    "properties": {
                        "apiVersion": _s("The API version (fusuma.io/v1alpha1)."),
                        "kind": _s("The kind."),
                        "metadata": {"type": "object"},
                        **props,
                    }}},
            }],
        },
    }


def crds() -> list[Obj]:
    vm_cols = [
        _col("Host", ".status.host"),
        _col("Partition", ".status.partition"),
        _col("State", ".status.state"),
        _col("Ready", ".status.conditions[?(@.type==\"Ready\")].status"),
        _col("vCPUs", ".spec.vcpus", "integer"),
        _col("Memory", ".spec.memoryMiB", "integer", desc="Guest RAM, MiB"),
        _col("Downtime-ms", ".status.lastMove.downtimeMs", "number",
             desc="The last move's downtime"),
        _col("IP", ".status.nics[0].ip", priority=1, desc="The first NIC's address"),
        _col("PID", ".status.pid", "integer", priority=1),
        _col("Message", ".status.message", priority=1),
    ]
    host_cols = [
        _col("Ready", ".status.conditions[?(@.type==\"Ready\")].status"),
        _col("Address", ".status.address"),
        _col("Cores", ".status.cores", "integer"),
        _col("Free-MiB", ".status.freeMiB", "integer"),
        _col("VMs", ".status.vms", "integer"),
        _col("Drain", ".status.drain.state"),
        _col("Accel", ".status.accelerator", priority=1),
        _col("QEMU", ".status.qemuVersions", priority=1),
    ]
    part_cols = [
        _col("Host", ".spec.host"),
        _col("Partition", ".spec.name"),
        _col("CPUs", ".spec.cpus"),
        _col("Memory", ".spec.memoryMiB", "integer"),
        _col("QEMU", ".spec.qemu"),
        _col("Used", ".status.usedMiB", "integer"),
        _col("VMs", ".status.vms", "integer"),
        _col("State", ".status.state"),
    ]
    seg_cols = [
        _col("Image", ".spec.fromImage"),
        _col("Ready", ".status.conditions[?(@.type==\"Ready\")].status"),
    ]
    host_spec = _obj("What users may ask of a host.", {
        "unschedulable": _b("Place no new VM here (running ones stay): `fusuma host "
                            "cordon`.", default=False),
        "drain": _b("Move every VM off this host (`fusuma host drain`): no new VM is "
                    "placed here, and the host's agent moves each VM not pinned here by "
                    "its spec.host live to the other host with the most room, a few at a "
                    "time; status.drain shows the progress. False or unset (`fusuma host "
                    "uncordon`) ends it; moved VMs stay where they went.",
                    default=False),
        "drainPartitions": _arr(
            "Partitions of this host to empty into its other partitions (`fusuma host "
            "drain HOST --partition P`), e.g. before their QEMU is upgraded: they take no "
            "new VM, and the host's agent moves each VM in them not pinned by its "
            "spec.partition to another partition of this host with room, zero-copy (the "
            "guest's RAM is not copied); status.drain shows the progress. Ignored while "
            "spec.drain is set (every VM leaves the host then).", _s("A partition."))})
    return [
        _crd("FusumaHost", "fusumahosts", "fusumahost", ["fh"], "Cluster", host_spec,
             HOST_STATUS, host_cols,
             "A host running a fusuma agent; its agent registers it and keeps its status "
             "and a heartbeat Lease (in namespace fusuma-system)."),
        _crd("FusumaPartition", "fusumapartitions", "fusumapartition", ["fp"], "Cluster",
             PARTITION_SPEC, PARTITION_STATUS, part_cols,
             "A partition of one host: exclusive cores, a memory budget and its own "
             "hypervisor supervisor; made and resized by its host's agent."),
        _crd("FusumaVM", "fusumavms", "fusumavm", ["fvm"], "Namespaced", VM_SPEC,
             VM_STATUS, vm_cols,
             "A VM run by fusuma on one host. Without spec.host it is placed; changing "
             "spec.partition moves it zero-copy inside its host, changing spec.host moves "
             "it live to another host."),
        _crd("FusumaNetwork", "fusumanetworks", "fusumanetwork", ["fnet"], "Cluster",
             NETWORK_SPEC, NETWORK_STATUS, [_col("Subnet", ".spec.subnet"),
                                            _col("VNI", ".spec.vni", "integer"),
                                            *seg_cols[1:]],
             "A managed network that spans the hosts (bridge, DHCP, NAT on each, a VXLAN "
             "between them): VMs on it keep their MAC, address and connections when they "
             "move between hosts."),
        _crd("FusumaAddress", "fusumaaddresses", "fusumaaddress", ["faddr"], "Cluster",
             ADDRESS_SPEC, ADDRESS_STATUS, [
                 _col("Network", ".spec.network"), _col("Address", ".spec.address"),
                 _col("Namespace", ".spec.vm.namespace"), _col("VM", ".spec.vm.name"),
                 _col("NIC", ".spec.nic", "integer"), _col("Host", ".spec.host"),
                 _col("Static", ".spec.static", "boolean", priority=1)],
             "An address of a FusumaNetwork held by a FusumaVM's NIC: the cluster's "
             "allocation record (one object per address, named NETWORK.ADDRESS). The "
             "agents make and free them; delete one by hand only for a host that left "
             "the cluster for good."),
        _crd("FusumaSegment", "fusumasegments", "fusumasegment", ["fseg"], "Cluster",
             SEGMENT_SPEC, SEGMENT_STATUS, seg_cols,
             "A shared read-only segment (z/VM's DCSS) built on each host, attached to "
             "VMs as virtio-pmem with DAX."),
    ]


def rbac() -> list[Obj]:
    """The agents' namespace, and view/edit roles aggregated into Kubernetes' own
    ``view`` and ``edit``. Each host's own roles come with its identity
    (``fusuma.cluster.identity``, `fusuma cluster join`)."""
    ours = ["fusumahosts", "fusumapartitions", "fusumavms", "fusumasegments",
            "fusumanetworks", "fusumaaddresses"]
    status = [f"{r}/status" for r in ours]
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SYSTEM_NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "fusuma-view", "labels": {
             "rbac.authorization.k8s.io/aggregate-to-view": "true"}},
         "rules": [{"apiGroups": [GROUP], "resources": ours + status,
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "fusuma-edit", "labels": {
             "rbac.authorization.k8s.io/aggregate-to-edit": "true"}},
         "rules": [{"apiGroups": [GROUP], "resources": ["fusumavms"],
                    "verbs": ["get", "list", "watch", "create", "update", "patch",
                              "delete"]},
                   # `fusuma host cordon|drain|uncordon`: a FusumaHost's spec holds
                   # only those fields (its agent writes everything else, in its
                   # status subresource), so patching it is exactly draining; no
                   # create, update or delete of a host, and no status.
                   {"apiGroups": [GROUP], "resources": ["fusumahosts"],
                    "verbs": ["get", "list", "watch", "patch"]}]},
    ]


def render_yaml(objs: list[Obj]) -> str:
    """A multi-document YAML stream for ``kubectl apply -f -``."""
    return "".join("---\n" + yaml.safe_dump(o, sort_keys=False, width=100)
                   for o in objs)
