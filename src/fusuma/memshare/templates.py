"""Templates: a booted guest kept as its RAM file and its device state, and clones that
start from it in milliseconds instead of booting (Kata's VM templating, Firecracker's
snapshots).

``fusuma template create T --from VM`` stops a running VM into a template: the guest
drops its caches (and, with page reporting, hands the freed pages back and unbinds its
balloon driver, so no clone ever reports a page), QEMU is stopped and its device state
saved with ``x-ignore-shared`` (the RAM file is not copied: only the devices and the
small non-shared RAM blocks), and the VM's RAM file becomes the template's
(``<shm>/<T>.template``, a name the RAM-group sweeper leaves alone). The VM ends
stopped; starting it again boots it fresh.

A clone (``vm create X --template T``) maps the template's RAM file privately and
read-only (QEMU >= 8.2: ``memory-backend-file,share=off,readonly=on,rom=off``): every
page it has not written is the template's, shared by all clones; a write copies the
page into the clone's own memory. Its QEMU starts with ``-incoming defer``, loads the
template's state file (``migrate-incoming file:``) and continues: running in ~0.1 s.
Then the guest agent gives it an identity of its own: hostname, machine-id, the MAC of
eth0 (or, for NICs on fusuma's networks, each NIC's MAC and a new DHCP lease: the
clone's own NIC records, :func:`nic_identity_script`), 64 random bytes mixed into the
guest's entropy pool. Its vmgenid guid (a device
every VM booted since has) is new too, though the Debian 6.1 kernel has no driver to
notice it.

A template of a VM that boots by firmware also keeps its disk as it was (a read-only
qcow2 layer), its NVRAM and its seed's inputs, and each clone gets an overlay, NVRAM and
seed (a new instance id) of its own (fusuma.images.layers); its identity step runs
cloud-init's stages again (:data:`CLOUD_INIT_STAGES`), and once its guest has run, its
later starts boot its own disk instead of resuming the template.

What a clone must share with its template: machine type, RAM size, vCPUs and the whole
device set (recorded with the template), accelerator, image and segments. What it may
not do: give pages back (its RAM is a copy-on-write mapping of a read-only file: no
page reporting, no balloon) or move zero-copy (its RAM is private): it moves by copy.

Files and permissions: the state file is ``FUSUMA_HOME/templates/<T>/state`` (root,
0600), opened by the supervisor and passed to QEMU as an fdset; the RAM file is root's,
mode 0640, group ``template_gid`` (one per template, from the gid range fusuma
reserves for templates, which VMs' uids never reach), which each clone's QEMU gets as a
supplementary group: QEMU reopens the fd's magic link, which checks the file's own
permission.

A clone's faults on the holes of the template's RAM file fill them (tmpfs allocates the
pages in the shared file); the template's zero pages are punched when it is made and
what clones fill is punched again while they run (fusuma.memshare.holes).

Side channel: a clone can time its copy-on-write faults to learn whether a page equals
the template's, the same risk as KSM's (see ``vm create --mergeable``).
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from dataclasses import replace
from pathlib import Path

from fusuma.errors import SpecError, StateError, TemplateError
from fusuma.images.store import DISK, NVRAM, SEED_INPUTS
from fusuma.memshare.smaps import TEMPLATE_SUFFIX
from fusuma.paths import Paths
from fusuma.qemu.cmdline import NET_ID, DeviceSet
from fusuma.state.db import TemplateRecord, VmRecord

# QEMU opens a private file mapping read-only (``readonly=on`` with ``rom=off``) and
# migrates to and from ``file:`` URIs since 8.2: older QEMUs would open the template
# read-write, and any discard in a clone would punch holes in it.
MIN_QEMU = (8, 2)
MIN_QEMU_TEXT = "8.2"
RAM_SUFFIX = TEMPLATE_SUFFIX        # what the smaps reader attributes to templates
RAM_MODE = 0o640
STATE_NAME = "state"
# What a template of a VM that boots by firmware keeps beside its state
# (fusuma.images.layers): its disk layer, its NVRAM (UEFI), its seed's inputs.
FIRMWARE_FILES = (DISK, NVRAM, SEED_INPUTS)
# cloud-init's stages, as at a boot: ``init --local`` finds the seed's new instance id,
# makes the instance's directory, sets the hostname; then the per-instance modules of
# the later stages run (new SSH host keys, the user-data), the per-once ones not again.
# First, what the template's boot left in /run (a tmpfs, which a clone has from the
# template's RAM, where a reboot would have emptied it): its instance id there makes
# cloud-init trust its cache without looking at the seed. And the guest's caches are
# dropped, so the seed is read from the clone's disk, not from memory.
# Each stage runs whatever the one before said, as systemd runs them at a boot; the
# status is 1 when any said an error.
CLOUD_INIT_STAGES = ("rm -f /run/cloud-init/.instance-id; "
                     "echo 3 > /proc/sys/vm/drop_caches; rc=0; "
                     "for s in 'init --local' init 'modules --mode config' "
                     "'modules --mode final'; do cloud-init $s || rc=1; done; exit $rc")
# The guest image's udhcpc event script (fusuma.images lib.sh, written at boot).
UDHCPC_SCRIPT = "/run/fusuma-udhcpc.sh"
_MAC = re.compile(r"[0-9a-f]{2}(?::[0-9a-f]{2}){5}")
_IPV4 = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")


def ram_file(paths: Paths, name: str) -> Path:
    """The template's RAM file: in the shm dir, not named like a VM's (``*.ram``)."""
    return paths.shm / f"{name}{RAM_SUFFIX}"


def template_dir(paths: Paths, name: str) -> Path:
    return paths.home / "templates" / name


def state_file(paths: Paths, name: str) -> Path:
    return template_dir(paths, name) / STATE_NAME


def template_gid(paths: Paths, t: TemplateRecord) -> int:
    """The group that may read template ``t``'s RAM file: the one its record holds,
    from FUSUMA_UID_BASE's template range (``Paths.template_gids``), which VMs' uids
    never reach."""
    if t.gid <= 0:
        raise StateError(f"template {t.name!r} has no group (a record from before groups "
                         "were kept, past the middle of the old range); re-create it.")
    return t.gid


def version_ok(version: str | None) -> bool:
    """True if QEMU ``version`` ("10.0.2") can make templates and start clones."""
    if not version:
        return False
    try:
        have = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return have >= MIN_QEMU


def too_old(what: str, version: str | None) -> TemplateError:
    return TemplateError(
        f"{what} runs QEMU {version or 'of unknown version'}, which cannot map a template's "
        f"RAM read-only (QEMU >= {MIN_QEMU_TEXT}); use a partition on QEMU 10.0 "
        "(`fusuma partition create P --cpus C --memory M --qemu 10.0`).")


def sha256_fd(fd: int) -> str:
    """The sha256 of the whole file open at ``fd`` (read from offset 0, position kept)."""
    h = hashlib.sha256()
    offset = 0
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)
        offset += len(chunk)


def has_nic(ds: DeviceSet) -> bool:
    return any(NET_ID in d.backends() for d in ds.devices)


def devices_of(t: TemplateRecord) -> DeviceSet:
    try:
        return DeviceSet.loads(t.devices)
    except (ValueError, KeyError, TypeError) as exc:
        raise TemplateError(f"template {t.name!r}: its recorded device set is unreadable "
                            f"({exc}); delete it and make it again.") from exc


def clone_devices(t: TemplateRecord, guid: str | None = None) -> DeviceSet:
    """What a clone's guest sees: exactly the template's devices (their order, PCI
    addresses and feature-affecting properties must match the saved state), with a
    vmgenid guid of its own (QEMU writes the destination's guid into the guest on load,
    and raises the notify)."""
    ds = devices_of(t)
    new = guid or str(uuid.uuid4())
    devices = tuple(
        replace(d, props=tuple((k, new if k == "guid" else v) for k, v in d.props))
        if d.driver == "vmgenid" else d for d in ds.devices)
    return replace(ds, devices=devices)


def check_files(t: TemplateRecord, ram_fd: int | None = None,
                state_fd: int | None = None) -> None:
    """Refuse (one sentence) a template whose RAM file is missing or not its size, or
    whose state file is missing or does not match its sha256. Given descriptors are
    checked (what QEMU will read); otherwise the paths are opened."""
    opened: list[int] = []
    try:
        if ram_fd is None:
            ram_fd = _open(t, "RAM", t.ram_path)
            opened.append(ram_fd)
        if state_fd is None:
            state_fd = _open(t, "state", t.state_path)
            opened.append(state_fd)
        size = os.fstat(ram_fd).st_size
        if size != t.size_bytes:
            raise damaged(t, f"its RAM file {t.ram_path} has {size} bytes, not "
                             f"{t.size_bytes}")
        if sha256_fd(state_fd) != t.state_sha256:
            raise damaged(t, f"its state file {t.state_path} does not match the sha256 "
                             "recorded when it was made")
    finally:
        for fd in opened:
            os.close(fd)


def damaged(t: TemplateRecord, why: str) -> TemplateError:
    return TemplateError(f"template {t.name!r} is damaged: {why}; delete it (`fusuma "
                         f"template delete {t.name}`, after its clones) and make it again.")


def _open(t: TemplateRecord, what: str, path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise damaged(t, f"its {what} file {path} is missing") from exc
    except OSError as exc:
        raise damaged(t, f"its {what} file {path} cannot be opened ({exc.strerror})"
                      ) from exc


def open_files(t: TemplateRecord) -> tuple[int, int]:
    """Open template ``t``'s RAM and state files read-only for a clone's QEMU and check
    them (what is checked is what QEMU gets); returns (ram_fd, state_fd)."""
    ram_fd = _open(t, "RAM", t.ram_path)
    try:
        state_fd = _open(t, "state", t.state_path)
    except BaseException:
        os.close(ram_fd)
        raise
    try:
        check_files(t, ram_fd, state_fd)
    except BaseException:
        os.close(ram_fd)
        os.close(state_fd)
        raise
    return ram_fd, state_fd


def check_clone(t: TemplateRecord, *, vcpus: int, memory_mib: int, disks: list[str],
                ports: list[str], segments: list[str], image: str, accel: str,
                shared_ram: bool) -> None:
    """Refuse (SpecError, one sentence) a clone definition that differs from what the
    template's saved guest has."""
    if memory_mib != t.memory_mib:
        raise SpecError(f"template {t.name!r} has {t.memory_mib} MiB of guest RAM; a clone "
                        f"has exactly that (leave out --memory, not {memory_mib}).")
    if vcpus != t.vcpus:
        raise SpecError(f"template {t.name!r} has {t.vcpus} vCPU(s); a clone has exactly "
                        f"that (leave out --vcpus, not {vcpus}).")
    if disks:
        raise SpecError("a clone of a template cannot have disks: its guest's devices are "
                        "the template's, saved without them.")
    if segments and segments != t.segments:
        raise SpecError(f"a clone of template {t.name!r} has its segments "
                        f"({', '.join(t.segments) or 'none'}); leave out --segment.")
    if image != t.image:
        raise SpecError(f"a clone of template {t.name!r} runs its image {t.image!r}; "
                        "leave out --image.")
    if accel not in ("auto", t.accel):
        raise SpecError(f"template {t.name!r} was saved under {t.accel}; a clone runs "
                        f"there too (leave out --accel).")
    if shared_ram:
        raise SpecError("a clone's RAM is a private copy-on-write mapping of the "
                        "template's file, never a shared file of its own; leave out --shared-ram.")
    if ports and not has_nic(devices_of(t)) and not t.networks:
        raise SpecError(f"template {t.name!r}'s guest has no network card (its VM forwarded "
                        "no port and had no --nic), so a clone cannot forward ports; make "
                        "the template from a VM created with --port or --nic.")


