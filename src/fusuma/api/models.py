"""The API's request and response bodies.

Requests that define objects are the spec models the CLI and ``fusuma up`` validate
with (``fusuma.spec``); responses have the shapes of the CLI's ``--json`` output, which
they are made from (the same functions produce both, and
``tests/unit/test_api_models.py`` checks the CLI's output against these models).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fusuma.spec import (
    DiskSpec,
    Name,
    NetworkSpec,
    PartitionSpec,
    VmSpec,
    _name_field,
    _overcommit_field,
)

# A request's JSON is taken as typed: no 0 for false, no "1" for 1 (pydantic's strict
# mode), so what the document calls invalid is refused (a 400 naming the field).
STRICT = ConfigDict(strict=True)


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- requests -------------------------------------------------------------------------
class VmCreate(VmSpec):
    """A VM definition (the keys of a spec's ``[[vm]]``), and whether to start it."""

    model_config = STRICT
    start: bool = False


class PartitionCreate(PartitionSpec):
    """A partition (the keys of a spec's ``[[partition]]``); its ``qemu`` is a version
    `fusuma qemu list` shows (a binary's path only from root's CLI or spec file)."""

    model_config = STRICT
    qemu: str | None = Field(None, description="Its QEMU: an installed version such as "
                             "\"10.0\" (`fusuma qemu list`); none: the system's. A "
                             "binary's path is refused here.")


class NetworkCreate(NetworkSpec):
    """A network (the keys of a spec's ``[[network]]``)."""

    model_config = STRICT


class DiskCreate(DiskSpec):
    """A disk (the keys of a spec's ``[[disk]]``): a regular file inside a storage
    directory that root declared (`fusuma storage list`), never a symlink or a
    device."""

    model_config = STRICT


class PartitionPatch(_Req):
    """New cores, memory limit and/or memory overcommit of a running partition."""

    cpus: list[int] | str | None = None
    memory_mib: Annotated[int, Field(gt=0)] | None = None
    memory_overcommit: float | None = Field(
        None, description="Its memory overcommit, 1.0 (none) to 16: burstable VMs' RAM "
        "above their floors is admitted divided by this.")

    _check_overcommit = field_validator("memory_overcommit")(_overcommit_field)


class VmPatch(_Req):
    """Changes to a stopped VM: its QoS class, its disks (the full new list)."""

    qos: Literal["guaranteed", "burstable", "best-effort"] | None = None
    disks: list[str] | None = None


class DiskPatch(_Req):
    partition: Name

    _check = field_validator("partition")(_name_field)


class VmStateChange(_Req):
    action: Literal["start", "stop", "kill"]
    timeout: Annotated[float, Field(gt=0, le=3600)] = 10.0
    wait_agent: Annotated[float, Field(ge=0, le=3600)] = 0.0


class VmMove(_Req):
    partition: Name
    mode: Literal["zero-copy", "copy"] = "zero-copy"

    _check = field_validator("partition")(_name_field)


class VmResize(_Req):
    """Grow a VM's disk, online while it runs: its thin disk (``disk`` left out) or a
    registered disk attached to it, to ``size`` (such as "16G"; larger than now)."""

    size: Annotated[str, Field(max_length=32)]
    disk: Name | None = None


class VmExec(_Req):
    command: Annotated[list[str], Field(min_length=1)]
    stdin: str | None = None
    timeout: Annotated[float, Field(gt=0, le=3600)] = 60.0


class Maintain(_Req):
    """Either ``via`` (move the VMs out and back) or ``in_place`` (cpr-transfer)."""

    via: Name | None = None
    in_place: bool = False
    qemu: str | None = Field(None, description="The QEMU to come back on: an installed "
                             "version (`fusuma qemu list`), never a binary's path.")

    @field_validator("via")
    @classmethod
    def _via(cls, v: str | None) -> str | None:
        return None if v is None else _name_field(v)

    @model_validator(mode="after")
    def _one_way(self) -> Maintain:
        if (self.via is None) == (not self.in_place):
            raise ValueError("give either via (move the VMs out and back) or "
                             "in_place: true (cpr-transfer, QEMU >= 10.0), not both or "
                             "neither")
        return self


class SegmentCreate(_Req):
    name: Name
    from_dir: str | None = Field(None, description="Refused here: a segment from a host "
                                 "directory is built only by root's CLI.")
    from_image: str | None = None

    _check = field_validator("name")(_name_field)


class TemplateCreate(_Req):
    """Stop running VM ``from_vm`` into template ``name`` (`fusuma template create`)."""

    name: Name
    from_vm: Name

    _check = field_validator("name", "from_vm")(_name_field)


class ImageBuild(_Req):
    kind: str = "minimal"
    force: bool = False


class ImageImport(_Req):
    """A disk image to import: a regular file inside a storage directory root declared
    (`fusuma storage list`), never a symlink or a device."""

    name: Name
    path: str = Field(description="The image file, inside a storage directory.",
                      max_length=4096)
    format: Literal["qcow2", "raw"] | None = None

    _check = field_validator("name")(_name_field)

    @field_validator("path")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/") or "\x00" in v:
            raise ValueError(f"image path {v!r} must be an absolute path")
        return v


# -- responses ------------------------------------------------------------------------
class _Resp(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobInfo(_Resp):
    """The operation holding an object (a move, a delete, ...), from the state file."""

    kind: str
    phase: str
    peer: str | None
    since: float
    owner_pid: int
    owner_alive: bool


class NicInfo(_Resp):
    """A VM's NIC: its network, MAC, address (a managed network's), its tap's name and
    whether the kernel has that tap now."""

    index: int
    network: str
    mac: str
    ip: str | None
    tap: str | None
    tap_present: bool


class NetworkNicInfo(NicInfo):
    """A NIC in a network's list: whose it is, and the NIC."""

    vm: str


class VmInfo(_Resp):
    """A VM as `fusuma vm list --json` / `ps --json` show it."""

    name: str
    partition: str
    state: str
    pid: int | None
    accel: str
    vcpus: int
    memory_mib: int
    shared_ram: bool
    qos: str
    mergeable: bool
    segments: list[str]
    ports: list[str]
    qemu: str | None = None        # the QEMU version running it ("10.0.2")
    machine: str | None = None     # its pinned machine type ("pc-q35-7.2")
    emulator: str = "shared"       # where its emulator threads run
    host_memory: dict[str, Any] | None
    disks: list[str]
    error: str | None
    job: JobInfo | None = None
    # Guest RAM on the host: {"page_reporting", "resident_mib", "returned_mib"}
    ram: dict[str, Any] | None = None
    # Its memory as admitted: {"class", "floor_mib", "admitted_mib", "resident_mib",
    # "reclaimable_mib"} (fusuma.capacity; `ps --json` and the API only)
    memory: dict[str, Any] | None = None
    template: str | None = None     # the template a clone was started from
    image: str | None = None        # a kind fusuma builds, or an imported image
    boot: str = "kernel"            # kernel | bios | uefi
    nics: list[NicInfo] = []        # NICs on fusuma networks ([]: user-mode network)


class NetworkInfo(_Resp):
    """A network as `fusuma network list --json` shows it."""

    name: str
    type: str
    bridge: str
    subnet: str | None
    gateway: str | None
    nat: bool
    isolated: bool
    filtering: bool
    mtu: int = 1500                   # its bridge's and taps' (guests told by DHCP)
    state: str                        # up | no-dhcp | down
    keeper_pid: int | None
    dnsmasq_pid: int | None
    vms: list[str]
    nics: list[NetworkNicInfo] = []


class PartitionInfo(_Resp):
    """A partition as `fusuma partition list --json` / `ps --json` show it."""

    name: str
    cpus: list[int]
    memory_mib: int
    supervisor_pid: int | None
    state: str
    qemu: str | None
    qemu_version: str | None = None   # the version ``qemu`` names, if known
    io_weight: int | None
    disks: list[str]
    memory_use: dict[str, float | None]
    # Its effective memory overcommit (its own, else the host's) and its VMs' guest RAM
    # summed: {"ram_mib", "admitted_mib", "resident_mib", "reclaimable_mib"}
    memory_overcommit: float = 1.0
    memory_admission: dict[str, float] | None = None
    # What keeps its cores to itself: "cpuset partition root" / "cpuset partition
    # isolated" / "exclusive cpuset" / "shared" (fusuma.host.cgroups HELD_*)
    cores_held_by: str | None = None
    job: JobInfo | None = None


class PsInfo(_Resp):
    partitions: list[PartitionInfo]
    vms: list[VmInfo]
    networks: list[NetworkInfo] = []


class DiskInfo(_Resp):
    name: str
    path: str
    partition: str
    vm: str | None


class SegmentInfo(_Resp):
    name: str
    path: str
    size_mib: float
    source: str
    used_by: list[str]
    created_at: str


class OperationInfo(_Resp):
    id: str
    class_: str = Field(alias="class")
    description: str
    kind: str
    created_at: str
    updated_at: str
    status: str
    status_code: int
    resources: dict[str, list[str]]
    metadata: dict[str, Any]
    result: Any
    may_cancel: bool
    err: str
    error_code: int | None


class OperationWait(OperationInfo):
    timed_out: bool = Field(description="true when the operation had not ended when the "
                            "wait's limit passed (wait again); false once it has ended.")


class VmStateInfo(_Resp):
    """A VM's state, pid, partition, job and error (``GET /1.0/vms/V/state``)."""

    state: str
    pid: int | None
    partition: str
    job: JobInfo | None
    error: str | None


class Deleted(_Resp):
    """What a delete answers: the path of what is gone."""

    deleted: str


class ListenerInfo(_Resp):
    """One listener's connections (``fusuma.api.guard``): open now, its limits (the
    per-client one on TCP only) and how many it refused, by status."""

    open: int
    max: int
    max_per_client: int | None
    refused: dict[str, int]


class HostInfo(_Resp):
    """``GET /1.0``: the API, who is asking, and the host."""

    api_version: str
    api_extensions: list[str]
    api_status: str
    auth: str
    auth_user_name: str | None
    auth_role: str | None
    environment: dict[str, Any]
    counts: dict[str, int]
    connections: dict[str, ListenerInfo]


class ErrorInfo(_Resp):
    type: Literal["error"] = "error"
    error: str
    error_code: int


# -- what the OpenAPI document says of responses every route shares --------------------
# Every error is an ErrorInfo (FastAPI's own 422 never happens: a request that does not
# validate is a 400 with the field named), and a 202 carries the operation.
ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorInfo, "description": "The request is refused: bad input (400), "
            "no identity (401), a role below the route's (403), an unknown name (404), "
            "a conflict (409), a body too large (413) or too slow (408)."},
    "5XX": {"model": ErrorInfo, "description": "The host could not do it: a supervisor "
            "that does not answer (503), a host failure (500)."},
}
# The same for a route whose own answer is not JSON (/metrics, the event stream): its
# errors are still JSON, which FastAPI would otherwise list under the route's media type.
ERRORS_AS_JSON: dict[int | str, dict[str, Any]] = {
    code: {"description": entry["description"],
           "content": {"application/json": {"schema": {
               "$ref": "#/components/schemas/ErrorInfo"}}}}
    for code, entry in ERRORS.items()}
ACCEPTED: dict[int | str, dict[str, Any]] = {
    202: {"model": OperationInfo, "description": "Accepted: the operation doing the work "
          "(also at the Location header, /1.0/operations/ID)."},
}
