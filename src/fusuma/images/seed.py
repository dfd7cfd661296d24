"""cloud-init's NoCloud seed of a VM: a small read-only ISO 9660 disk labelled
``cidata`` with ``meta-data`` (instance id, hostname), ``user-data`` (the SSH keys and
the user's own user-data) and, for a VM with NICs on fusuma's networks,
``network-config`` (DHCP on each NIC, matched by its MAC).

The files are written by ``genisoimage`` (or ``xorriso -as mkisofs``) with Joliet and
Rock Ridge names, which cloud-init finds by the label on any block device."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fusuma.errors import HostError, ImageError, SpecError
from fusuma.frozen import frozen

LABEL = "cidata"
KEY_RE = re.compile(r"^(ssh-(rsa|dss|ed25519)|ecdsa-sha2-nistp(256|384|521)|"
                    r"sk-(ssh-ed25519|ecdsa-sha2-nistp256)@openssh\.com) [A-Za-z0-9+/=]+"
                    r"( [^\n]{0,512})?\Z")
TOOLS = (("genisoimage",), ("xorriso", "-as", "mkisofs"))
# A seed's size: a whole number of MiB, with room for at least this many more bytes.
# The guest's disk keeps the size it saw at boot, and a clone's seed (another instance
# id, hostname and MACs) must fit the template's.
PAD = 2**20
ROOM = 64 * 2**10


@frozen
class Seed:
    """What a VM's seed says."""

    instance_id: str
    hostname: str
    ssh_keys: tuple[str, ...] = ()
    user_data: str | None = None
    macs: tuple[str, ...] = ()       # the VM's NICs on fusuma's networks
    # MAC -> MTU of those whose network's is not 1500 (one spanning hosts)
    mtus: tuple[tuple[str, int], ...] = ()


def check_keys(lines: Sequence[str]) -> list[str]:
    """SSH public keys, one a line (blank lines and # comments skipped); one sentence
    for a line that is not one (a private key given by mistake, most often)."""
    out = []
    for i, raw in enumerate(lines, 1):
        for line in raw.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if not KEY_RE.match(line):
                what = "a private key" if "PRIVATE KEY" in line else "not an SSH public key"
                raise SpecError(f"SSH key {i} is {what}; give a public key file such as "
                                "~/.ssh/id_ed25519.pub.")
            out.append(line)
    return out


def _yaml_str(s: str) -> str:
    return json.dumps(s)      # a JSON string is a YAML string


def meta_data(seed: Seed) -> str:
    return (f"instance-id: {_yaml_str(seed.instance_id)}\n"
            f"local-hostname: {_yaml_str(seed.hostname)}\n")


def user_data(seed: Seed) -> str:
    """The user-data: a #cloud-config with the keys, and the user's own as a second
    part of a MIME multipart (cloud-init runs both)."""
    keys = "".join(f"  - {_yaml_str(k)}\n" for k in seed.ssh_keys)
    ours = "#cloud-config\n" + (f"ssh_authorized_keys:\n{keys}" if keys else "")
    if seed.user_data is None:
        return ours
    from email.mime.multipart import MIMEMultipart
    from email.mime.text import MIMEText

    msg = MIMEMultipart()
    msg.attach(MIMEText(ours, "cloud-config"))
    first = seed.user_data.lstrip()[:64]
    subtype = ("cloud-config" if first.startswith("#cloud-config") else
               "x-shellscript" if first.startswith("#!") else
               "cloud-boothook" if first.startswith("#cloud-boothook") else "plain")
    if first.startswith("Content-Type: multipart"):
        raise SpecError("user-data that is itself a MIME multipart cannot be combined "
                        "with fusuma's part; give a #cloud-config or a script.")
    msg.attach(MIMEText(seed.user_data, subtype))
    return msg.as_string()


def network_config(seed: Seed) -> str | None:
    """Version 2 network configuration: DHCP on each NIC, matched by MAC, and the
    network's MTU where it is not 1500 (cloud-init sets it before DHCP; not every
    guest's DHCP client applies option 26)."""
    if not seed.macs:
        return None
    mtus = dict(seed.mtus)
    eth = {f"nic{i}": {"match": {"macaddress": mac}, "set-name": f"eth{i}", "dhcp4": True,
                       **({"mtu": mtus[mac]} if mac in mtus else {})}
           for i, mac in enumerate(seed.macs)}
    return json.dumps({"version": 2, "ethernets": eth}, indent=1) + "\n"


def save_inputs(seed: Seed, path: Path) -> None:
    """Keep what ``seed`` says beside its ISO (root's, 0400), for a template's clones."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(asdict(seed)))
        os.chmod(tmp, 0o400)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def load_inputs(path: Path) -> Seed:
    """What :func:`save_inputs` kept (a file of root's)."""
    try:
        return parse_inputs(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ImageError(f"cannot read the seed's inputs {path}: {exc}.") from exc


def parse_inputs(d: Any) -> Seed:
    """What :func:`save_inputs` writes, parsed (ValueError, KeyError or TypeError
    when it is not)."""
    if not isinstance(d, dict):
        raise TypeError("not an object")
    return Seed(instance_id=str(d["instance_id"]), hostname=str(d["hostname"]),
                ssh_keys=tuple(str(k) for k in d.get("ssh_keys") or ()),
                user_data=None if d.get("user_data") is None else str(d["user_data"]),
                macs=tuple(str(m) for m in d.get("macs") or ()),
                mtus=tuple((str(m), int(v)) for m, v in d.get("mtus") or ()))



def write(seed: Seed, path: Path, size: int | None = None) -> None:
    """Write the seed ISO at ``path`` (0400), replacing it whole, padded with zeros to
    ``size`` bytes (a clone's seed: as large as its template's guest saw) or else to a
    whole MiB with :data:`ROOM` to spare."""
    import tempfile

    files = {"meta-data": meta_data(seed), "user-data": user_data(seed)}
    net = network_config(seed)
    if net is not None:
        files["network-config"] = net
    tool = next((t for t in TOOLS if shutil.which(t[0])), None)
    if tool is None:
        raise HostError("neither genisoimage nor xorriso is on this host, and a "
                        "cloud-init seed needs one: apt-get install genisoimage.")
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="fusuma-seed-") as d:
        for name, text in files.items():
            (Path(d) / name).write_text(text)
        argv = [*tool, "-quiet", "-output", str(tmp), "-volid", LABEL, "-joliet",
                "-rock", "-input-charset", "utf-8", *(str(Path(d) / n) for n in files)]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    try:
        if proc.returncode != 0:
            raise ImageError(f"cannot write the cloud-init seed {path}: "
                             f"{proc.stderr.strip()}.")
        made = tmp.stat().st_size
        if size is None:
            # Room for a clone's seed, whose ID and name differ (fusuma.images.layers).
            size = -(-(made + ROOM) // PAD) * PAD
        elif made > size:
            raise ImageError(f"the cloud-init seed {path} takes {made} bytes, more "
                             f"than the {size} its template's guest has.")
        os.truncate(tmp, size)
        os.chmod(tmp, 0o400)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