def check_clone_nics(t: TemplateRecord, asked: int) -> None:
    """Refuse (one sentence) ``--nic`` options that do not match template ``t``'s
    guest, which has exactly its NICs (their devices come with its saved state)."""
    if asked and asked != len(t.networks):
        has = (f"{len(t.networks)} NIC(s) on network(s) {', '.join(t.networks)}"
               if t.networks else "no NIC on fusuma's networks")
        raise SpecError(f"template {t.name!r}'s guest has {has}, and a clone has exactly "
                        f"its template's devices: give {len(t.networks)} --nic option(s) "
                        "or none (then each is on its template's network).")


def nic_macs(ds: DeviceSet) -> dict[str, str]:
    """The MAC each tap NIC of device set ``ds`` was given, by its netdev id
    (``nic0``...): in a clone's guest, the template's MACs until its identity step."""
    out = {}
    for d in ds.devices:
        props = dict(d.props)
        if d.driver.startswith("virtio-net") and props.get("netdev", "").startswith("nic"):
            out[props["netdev"]] = props.get("mac", "")
    return out


def clone_mac(name: str) -> str:
    """The MAC a clone's eth0 gets: QEMU's prefix and three bytes of its name's hash
    (stable across restarts of the clone, different between clones)."""
    b = hashlib.sha256(f"fusuma-clone:{name}".encode()).digest()
    return "52:54:00:" + ":".join(f"{x:02x}" for x in b[:3])


