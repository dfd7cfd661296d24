"""A device set recorded by another host is parsed into exactly the devices fusuma makes
(fusuma.qemu.recorded): everything fusuma makes passes unchanged, and malicious sets
(other -device kinds, options smuggled in with commas, chardevs with paths, huge counts,
wrong types) are refused with one sentence before any argv exists."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fusuma.qemu.cmdline import DeviceSet, DiskConfig, SegmentConfig, build_argv, device_set
from fusuma.qemu.recorded import (
    MAX_DEVICES,
    DeviceSetRefused,
    check_carried,
    parse_device_set,
)
from fusuma.qemu.versions import TCG_CPU_IDENTITY
from tests.unit.test_cmdline import cfg

GUID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def every_set_fusuma_makes() -> list[DeviceSet]:
    out = []
    for accel, segs, root, ports, disks, reporting, genid in itertools.product(
            ("kvm", "tcg"), (0, 2), (False, True), (False, True), (0, 3), (False, True),
            (None, GUID)):
        c = cfg(accel=accel, machine="pc-q35-7.2", vmgenid=genid, page_reporting=reporting,
                segments=[SegmentConfig(f"s{i}", Path(f"/s{i}"), 2**21 * (i + 1), "/mnt")
                          for i in range(segs)],
                root_disk=Path("/root.img") if root else None,
                ports=[(8080, 80)] if ports else [],
                disks=[DiskConfig(f"d{i}", Path(f"/d{i}.img")) for i in range(disks)])
        out.append(device_set(c))
    tcg = out[-1]
    out.append(replace(tcg, cpu=f"max,{TCG_CPU_IDENTITY}",
                       cpu_features=("avx2", "sse4.1", "x2apic", "la57")))
    # What fusuma recorded before the image's root became disk-fusuma-root.
    old = device_set(cfg(machine="pc-q35-7.2", root_disk=Path("/usr.img")))
    assert old.devices[2].props == (("drive", "disk-fusuma-root"), ("serial", "fusuma-root"))
    out.append(replace(old, devices=(*old.devices[:2], replace(
        old.devices[2], props=(("drive", "disk-fusuma-usr"), ("serial", "fusuma-usr"))))))
    return out


def test_every_device_set_fusuma_makes_passes_unchanged() -> None:
    sets = every_set_fusuma_makes()
    assert len(sets) == 130
    for ds in sets:
        assert parse_device_set(ds.dumps()) == ds
        assert check_carried({"machine": ds.machine, "devices": ds.dumps(),
                              "accel_used": "tcg"})["devices"] == ds.dumps()


def good() -> dict[str, Any]:
    ds = device_set(cfg(machine="pc-q35-7.2", vmgenid=GUID, page_reporting=True,
                        ports=[(8080, 80)], disks=[DiskConfig("d0", Path("/d0.img"))],
                        segments=[SegmentConfig("tools", Path("/t"), 2**21, "/mnt/t")]))
    out: dict[str, Any] = ds.as_json()
    return out


def dev(driver: str, **props: str) -> dict[str, Any]:
    return {"driver": driver, "props": [[k, v] for k, v in props.items()]}


def with_devices(*extra: dict[str, Any]) -> dict[str, Any]:
    d = good()
    d["devices"] = d["devices"] + list(extra)
    return d


MALICIOUS: dict[str, tuple[object, str]] = {
    # Devices fusuma never makes: a host's files, memory or PCI devices for the guest.
    "9p share of /": (with_devices(dev("virtio-9p-pci", fsdev="root", mount_tag="r")),
                      "'virtio-9p-pci', not a device kind fusuma makes"),
    "ivshmem": (with_devices(dev("ivshmem-plain", memdev="seg-tools")),
                "not a device kind fusuma makes"),
    "vfio": (with_devices(dev("vfio-pci", host="0000:00:1f.2")),
             "not a device kind fusuma makes"),
    "kind with a comma": (with_devices(dev("virtio-blk-pci,drive=disk-d0,serial=x")),
                          "not a device kind fusuma makes"),
    # Options smuggled in with commas (QEMU's option syntax) or extra options.
    "comma in a value": (with_devices(dev("virtio-blk-pci", drive="disk-x,file=/etc/shadow",
                                          serial="x")),
                         "option drive='disk-x,file=/etc/shadow' is not of the form"),
    "doubled comma": (with_devices(dev("virtio-blk-pci", drive="disk-y,,z", serial="y")),
                      "is not of the form"),
    "extra option": (with_devices(dev("virtio-blk-pci", drive="disk-z", serial="z",
                                      addr="0x1f")),
                     "has options 'drive', 'serial', 'addr', not drive, serial"),
    "option key injection": (with_devices(dev("virtio-balloon-pci",
                                              **{"id": "balloon1",
                                                 "free-page-reporting,x": "on"})),
                             "'free-page-reporting,x', not id, free-page-reporting"),
    "serial not its disk": (with_devices(dev("virtio-blk-pci", drive="disk-q", serial="r")),
                            "serial is not its disk's name"),
    # Chardevs and backends with paths.
    "chardev path": (with_devices(dev("virtserialport", bus="vser0.0",
                                      chardev="socket,path=/root/x", name="n")),
                     "option chardev='socket,path=/root/x'"),
    "serial to a file": ({**good(), "serial": "file:/etc/shadow"},
                         "serial 'file:/etc/shadow' is not con0"),
    "drive is a path": (with_devices(dev("virtio-blk-pci", drive="/dev/sda", serial="sda")),
                        "option drive='/dev/sda'"),
    "machine options": ({**good(), "machine": "pc-q35-7.2,memory-backend=x"},
                        "is not a versioned q35 machine type"),
    "machine props": ({**good(), "machine_props": [["sata", "on"], ["smbus", "off"],
                                                  ["vmport", "off"], ["i8042", "off"]]},
                      "are not fusuma's"),
    "cpu options": ({**good(), "cpu": "host,-kvm"}, "cpu 'host,-kvm' is not one fusuma"),
    "memory options": ({**good(), "memory": "256M,slots=1,maxmem=1G,share=on"},
                       "is not of the form fusuma gives -m"),
    "cpu feature injection": ({**good(), "cpu": "max", "cpu_features": ["avx2,kvm=off"]},
                              "CPU feature 'avx2,kvm=off' is not a feature name"),
    # Huge counts.
    "huge smp": ({**good(), "smp": 100000}, "smp is 100000, outside 1..64"),
    "huge memory": ({**good(), "memory": "99999999M"}, "outside 64.."),
    "many devices": (with_devices(*[dev("virtio-blk-pci", drive=f"disk-n{i}",
                                        serial=f"n{i}") for i in range(200)]),
                     f"more than {MAX_DEVICES}"),
    "many disks": (with_devices(*[dev("virtio-blk-pci", drive=f"disk-n{i}",
                                      serial=f"n{i}") for i in range(24)]),
                   "virtio-blk-pci devices, more than 24"),
    "two balloons": (with_devices(dev("virtio-balloon-pci", id="balloon0",
                                      **{"free-page-reporting": "on"})),
                     "2 virtio-balloon-pci devices, more than 1"),
    "one drive twice": (with_devices(dev("virtio-blk-pci", drive="disk-d0", serial="d0")),
                        "names disk-d0 twice"),
    "slots for absent segments": ({**good(), "memory": "256M,slots=9,maxmem=268435457"},
                                  "9 slots for 1 virtio-pmem devices"),
    "huge maxmem": ({**good(), "memory": "256M,slots=1,maxmem=999999999999999999"},
                    "maxmem 999999999999999999 is out of bounds"),
    "many features": ({**good(), "cpu": "max", "cpu_features": [f"f{i}" for i in range(600)]},
                      "more than 512"),
    "huge text": (json.dumps({**good(), "pad": "x" * 10**6}), "longer than 65536"),
    # Wrong types.
    "smp as text": ({**good(), "smp": "2,maxcpus=4096"}, "smp is str, not an integer"),
    "smp as bool": ({**good(), "smp": True}, "smp is bool, not an integer"),
    "devices as object": ({**good(), "devices": {"driver": "vmgenid"}}, "not a list"),
    "props as object": (with_devices({"driver": "vmgenid", "props": {"id": "v"}}),
                        "not a list"),
    "driver as number": (with_devices({"driver": 7, "props": []}), "driver is int"),
    "value as number": (with_devices(dev("virtio-blk-pci") | {"props": [["drive", 1],
                                                                       ["serial", "a"]]}),
                        "value is int, not a string"),
    "pair of three": (with_devices({"driver": "vmgenid", "props": [["id", "v", "x"]]}),
                      "is not a [name, value] pair"),
    "not an object": ("[1, 2]", "it is not a JSON object"),
    "not json": ("{devices:", "it is not JSON"),
    "a number": (7, "the record is int, not a string"),
    "unknown field": ({**good(), "x-option\n": "-object"},
                      "fields fusuma does not write ('x-option\\n')"),
    "missing field": ({k: v for k, v in good().items() if k != "cpu"}, "it lacks cpu"),
    "other version": ({**good(), "version": 2}, "version is 2, outside 1..1"),
    "port before its bus": ({**good(), "devices": good()["devices"][1::-1]},
                            "comes before the virtio-serial-pci"),
}


@pytest.mark.parametrize("case", sorted(MALICIOUS))
def test_a_malicious_device_set_is_refused_with_one_sentence(case: str) -> None:
    raw, why = MALICIOUS[case]
    text = raw if not isinstance(raw, dict) else json.dumps(raw)
    with pytest.raises(DeviceSetRefused) as exc:
        parse_device_set(text)
    msg = str(exc.value)
    assert msg.startswith("the recorded device set is refused: "), msg
    assert why in msg, msg
    assert "\n" not in msg and len(msg) < 400, msg


def test_the_good_base_of_the_malicious_cases_passes() -> None:
    assert parse_device_set(json.dumps(good())).dumps() == json.dumps(
        good(), separators=(",", ":"))


@pytest.mark.parametrize("record,why", [
    ({"accel_used": "kvm -S"}, "accelerator 'kvm -S' is not kvm or tcg"),
    ({"machine": "pc-q35-7.2,x=y"}, "not a versioned q35 machine type"),
    ({"machine": "pc-q35-9.2", "devices": json.dumps(good())},
     "machine type pc-q35-9.2 is not its device set's pc-q35-7.2"),
    ({"devices": json.dumps(with_devices(dev("e1000")))}, "'e1000', not a device kind"),
    ({"qemu_binary": "/tmp/x"}, "fields fusuma does not carry ('qemu_binary')"),
    ({"machine": 7}, "machine is int"),
])
def test_the_carried_record_is_checked_as_a_whole(record: dict[str, object],
                                                  why: str) -> None:
    with pytest.raises(DeviceSetRefused, match="refused") as exc:
        check_carried(record)
    assert why in str(exc.value)


def test_a_parsed_set_renders_only_fusumas_device_options() -> None:
    ds = parse_device_set(json.dumps(good()))
    argv = build_argv(cfg(devices=ds, ports=[(8080, 80)], page_reporting=True,
                          disks=[DiskConfig("d0", Path("/d0.img"))],
                          segments=[SegmentConfig("tools", Path("/t"), 2**21, "/mnt/t")]))
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]
    assert devices == [
        "virtio-serial-pci,id=vser0",
        "virtserialport,bus=vser0.0,chardev=qga0,name=org.qemu.guest_agent.0",
        "virtio-pmem-pci,memdev=seg-tools,id=pmem-tools",
        "virtio-net-pci,netdev=net0,romfile=",
        "virtio-blk-pci,drive=disk-d0,serial=d0",
        "virtio-balloon-pci,id=balloon0,free-page-reporting=on",
        f"vmgenid,id=vmgenid0,guid={GUID}"]


def test_a_final_newline_is_not_of_fusumas_form() -> None:
    """Python's ``$`` matches before a final newline: every pattern here ends at the
    string's end (``\\Z``), or "pc-q35-7.2\\n" from another host would pass."""
    from fusuma.qemu import recorded

    for rx, good in ((recorded.MACHINE_RE, "pc-q35-7.2"), (recorded.MEMORY_RE, "128M"),
                     (recorded.FEATURE_RE, "x2apic")):
        assert rx.match(good) and not rx.match(good + "\n"), rx.pattern
    for kind, props in recorded._PATTERNS.items():
        for key, pattern in props:
            assert pattern.pattern.endswith("\\Z"), (kind, key)


