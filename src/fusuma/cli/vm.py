"""`fusuma vm ...`."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table
from fusuma.errors import NotFoundError, StateError
from fusuma.vm.view import VmView

if TYPE_CHECKING:
    import socket

# fusuma.governor.QOS_NAMES, spelled out so that `vm list` does not import the governor
# (tests/unit/test_cli_imports.py checks they are equal).
QOS_CHOICES = ("guaranteed", "burstable", "best-effort")


@click.group()
def vm() -> None:
    """Create, start, stop and use VMs.

    A VM is one QEMU process in its partition's cgroup; its vCPU threads are pinned to
    the partition's cores. Guest RAM is a named shared file under FUSUMA_SHM_DIR
    (what makes zero-copy migration possible)."""


@vm.command("create")
@click.argument("name")
@click.option("--partition", "-p", required=True, help="Partition to run in.")
@click.option("--vcpus", type=int, default=None,
              help="vCPUs.  [default: 1; a clone: its template's]")
@click.option("--memory", "memory_mib", type=int, default=None,
              help="Guest RAM in MiB.  [default: 256; a clone: its template's]")
@click.option("--image", default=None,
              help="A kind fusuma builds (minimal, debian) or an imported image "
                   "(`fusuma image list`).  [default: minimal; a clone: its template's]")
@click.option("--disk", "disks", multiple=True,
              help="A disk of the partition to attach (repeatable); see `fusuma disk`.")
@click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), default="auto",
              show_default=True, help="auto: KVM when usable, else TCG.")
@click.option("--private-ram", is_flag=True,
              help="Private anonymous guest RAM instead of a shared file: such a VM can "
                   "only be migrated by copy (--mode copy), never zero-copy.")
@click.option("--qos", type=click.Choice(list(QOS_CHOICES)), default="burstable",
              show_default=True,
              help="CPU QoS class: guaranteed (its vCPUs' worth of CPU reserved; the "
                   "partition's guaranteed vCPUs may not exceed its cores), burstable (a "
                   "weight, may use idle CPU) or best-effort (only otherwise idle CPU).")
@click.option("--memory-class", type=click.Choice(["guaranteed", "burstable"]),
              default="guaranteed", show_default=True,
              help="Memory class: guaranteed (its RAM admitted whole, never reclaimed) or "
                   "burstable (admitted at --memory-min plus its RAM above that divided by "
                   "its partition's memory overcommit; what it holds above --memory-min "
                   "may be reclaimed when the host runs short).")
@click.option("--memory-min", type=int, default=None, metavar="MIB",
              help="A burstable VM's floor in MiB (at most its RAM): admitted in full and "
                   "never reclaimed below.")
@click.option("--segment", "segments", multiple=True, metavar="NAME[:DIR]",
              help="A shared segment to attach (repeatable), mounted read-only with DAX "
                   "at DIR in the guest (default /mnt/NAME); see `fusuma segment`. "
                   "Segments work with zero-copy migration.")
@click.option("--mergeable", is_flag=True,
              help="Private guest RAM marked mergeable for KSM (`fusuma share ksm on`). "
                   "Implies --private-ram, so the VM migrates by copy only. KSM between "
                   "VMs opens a memory-deduplication side channel: a guest can time "
                   "copy-on-write faults to learn whether another guest holds a page.")
@click.option("--port", "ports", multiple=True, metavar="[ADDR:]HOST:GUEST",
              help="Forward TCP port HOST on host address ADDR (default 127.0.0.1; "
                   "0.0.0.0: every address of the host) to the guest's port GUEST "
                   "(repeatable). Without --nic, QEMU's user-mode network forwards from "
                   "127.0.0.1; with a NIC on a managed network, nftables DNAT forwards "
                   "from any address of the host to that NIC's address.")
@click.option("--nic", "nics", multiple=True, metavar="NET[,mac=MAC][,ip=ADDR]",
              help="A NIC on network NET (repeatable; `fusuma network list`), a tap on its "
                   "bridge, multiqueue with several vCPUs. Its MAC is generated once "
                   "(52:54:00:..) unless mac= gives one; on a managed network its address "
                   "is the next free one of the subnet, or ip= (inside the subnet, not "
                   "in use), handed out by DHCP. Without --nic: QEMU's user-mode "
                   "network.")
@click.option("--machine", default=None, metavar="TYPE",
              help="The versioned machine type it pins, e.g. pc-q35-7.2 (default: the "
                   "q35 type of the oldest installed QEMU, so it can move to every QEMU "
                   "here; see `fusuma qemu list`).")
@click.option("--emulator", default="shared", show_default=True, metavar="WHERE",
              help="Where QEMU's emulator threads (all but the vCPUs: main loop, I/O, "
                   "workers) run: shared (the partition's cores), isolated (a core of the "
                   "partition that holds no guaranteed vCPU; refused when there is none) "
                   "or a core list of the partition, e.g. 1 (libvirt's emulatorpin).")
@click.option("--page-reporting/--no-page-reporting", "page_reporting", default=None,
              help="Free page reporting (a virtio-balloon): memory the guest frees goes "
                   "back to the host, and the VM still moves zero-copy (holes are punched "
                   "in its RAM file). Default: on where a QEMU's memory can be charged to "
                   "its RAM file's own cgroup (cgroup v1) or the RAM is private; off on "
                   "cgroup v2 for shared RAM, where refaulted pages would be charged to "
                   "the partition (refused there). See `fusuma vm trim`.")
@click.option("--template", default=None, metavar="T",
              help="A clone of template T (`fusuma template`): it starts from the "
                   "template's RAM and device state instead of booting, ready in "
                   "milliseconds; its memory, vCPUs, machine type, devices, image and "
                   "segments are the template's. Clones share the template's pages they "
                   "have not written (copy-on-write), move by copy only, have no page "
                   "reporting, and need a partition on QEMU >= 8.2 (10.0). Page sharing "
                   "opens a side channel: a guest can time copy-on-write faults to learn "
                   "whether a page equals the template's (the same risk as --mergeable's). "
                   "After the start the guest agent gives it its own hostname, machine-id, "
                   "MAC and random seed. A template with NICs on fusuma's networks gives "
                   "each clone NICs of its own on the same networks (new MACs, addresses "
                   "and taps); --nic, once per template NIC, picks others or ip=.")
@click.option("--boot", type=click.Choice(["kernel", "bios", "uefi"]), default=None,
              help="How it boots: kernel (QEMU's direct kernel boot of an image fusuma "
                   "builds) or, for an imported image, by firmware: bios (SeaBIOS) or "
                   "uefi (OVMF, with NVRAM of its own).  [default: kernel for fusuma's "
                   "images, bios for imported ones]")
@click.option("--disk-size", default=None, metavar="SIZE",
              help="An imported image's thin disk size, e.g. 8G (at least the image's; "
                   "default: the image's).")
@click.option("--ssh-key", "ssh_keys", multiple=True, metavar="FILE",
              type=click.Path(exists=True, dir_okay=False),
              help="An imported image: SSH public key file(s) cloud-init authorizes for "
                   "the image's default user (repeatable).")
@click.option("--user-data", default=None, metavar="FILE",
              type=click.Path(exists=True, dir_okay=False),
              help="An imported image: cloud-init user-data (a #cloud-config or a "
                   "script) run at its first boot.")
@click.option("--storage", default=None, metavar="DIR",
              help="An imported image: keep its thin disk, NVRAM and seed in DIR/vm-NAME, "
                   "DIR a storage directory root declared shared (`fusuma storage add DIR "
                   "--shared`); it then moves between hosts that share DIR without copying "
                   "its disk. Default: its own directory under FUSUMA_HOME.")
@click.option("--start", is_flag=True, help="Start it right away (if that fails, the "
              "VM is not kept).")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def create(c: Ctx, name: str, partition: str, vcpus: int | None, memory_mib: int | None,
           image: str | None, disks: tuple[str, ...], accel: str, private_ram: bool,
           qos: str, memory_class: str, memory_min: int | None,
           segments: tuple[str, ...], mergeable: bool, ports: tuple[str, ...],
           nics: tuple[str, ...], machine: str | None, emulator: str, page_reporting: bool | None,
           template: str | None, boot: str | None, disk_size: str | None,
           ssh_keys: tuple[str, ...], user_data: str | None, storage: str | None,
           start: bool, as_json: bool) -> None:
    """Define VM NAME in a partition (and optionally start it).

    \b
    Examples:
      fusuma vm create web0 -p p0 --image debian --port 8080:80 --start
      fusuma vm create app0 -p p0 --nic lan0 --nic dmz,ip=10.0.6.10 --vcpus 2
      fusuma vm create web2 -p p1 --nic lan0 --port 0.0.0.0:8080:80 --start
      fusuma vm create web1 -p p0 --image debian --segment debian-root:/
      fusuma vm create k0 -p p1 --mergeable --start
      fusuma vm create b0 -p p0 --memory 1024 --memory-class burstable --memory-min 256
      fusuma vm create c0 -p p10 --template web --start
      fusuma vm create db0 -p p0 --image bookworm --disk-size 8G \\
          --ssh-key ~/.ssh/id_ed25519.pub --user-data init.yaml --start"""
    from fusuma import capacity
    from fusuma.spec import VmSpec, build
    from fusuma.undo import Reverter

    if template is None:    # the flags' own words; a clone's RAM is its template's
        capacity.check_memory_class(name, memory_mib or 256, memory_class, memory_min)
    fields: dict[str, object] = {"memory_class": memory_class, "memory_min": memory_min}
    if template is None and (private_ram or not mergeable):
        fields["shared_ram"] = not private_ram
    # Left out when not given: a clone takes them from its template.
    for key, value in (("vcpus", vcpus), ("memory_mib", memory_mib), ("image", image)):
        if value is not None:
            fields[key] = value
    if segments:
        fields["segments"] = list(segments)
    if boot is not None:
        fields["boot"] = boot
    if disk_size is not None:
        fields["disk_size"] = disk_size
    if ssh_keys:
        fields["ssh_keys"] = [read_text(f, "SSH key file", 16384) for f in ssh_keys]
    if user_data is not None:
        fields["user_data"] = read_text(user_data, "user-data file", 65536)
    if storage is not None:
        fields["storage"] = storage
    if nics:
        from dataclasses import asdict

        from fusuma.network.manager import parse_nic

        fields["nics"] = [{k: v for k, v in asdict(parse_nic(n)).items() if v is not None}
                          for n in nics]
    spec = build(VmSpec, "vm", name=name, partition=partition, disks=list(disks),
                 accel=accel, qos=qos, mergeable=mergeable, ports=list(ports),
                 machine=machine, emulator=emulator, page_reporting=page_reporting,
                 template=template, **fields)
    if start:
        c.accel_notice(accel)     # an accelerator that cannot work: refuse before creating
    c.vms.create(spec)
    if start:
        with Reverter() as rev:
            rev.add(lambda: c.vms.delete(name, force=True), "vm definition")
            c.vms.start(name)
            rev.commit()
    view = VmView(c.db.vm(name), c.paths.segments_dir)
    if as_json:
        emit_json(view.as_json())
    else:
        click.echo(f"vm {name}: {view.state} in partition {partition}")


def read_text(path: str, what: str, limit: int) -> str:
    """A small text file the user names, or one sentence."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise click.UsageError(f"cannot read {what} {path}: {exc.strerror}.") from exc
    if len(data) > limit:
        raise click.UsageError(f"{what} {path} is larger than {limit} bytes.")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise click.UsageError(f"{what} {path} is not UTF-8 text.") from exc


