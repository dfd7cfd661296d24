"""QEMU's block layer as fusuma reads it (fusuma.qemu.block), without QEMU:
``query-block`` and ``query-jobs`` answers parsed, and refused when they do not have
the shape QEMU documents; jobs awaited against a fake QMP peer."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from fusuma.errors import QemuError
from fusuma.qemu import block

# What QEMU 7.2 answers for a VM with a thin disk (two bitmaps, one snapshot) and an
# empty CD-ROM drive.
QUERY_BLOCK: list[dict[str, Any]] = [
    {"device": "disk-fusuma-boot", "locked": False, "removable": False,
     "inserted": {"node-name": "#block123", "drv": "qcow2", "ro": False,
                  "image": {"filename": "/dev/fdset/1", "format": "qcow2",
                            "virtual-size": 3221225472, "actual-size": 200704,
                            "snapshots": [{"name": "d1", "vm-state-size": 0,
                                           "date-sec": 1764130000, "date-nsec": 5,
                                           "vm-clock-sec": 1, "vm-clock-nsec": 0,
                                           "id": "1"}]},
                  "dirty-bitmaps": [
                      {"name": "fusuma-a-1", "recording": True, "persistent": True,
                       "busy": False, "granularity": 65536, "count": 0},
                      {"name": "fusuma-b-1", "recording": True, "persistent": True,
                       "busy": False, "granularity": 65536, "count": 4096,
                       "inconsistent": True}]}},
    {"device": "cd0", "locked": False, "removable": True, "tray_open": False},
]


def test_a_query_block_answer_is_typed() -> None:
    drives = block.parse_block(QUERY_BLOCK)
    assert list(drives) == ["disk-fusuma-boot"]         # the empty drive left out
    d = drives["disk-fusuma-boot"]
    assert (d.node, d.format, d.virtual_size) == ("#block123", "qcow2", 3 * 2**30)
    assert d.has("d1") and not d.has("d2")
    assert d.snapshots[0].vm_state_size == 0 and d.snapshots[0].date == 1764130000
    assert d.bitmap("fusuma-a-1") == block.Bitmap("fusuma-a-1", True, False)
    b = d.bitmap("fusuma-b-1")
    assert b is not None and b.inconsistent and d.bitmap("nope") is None


def test_bitmaps_beside_the_medium_are_read_too() -> None:
    """QEMU before 4.2 lists a drive's bitmaps beside its medium."""
    old = copy.deepcopy(QUERY_BLOCK[:1])
    old[0]["dirty-bitmaps"] = old[0]["inserted"].pop("dirty-bitmaps")
    assert [m.name for m in block.parse_block(old)["disk-fusuma-boot"].bitmaps] == \
        ["fusuma-a-1", "fusuma-b-1"]


def _broken(path: tuple[Any, ...], value: Any) -> list[dict[str, Any]]:
    """QUERY_BLOCK with the item at ``path`` (keys and indexes) set to ``value``
    (:data:`DROP`: removed)."""
    reply = copy.deepcopy(QUERY_BLOCK)
    at: Any = reply
    for key in path[:-1]:
        at = at[key]
    if value is DROP:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return reply


DROP = object()
INS = (0, "inserted")


@pytest.mark.parametrize(("reply", "says"), [
    ({"device": "x"}, "not a list of drives"),
    (["disk"], "a drive is not an object"),
    (_broken((0, "device"), DROP), "a drive has no device string"),
    (_broken((0, "device"), 7), "a drive has no device string"),
    (_broken((*INS, "image"), DROP), "has a medium without an image"),
    (_broken(INS, "yes"), "has a medium without an image"),
    (_broken((*INS, "image", "virtual-size"), -1), "has no size"),
    (_broken((*INS, "image", "virtual-size"), True), "has no size"),
    (_broken((*INS, "image", "virtual-size"), "3G"), "has no size"),
    (_broken((*INS, "image", "format"), None), "has no format string"),
    (_broken((*INS, "node-name"), ["#b"]), "has no node-name string"),
    (_broken((*INS, "image", "snapshots"), "d1"), "snapshot table is not a list"),
    (_broken((*INS, "image", "snapshots", 0, "vm-state-size"), -5), "malformed fields"),
    (_broken((*INS, "dirty-bitmaps"), {"name": "a"}), "dirty-bitmaps is not a list"),
    (_broken((*INS, "dirty-bitmaps", 0), "a"), "dirty bitmap that is not an object"),
    (_broken((*INS, "dirty-bitmaps", 0, "name"), DROP), "has no name string"),
    (_broken((*INS, "dirty-bitmaps", 1, "inconsistent"), "yes"), "malformed fields"),
    (_broken((*INS, "dirty-bitmaps", 0, "count"), -1), "malformed fields"),
    (QUERY_BLOCK[:1] * 2, "is listed twice"),
    ([QUERY_BLOCK[1]] * (block.MAX_ITEMS + 1), "not a list of drives"),
])
def test_a_malformed_query_block_answer_is_one_sentence(reply: object, says: str) -> None:
    with pytest.raises(QemuError) as exc:
        block.parse_block(reply)
    msg = str(exc.value)
    assert msg.startswith("QEMU's answer to query-block is malformed: ") and says in msg
    assert "\n" not in msg and msg.endswith(".") and not msg.endswith("..")