def identity_script(name: str, machine_id: str, mac: str,
                    nics: list[tuple[str, str, str | None]] | None = None) -> str:
    """The shell run in a clone's guest (stdin: 64 random bytes from the host). ``name``
    is a checked fusuma name (letters, digits, ``-``), safe in a shell word. ``nics``:
    the clone's tap NICs (:func:`nic_identity_script`); without, eth0 is QEMU's
    user-mode NIC and gets ``mac``."""
    head = (f"hostname {name} || exit 1; echo {name} > /etc/hostname 2>/dev/null; "
            f"echo {machine_id} > /etc/machine-id || exit 2; ")
    if nics:
        return head + nic_identity_script(name, nics) + "; head -c 64 > /dev/urandom || exit 4"
    return (head +
            f"if [ -e /sys/class/net/eth0 ]; then ip link set eth0 address {mac} || exit 3; "
            # QEMU's user network (slirp) came with the template's state, ARP table
            # included: until it hears the new MAC it sends to the template's, which
            # the NIC drops. A gratuitous ARP and one to the gateway tell it now.
            "ip neigh flush dev eth0 2>/dev/null; "
            "for b in /fusuma/bin/busybox /bin/busybox; do [ -x $b ] || continue; "
            "$b arping -U -c 1 -I eth0 10.0.2.15 >/dev/null 2>&1; "
            "$b arping -c 1 -w 1 -I eth0 10.0.2.2 >/dev/null 2>&1; break; done; "
            "fi; head -c 64 > /dev/urandom || exit 4")