@vm.command("resize")
@click.argument("name")
@click.option("--disk-size", "size", required=True, metavar="SIZE",
              help="The new size, e.g. 16G: larger than now (a disk only grows).")
@click.option("--disk", default=None, metavar="DISK",
              help="One of its registered disks (default: its thin disk, for a VM of an "
                   "imported image).")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def resize(c: Ctx, name: str, size: str, disk: str | None, as_json: bool) -> None:
    """Grow a VM's disk. Running: online (QMP block_resize), and the guest sees the new
    size at once and grows its partition and file system itself (cloud-init's growpart
    does at the next boot). Stopped: the file grows (qemu-img resize as the VM's own
    uid for its thin disk). A disk never shrinks. `fusuma disk resize` does the same
    for a registered disk."""
    from dataclasses import asdict

    res = c.vms.resize_disk(name, size, disk)
    if as_json:
        emit_json(asdict(res))
    else:
        click.echo(f"vm {name}: {res.drive} {res.old_size} -> {res.size} bytes")


@vm.command("start")
@click.argument("name")
@click.option("--wait/--no-wait", default=False, show_default=True,
              help="Wait until the guest agent answers.")
@click.option("--timeout", type=float, default=120.0, show_default=True)
@pass_ctx
def start(c: Ctx, name: str, wait: bool, timeout: float) -> None:
    """Start VM NAME in its partition."""
    c.accel_notice(c.db.vm(name).accel)
    rec = c.vms.start(name, wait_agent=timeout if wait else 0.0)
    click.echo(f"vm {name}: running, pid {rec.pid}, {rec.accel_used}")