def nic_set(vcpus: int, *macs: str) -> dict[str, Any]:
    from fusuma.qemu.cmdline import NicConfig
    nics = [NicConfig(f"nic{i}", mac, max(1, min(vcpus, 8)), f"fzt-1-{i}", "fzb-l", "l")
            for i, mac in enumerate(macs)]
    out: dict[str, Any] = device_set(cfg(machine="pc-q35-7.2", vcpus=vcpus,
                                         nics=nics)).as_json()
    return out


@pytest.mark.parametrize("vcpus", [1, 2, 4, 9])
def test_tap_nics_fusuma_makes_pass_unchanged(vcpus: int) -> None:
    d = nic_set(vcpus, "52:54:00:aa:00:01", "52:54:00:aa:00:02")
    ds = parse_device_set(json.dumps(d))
    assert ds.as_json() == d
    nets = [dict(x.props) for x in ds.devices if x.driver == "virtio-net-pci"]
    assert [n["netdev"] for n in nets] == ["nic0", "nic1"]
    assert all(("mq" in n) == (vcpus > 1) for n in nets)


def _nic(d: dict[str, Any]) -> list[list[str]]:
    return next(x["props"] for x in d["devices"] if x["driver"] == "virtio-net-pci")


@pytest.mark.parametrize(("change", "said"), [
    (lambda p: p.append(["vhost", "on"]), "has options"),
    (lambda p: p.__setitem__(0, ["netdev", "nic8"]), "option netdev='nic8'"),
    (lambda p: p.__setitem__(0, ["netdev", "net0,ifname=eth0"]), "is not of the form"),
    (lambda p: p.__setitem__(1, ["mac", "53:54:00:aa:00:01"]), "multicast"),
    (lambda p: p.__setitem__(1, ["mac", "52:54:00:AA:00:01"]), "option mac="),
    (lambda p: p.__setitem__(4, ["vectors", "10"]), "vectors=10 for 2 vCPU(s)"),
    (lambda p: p.__setitem__(4, ["vectors", "64"]), "option vectors='64'"),
    (lambda p: p.__setitem__(3, ["mq", "off"]), "option mq='off'"),
])
def test_a_tap_nic_wider_than_fusumas_is_refused(change: Any, said: str) -> None:
    d = nic_set(2, "52:54:00:aa:00:01")
    change(_nic(d))
    with pytest.raises(DeviceSetRefused, match=re.escape(said)):
        parse_device_set(json.dumps(d))