def nic_identity_script(name: str, nics: list[tuple[str, str, str | None]]) -> str:
    """The shell that gives a clone's tap NICs their own MACs and leases: ``nics`` holds
    (the template's MAC, the clone's, the clone's address or None) per NIC. Each
    interface is found by the template's MAC, given the clone's, and asks DHCP again
    (the template's DHCP client, which knows the template's MAC and lease, is ended
    first): the network's dnsmasq gives the address fusuma recorded for the clone's
    MAC. The client is the guest's own: busybox's udhcpc in fusuma's images, ISC's
    dhclient in a Debian or Ubuntu image (ifupdown's pid and lease files, the
    template's lease removed so the clone asks afresh). Exit 5: no interface had the
    template's MAC; 6: no lease for the recorded address. MACs are checked
    (``addr.check_mac``), addresses are fusuma's own: safe in shell words."""
    if not nics:
        return ""
    for old, new, ip in nics:
        if not (_MAC.fullmatch(old) and _MAC.fullmatch(new)) or (
                ip is not None and not _IPV4.fullmatch(ip)):
            raise TemplateError(f"clone {name!r}: NIC {old} -> {new} ({ip}) is not a MAC "
                                "and an IPv4 address.")
    lines = ["kill $(pidof udhcpc dhclient) 2>/dev/null; sleep 0.2"]
    for i, (old, new, ip) in enumerate(nics):
        d = f"d{i}"
        lines.append(
            f"{d}=; for x in /sys/class/net/*; do "
            f"[ \"$(cat $x/address 2>/dev/null)\" = {old} ] && {d}=${{x##*/}}; done; "
            f"[ -n \"${d}\" ] || exit 5; ip link set ${d} address {new} || exit 3; "
            f"ip -4 addr flush dev ${d}; ip neigh flush dev ${d} 2>/dev/null; "
            "if command -v udhcpc >/dev/null; then "
            f"udhcpc -i ${d} -s {UDHCPC_SCRIPT} -b -t 5 -T 1 -A 1 -x hostname:{name} "
            "</dev/null >/dev/null 2>&1; "
            "elif command -v dhclient >/dev/null; then "
            f"rm -f /var/lib/dhcp/dhclient.${d}.leases; "
            f"dhclient -4 -1 -pf /run/dhclient.${d}.pid "
            f"-lf /var/lib/dhcp/dhclient.${d}.leases ${d} </dev/null >/dev/null 2>&1; fi")
        if ip is not None:
            lines.append(f"ip -4 -o addr show dev ${d} | grep -q ' {ip}/' || exit 6")
    return "; ".join(lines)


def refuse(rec: VmRecord, running_version: str | None) -> None:
    """Refuse (one sentence) to make a template of ``rec``."""
    if rec.template is not None:
        raise TemplateError(f"VM {rec.name!r} is a clone of template {rec.template!r}: its "
                            "RAM is a private copy-on-write mapping, not a file a template "
                            "could keep; make templates of booted VMs.")
    if not rec.shared_ram or rec.mergeable:
        raise TemplateError(f"VM {rec.name!r} has private RAM (--private-ram or "
                            "--mergeable): a template keeps a VM's shared RAM file; create "
                            "the VM with shared RAM (the default).")
    if not version_ok(running_version):
        raise too_old(f"VM {rec.name!r} (partition {rec.partition!r})", running_version)
    if rec.disks:
        raise TemplateError(f"VM {rec.name!r} has disks ({', '.join(rec.disks)}): its "
                            "clones could not have them; detach them (stop it, `fusuma "
                            "vm detach`) and boot it again.")