@vm.command("stop")
@click.argument("name")
@click.option("--timeout", type=float, default=10.0, show_default=True,
              help="Seconds to wait for QEMU to quit before it is killed.")
@pass_ctx
def stop(c: Ctx, name: str, timeout: float) -> None:
    """Stop VM NAME: flush guest filesystems (sync via the guest agent), then quit QEMU."""
    rec = c.vms.stop(name, timeout=timeout)
    # A guest whose agent failed is stopped without the flush: say so.
    click.echo(f"vm {name}: stopped" + (f" ({rec.error})" if rec.error else ""))


@vm.command("kill")
@click.argument("name")
@pass_ctx
def kill(c: Ctx, name: str) -> None:
    """Kill VM NAME's QEMU at once (SIGKILL); the guest gets no chance to flush."""
    c.vms.kill(name)
    click.echo(f"vm {name}: killed")


@vm.command("delete")
@click.argument("name")
@click.option("--force", is_flag=True, help="Kill it first if it is running.")
@pass_ctx
def delete(c: Ctx, name: str, force: bool) -> None:
    """Delete VM NAME's definition, logs and RAM file (its disks stay)."""
    c.vms.delete(name, force=force)
    click.echo(f"deleted vm {name}")


@vm.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List VMs."""
    from fusuma.views.host import ps_data

    data = ps_data(c, vms_only=True)["vms"]
    if as_json:
        emit_json(data)
        return
    click.echo(table([[v["name"], v["partition"], v["state"], str(v["pid"] or "-"),
                       v["accel"], str(v["vcpus"]), str(v["memory_mib"])] for v in data],
                     ["name", "partition", "state", "pid", "accel", "vcpus", "memory_mib"]))


@vm.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True,
              help="Print the VM as `ps --json` shows it, with its NICs.")
@pass_ctx
def show(c: Ctx, name: str, as_json: bool) -> None:
    """Show VM NAME: its state, partition, size, ports and NICs (network, MAC,
    address, tap, and whether the kernel has that tap now)."""
    from fusuma.views.host import job_json
    from fusuma.views.networks import vm_nics

    rec = c.db.vm(name)
    d = VmView(rec, c.paths.segments_dir).as_json()
    job = c.db.find_job(f"vm:{name}")
    d["job"] = job_json(job) if job else None
    d["nics"] = vm_nics(c.db, rec)
    if as_json:
        emit_json(d)
        return
    for key in ("name", "partition", "state", "pid", "accel", "qemu", "machine", "vcpus",
                "memory_mib", "qos", "image", "template", "error"):
        if key in d:
            click.echo(f"{key + ':':12}{d[key] if d[key] is not None else '-'}")
    click.echo(f"{'ports:':12}{', '.join(d['ports']) or '-'}")
    click.echo(f"{'segments:':12}{', '.join(d['segments']) or '-'}")
    click.echo(f"{'disks:':12}{', '.join(d['disks']) or '-'}")
    if not d["nics"]:
        # Without --nic, a VM has QEMU's user-mode NIC only when it forwards a port.
        click.echo(f"{'network:':12}" + ("user-mode (QEMU's own; the ports above)"
                                         if d["ports"] else "none"))
        return
    from fusuma.cli.network import tap_cell

    click.echo()
    click.echo(table([[str(n["index"]), n["network"], n["mac"], n["ip"] or "-",
                       tap_cell(n)] for n in d["nics"]],
                     ["nic", "network", "mac", "address", "tap"]))


@vm.command("set")
@click.argument("name")
@click.option("--qos", type=click.Choice(list(QOS_CHOICES)), required=True,
              help="The new CPU QoS class (a guaranteed VM must fit the partition's "
                   "cores beside its other guaranteed VMs).")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def set_(c: Ctx, name: str, qos: str, as_json: bool) -> None:
    """Change stopped VM NAME's settings (its QoS class)."""
    rec = c.vms.set_qos(name, qos)
    if as_json:
        emit_json(VmView(rec, c.paths.segments_dir).as_json())
    else:
        click.echo(f"vm {name}: qos {rec.qos}")