JOB = {"id": "j", "type": "backup", "status": "running", "current-progress": 1,
       "total-progress": 4}


@pytest.mark.parametrize(("reply", "says"), [
    ("jobs", "not a list of jobs"),
    ([{**JOB, "id": 3}], "a job has no id"),
    ([{**JOB, "status": "exploded"}], "has no known status"),
    ([{k: v for k, v in JOB.items() if k != "type"}], "has no known status"),
    ([{**JOB, "current-progress": -1}], "malformed progress"),
    ([{**JOB, "total-progress": 1.5}], "malformed progress"),
    ([{**JOB, "error": {"desc": "x"}}], "error that is not a string"),
    ([JOB, JOB], "listed twice"),
])
def test_a_malformed_query_jobs_answer_is_one_sentence(reply: object, says: str) -> None:
    with pytest.raises(QemuError, match="QEMU's answer to query-jobs is malformed: ") \
            as exc:
        block.parse_jobs(reply)
    assert says in str(exc.value)


class FakeJobs:
    """A QMP peer with jobs that advance one step per ``query-jobs``."""

    def __init__(self, jobs: dict[str, dict[str, Any]], steps: int = 2) -> None:
        self.vm = "v"
        self.jobs = jobs
        self.steps = steps
        self.log: list[str] = []

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float = 30.0) -> Any:
        self.log.append(command)
        if command == "query-jobs":
            self.steps -= 1
            for j in self.jobs.values():
                j["current-progress"] = min(j["total-progress"],
                                            j["current-progress"] + 1)
                if self.steps <= 0:
                    j["status"] = "concluded"
            return [dict(j) for j in self.jobs.values()]
        if command == "job-dismiss":
            assert self.jobs[(arguments or {})["id"]]["status"] == "concluded"
            del self.jobs[(arguments or {})["id"]]
            return {}
        raise AssertionError(command)


def job(jid: str, **kw: Any) -> dict[str, Any]:
    return {"id": jid, "type": "backup", "status": "running", "current-progress": 0,
            "total-progress": 3, **kw}


def test_jobs_are_awaited_with_their_progress_and_dismissed() -> None:
    qmp = FakeJobs({"a": job("a"), "b": job("b")}, steps=3)
    seen: list[tuple[int, int]] = []
    asyncio.run(block.wait(qmp, ["a", "b"], 10, "the backup",  # type: ignore[arg-type]
                           progress=lambda d, t: seen.append((d, t))))
    assert seen == [(2, 6), (4, 6), (6, 6)] and qmp.jobs == {}
    assert qmp.log.count("job-dismiss") == 2


def test_a_failed_job_is_one_sentence_and_every_job_is_dismissed() -> None:
    words = "No space left on device\n" + "x" * 500
    qmp = FakeJobs({"a": job("a", error=words), "b": job("b")})
    with pytest.raises(block.JobFailed) as exc:
        asyncio.run(block.wait(qmp, ["a", "b"], 10, "the backup"))  # type: ignore[arg-type]
    msg = str(exc.value)
    assert msg.startswith("VM 'v': the backup failed: No space left on device x")
    assert "\n" not in msg and len(msg) < 400 and exc.value.job == "a"
    assert qmp.jobs == {}


def test_a_job_qemu_no_longer_lists_is_lost_unless_that_is_fine() -> None:
    qmp = FakeJobs({"a": job("a")})
    with pytest.raises(QemuError, match="QEMU lost the job of the backup \\(b\\)"):
        asyncio.run(block.wait(qmp, ["a", "b"], 10, "the backup"))  # type: ignore[arg-type]
    qmp = FakeJobs({})
    asyncio.run(block.wait(qmp, ["gone"], 10, "a snapshot job",  # type: ignore[arg-type]
                           missing_ok=True))
    assert qmp.log == ["query-jobs"]


def test_a_job_that_does_not_end_in_time_is_one_sentence() -> None:
    qmp = FakeJobs({"a": job("a")}, steps=10**6)
    with pytest.raises(QemuError, match="the backup did not end within 0 s"):
        asyncio.run(block.wait(qmp, ["a"], 0.2, "the backup"))  # type: ignore[arg-type]