def test_two_nics_with_one_mac_or_one_queue_for_many_vcpus_are_refused() -> None:
    with pytest.raises(DeviceSetRefused, match="one MAC"):
        parse_device_set(json.dumps(nic_set(1, "52:54:00:aa:00:01", "52:54:00:aa:00:01")))
    d = nic_set(1, "52:54:00:aa:00:01")
    d["smp"] = 2
    with pytest.raises(DeviceSetRefused, match="one queue for 2 vCPU"):
        parse_device_set(json.dumps(d))


def test_queue_zero_is_read_from_the_netdev_argument() -> None:
    from fusuma.network.queues import first_fds
    argv = b"\0".join([b"qemu", b"-netdev", b"tap,id=nic0,fd=31,vhost=off", b"-netdev",
                       b"tap,id=nic1,fds=40:41:42,vhost=off", b"-netdev", b"user,id=net0",
                       b"-device", b"virtio-net-pci,netdev=nic0"])
    assert first_fds(argv) == {"nic0": 31, "nic1": 40}


def test_a_user_mode_nic_beside_tap_nics_is_refused() -> None:
    base = good()     # it has the user-mode NIC (a port forward)
    base["devices"].append(dev("virtio-net-pci", netdev="nic0", mac="52:54:00:00:00:01",
                               romfile=""))
    with pytest.raises(DeviceSetRefused, match="user-mode NIC beside other NICs"):
        parse_device_set(json.dumps(base))


