"""Free page reporting refused where it cannot work: one clear sentence, nothing changed.

A VM booted without the device, and a guest whose driver does not take it (here: the
guest unbinds its virtio_balloon driver, as a kernel without it would never bind)."""

from __future__ import annotations

import pytest

from tests.conftest import Host
from tests.fault.test_bad_input import assert_one_sentence

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]

UNBIND = ("for d in /sys/bus/virtio/drivers/virtio_balloon/virtio*; do "
          "echo ${d##*/} > /sys/bus/virtio/drivers/virtio_balloon/unbind; done")


def test_trim_refused_without_reporting(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "512")
    host.run("vm", "create", "off", "-p", "p0", "--memory", "192", "--no-page-reporting",
             "--start")
    host.run("vm", "create", "on", "-p", "p0", "--memory", "192", "--start")
    ps = {v["name"]: v for v in host.ps()["vms"]}
    assert ps["off"]["ram"]["page_reporting"] is False
    assert ps["on"]["ram"]["page_reporting"] is True
    res = host.fail("vm", "trim", "off")
    assert_one_sentence(res.err)
    assert "booted without page reporting" in res.err

    # The guest lets go of the device: QEMU sees the feature unused, and trim says so.
    host.run("vm", "exec", "on", "--", "/bin/sh", "-c", UNBIND)
    res = host.fail("vm", "trim", "on")
    assert_one_sentence(res.err)
    assert "has not enabled free page reporting" in res.err
    after = {v["name"]: v for v in host.ps()["vms"]}
    assert after["on"]["state"] == after["off"]["state"] == "running"
    host.run("vm", "exec", "on", "--", "true")


def test_a_stopped_vm_cannot_be_trimmed(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "512")
    host.run("vm", "create", "s", "-p", "p0", "--memory", "192")
    res = host.fail("vm", "trim", "s")
    assert_one_sentence(res.err)
    assert "is stopped" in res.err