@vm.command("attach")
@click.argument("name")
@click.argument("disk")
@pass_ctx
def attach(c: Ctx, name: str, disk: str) -> None:
    """Attach DISK (of the VM's partition) to stopped VM NAME."""
    c.vms.attach_disk(name, disk)
    click.echo(f"vm {name}: disk {disk} attached")


@vm.command("detach")
@click.argument("name")
@click.argument("disk")
@pass_ctx
def detach(c: Ctx, name: str, disk: str) -> None:
    """Detach DISK from stopped VM NAME."""
    c.vms.detach_disk(name, disk)
    click.echo(f"vm {name}: disk {disk} detached")


@vm.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", type=float, default=60.0, show_default=True)
@click.option("--stdin", "use_stdin", is_flag=True, help="Send this command's stdin to it.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"exit_code", "stdout", "stderr"} instead of passing them through.')
@pass_ctx
def exec_(c: Ctx, name: str, command: tuple[str, ...], timeout: float, use_stdin: bool,
          as_json: bool) -> None:
    """Run COMMAND in VM NAME through the guest agent: `fusuma vm exec vm0 -- uname -a`.

    COMMAND's stdout and stderr are printed and its exit code becomes fusuma's."""
    data = sys.stdin.buffer.read() if use_stdin else None
    res = c.vms.exec(name, list(command), stdin=data, timeout=timeout)
    if as_json:
        emit_json({"exit_code": res.exit_code, "signal": res.signal,
                   "stdout": res.stdout.decode(errors="replace"),
                   "stderr": res.stderr.decode(errors="replace")})
        return
    sys.stdout.buffer.write(res.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(res.stderr)
    sys.stderr.flush()
    sys.exit(res.exit_code if res.signal is None else 128 + int(res.signal))


@vm.command("trim")
@click.argument("name")
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="Seconds to wait for the guest agent and the command.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"resident_before_mib", "resident_after_mib", "returned_mib", '
                   '"seconds"}.')
@pass_ctx
def trim(c: Ctx, name: str, timeout: float, as_json: bool) -> None:
    """Hand the memory running VM NAME does not need back to the host, now.

    Through the guest agent the guest writes back dirty data, drops its clean caches
    (page cache, dentries, inodes) and compacts its free memory; free page reporting
    then reports the freed blocks and QEMU punches them out of the guest's RAM file.
    fusuma waits until the RAM's resident size holds still and prints it before and
    after. The guest's caches refill as it reads again.

    Needs a VM booted with page reporting (`vm create --page-reporting`, the default on
    cgroup v1) and a guest kernel with the virtio_balloon driver; refused otherwise."""
    res = c.vms.trim(name, timeout=timeout)
    if as_json:
        emit_json(res)
        return
    click.echo(f"vm {name}: RAM resident {res['resident_before_mib']} -> "
               f"{res['resident_after_mib']} MiB ({res['returned_mib']} MiB handed back in "
               f"{res['seconds']} s)")


@vm.command("console")
@click.argument("name")
@click.option("--log", "show_log", is_flag=True,
              help="Print the console log so far instead of attaching.")
@pass_ctx
def console(c: Ctx, name: str, show_log: bool) -> None:
    """Attach to VM NAME's serial console (detach with Ctrl-]), or print its log (the
    rotated file first: at most twice FUSUMA_CONSOLE_LOG_MAX)."""
    rec = c.db.vm(name)
    if show_log:
        import contextlib

        from fusuma.qemu.consolelog import LOG_NAME, rotated

        path = c.paths.vm_dir(name) / LOG_NAME
        if not path.exists():
            raise NotFoundError(f"VM {name!r} has no console log yet; start it first.")
        for part in (rotated(path), path):
            with contextlib.suppress(FileNotFoundError):
                sys.stdout.buffer.write(part.read_bytes())
        return
    if VmView(rec).state != "running":
        raise StateError(f"VM {name!r} is {VmView(rec).state}; start it first.")
    import socket

    sock_path = c.paths.vm_run_dir(name) / "console.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(sock_path))
    except OSError as exc:
        raise StateError(f"cannot attach to the console of {name!r}: {exc}; another "
                         "console session may hold it.") from exc
    click.echo(f"connected to {name}'s console; Ctrl-] detaches", err=True)
    _bridge(s)


def _bridge(s: socket.socket) -> None:
    import select
    import termios
    import tty

    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd) if os.isatty(fd) else None
    try:
        if old is not None:
            tty.setraw(fd)
        while True:
            ready, _, _ = select.select([fd, s], [], [])
            if s in ready:
                data = s.recv(4096)
                if not data:
                    break
                os.write(sys.stdout.fileno(), data)
            if fd in ready:
                data = os.read(fd, 1024)
                if not data or b"\x1d" in data:
                    break
                s.sendall(data)
    finally:
        if old is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, old)
        s.close()
        click.echo("", err=True)



def _subcommands() -> None:
    """`vm snapshot ...`, `vm backup`, `vm restore`: in modules of their own."""
    from fusuma.cli.backup import backup, restore
    from fusuma.cli.snapshot import snapshot

    vm.add_command(snapshot)
    vm.add_command(backup)
    vm.add_command(restore)


_subcommands()