def test_the_carried_nics_are_checked() -> None:
    from fusuma.qemu.recorded import carried_nics

    nic = {"index": 0, "network": "lan", "mac": "52:54:00:00:00:01", "ip": "10.0.5.9"}
    assert carried_nics({"nics": [nic, {**nic, "index": 1, "ip": None}]}) == [
        (0, "lan", "52:54:00:00:00:01", "10.0.5.9"), (1, "lan", "52:54:00:00:00:01", None)]
    assert check_carried({"nics": [nic]}) == {}
    assert carried_nics({}) == []
    for bad, why in [({**nic, "index": 1}, "index is 1, outside 0..0"),
                     ({**nic, "network": "lan,x"}, "is not a name"),
                     ({**nic, "mac": "ff:ff:ff:ff:ff:ff"}, "not a unicast MAC"),
                     ({**nic, "ip": "10.0.5.999"}, "not an IPv4 address"),
                     ({**nic, "ip": "10.0.5.9\n"}, "not an IPv4 address"),
                     ({**nic, "tap": "x"}, "not an object of index"),
                     ("lan", "not an object of index")]:
        with pytest.raises(DeviceSetRefused, match="refused") as exc:
            carried_nics({"nics": [bad]})
        assert why in str(exc.value), (bad, exc.value)
    with pytest.raises(DeviceSetRefused, match="more than 8"):
        carried_nics({"nics": [nic] * 9})
