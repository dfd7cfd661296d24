"""The run of `fusuma bench density` (see fusuma_bench.density): the scratch partition,
segment and template, VMs started until the budget is reached, and the result file."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from fusuma import spawn
from fusuma.capacity import definition_overhead
from fusuma.errors import FusumaError, HostError, ResourceError, StateError
from fusuma.host.accel import probe_accel
from fusuma.images import find_image
from fusuma.memshare import footprint, reporting
from fusuma.memshare.ksm import Ksm, KsmSettings
from fusuma.memshare.segments import SegmentManager
from fusuma.partition.manager import PartitionManager
from fusuma.qemu.cmdline import tcg_tb_mib
from fusuma.spec import PartitionSpec
from fusuma.vm import VmManager
from fusuma_bench import httpload
from fusuma_bench.density import (
    CLI_TIMEOUT_S,
    CLONE_READY_TIMEOUT_S,
    HTTP_CONCURRENCY,
    KSM_LOAD_PAGES_TO_SCAN,
    KSM_PAGES_TO_SCAN,
    KSM_SETTLE_TIMEOUT_S,
    KSM_SLEEP_MS,
    MAX_FAILED_STARTS,
    PAPER,
    PARTITION,
    READY_TIMEOUT_S,
    ROOT_MOUNT,
    SEGMENT,
    SOURCE_VM,
    STEP_FAR,
    TEMPLATE,
    TEMPLATE_QEMU,
    VM_PREFIX,
    CliFailed,
    Config,
    ModeRun,
    Progress,
    below_one_vm,
    capacity,
    derive,
    next_step,
)
from fusuma_bench.report import meta
from fusuma_bench.steady import settle, settle_params


class Bench:
    """The density run. ``image_kind`` and :meth:`_ready` are what a guest is and when it
    is ready (Debian, answering HTTP); `bench memory` (fusuma_bench.memory_fit) runs the
    same modes with minimal guests, ready when their agent answers."""

    image_kind = "debian"
    bench_name = "density"

    def __init__(self, parts: PartitionManager, vms: VmManager, segs: SegmentManager,
                 cfg: Config, ksm: Ksm | None = None,
                 progress: Progress = lambda s: None) -> None:
        self.parts = parts
        self.vms = vms
        self.segs = segs
        self.cfg = cfg
        self.ksm = ksm or Ksm()
        self.say = progress
        self.paths = parts.paths
        self.env = {**os.environ, **self.paths.as_env()}
        self.ports: dict[str, int] = {}
        self.taken: set[int] = set()
        self.qemu: str | None = None
        self._index = 0               # VM names are never reused within a run
        self.skipped: dict[str, str] = {}

    # checks -------------------------------------------------------------------------
    def check_host(self) -> None:
        """Refuse, in one sentence, what would stop the run before anything is made."""
        cfg = self.cfg
        existing = [p.name for p in self.parts.db.partitions()]
        if existing:
            raise ResourceError(f"the {self.bench_name} benchmark needs every core of this "
                                f"host but "
                                f"partition(s) {', '.join(existing)} exist; remove them "
                                "first (`fusuma down`).")
        find_image(self.paths.cache, kind=self.image_kind)
        if any("ksm" in m for m in cfg.modes) and not self.ksm.available():
            raise HostError("KSM is not available on this host (/sys/kernel/mm/ksm is "
                            "missing): leave out the ksm modes with --modes.")
        from fusuma.qemu import versions

        has_10 = versions.resolve_unpacked(self.paths, TEMPLATE_QEMU) is not None
        if cfg.qemu == "auto":
            self.qemu = TEMPLATE_QEMU if has_10 else None
        elif cfg.qemu != "system":
            versions.resolve(self.paths, cfg.qemu)
            self.qemu = cfg.qemu
        for mode in cfg.modes:
            if not mode.startswith("template"):
                continue
            if self.qemu != TEMPLATE_QEMU:
                self.skipped[mode] = (f"not available: clones need QEMU {TEMPLATE_QEMU} "
                                      f"(`fusuma qemu install {TEMPLATE_QEMU}`, then "
                                      "--qemu auto)")
            elif (why := self._template_cli()) is not None:
                self.skipped[mode] = why

    def _template_cli(self) -> str | None:
        res = self._cli("template", "--help", check=False)
        if res.returncode != 0:
            return ("not available: this fusuma has no `fusuma template` command "
                    "(templates are not implemented in this revision)")
        return None

    # the run ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        accel = probe_accel("auto").name
        started_meta = meta(accel)
        started = time.monotonic()
        runs = self.run_modes()
        image = find_image(self.paths.cache, kind="debian")
        return {"meta": {**meta(accel), "git_revision": started_meta["git_revision"],
                         "date": started_meta["date"],
                         "duration_s": round(time.monotonic() - started, 1),
                         "benchmark": "density", "budget_mib": cfg.budget_mib,
                         "quick": cfg.quick, "modes": list(cfg.modes),
                         "memory_mib": cfg.memory_mib, "requests": cfg.requests,
                         "http_concurrency": HTTP_CONCURRENCY, "max_vms": cfg.max_vms,
                         "loop_deadline_s": cfg.loop_deadline_s, "step_far": STEP_FAR,
                         "ready_timeout_s": {"booted": READY_TIMEOUT_S,
                                             "clone": CLONE_READY_TIMEOUT_S},
                         "partition_qemu": self.qemu or "system",
                         "cores": list(self.parts.host.cpus),
                         "image": image.digest[:16], "root_mount": ROOT_MOUNT,
                         "tcg_tb_mib": tcg_tb_mib() if accel == "tcg" else None,
                         "settle": settle_params(),
                         "ksm_pages_to_scan": KSM_PAGES_TO_SCAN,
                         "ksm_load_pages_to_scan": KSM_LOAD_PAGES_TO_SCAN,
                         "ksm_sleep_ms": KSM_SLEEP_MS},
                "results": derive(runs), "paper": PAPER}

    def run_modes(self) -> list[ModeRun]:
        """Every mode in turn (a skipped one says why); the host's KSM settings put back
        and everything made removed afterwards, also on failure."""
        cfg = self.cfg
        # KSM is the host's: put back only what a ksm mode of this run changed, so a
        # run without one never writes settings someone else may have set meanwhile.
        saved = (self.ksm.read_settings()
                 if self.ksm.available() and any("ksm" in m for m in cfg.modes) else None)
        runs: list[ModeRun] = []
        try:
            if any("segment" in m for m in cfg.modes):
                self.say(f"making segment {SEGMENT} from the debian image's root")
                self.segs.create(SEGMENT, from_image="debian", progress=self.say)
            for mode in cfg.modes:
                if mode in self.skipped:
                    self.say(f"{mode}: skipped: {self.skipped[mode]}")
                    runs.append(ModeRun(mode, stop="skipped", note=self.skipped[mode]))
                    continue
                runs.append(self._mode(mode, first=not any(r.vms for r in runs)))
                if saved is not None and "ksm" in mode:
                    self._restore_ksm(saved)
        finally:
            self._cleanup()
            if saved is not None:
                self._restore_ksm(saved)
        return runs

    def _restore_ksm(self, saved: KsmSettings) -> None:
        with contextlib.suppress(FusumaError):
            self.ksm.set_run(saved.run, pages_to_scan=saved.pages_to_scan,
                             sleep_millisecs=saved.sleep_millisecs)

    def _mode(self, mode: str, first: bool) -> ModeRun:
        """One mode from an empty partition to its removal. A failure ends the mode (its
        note says why) and the run goes on; a budget below one VM ends the run when no
        mode before measured anything (nothing is written then)."""
        r = ModeRun(mode)
        try:
            self._fill(mode, r)
            if r.vms:
                self._finish(mode, r)
        except FusumaError as exc:
            r.stop, r.note = "failed", str(exc)
            self.say(f"{mode}: failed: {exc}")
        finally:
            with contextlib.suppress(FusumaError):
                if self.parts.db.find_partition(PARTITION) is not None:
                    self.parts.delete(PARTITION, force=True)
            if mode.startswith("template"):
                self._delete_template()
        if not r.vms and r.stop == "budget" and r.rejected_mib is not None:
            msg = below_one_vm(self.cfg.budget_mib, r.rejected_mib, mode,
                               self.cfg.memory_mib)
            if first:
                raise ResourceError(msg)
            r.stop, r.note = "below one VM", msg
            self.say(f"{mode}: {msg}")
        return r

    def _fill(self, mode: str, r: ModeRun) -> None:
        """Start VMs while the next one is expected to fit (see next_step); a step
        whose reading lands above the budget gives back its VMs, newest first, until
        the reading fits or the step is undone."""
        cfg = self.cfg
        for f in self._disk_files(mode):
            footprint.drop_cache(f)
        if "ksm" in mode:
            self.ksm.set_run(1, pages_to_scan=KSM_PAGES_TO_SCAN,
                             sleep_millisecs=KSM_SLEEP_MS)
        part_mib, cap = capacity(mode, self.parts.host.memory_available_for_partitions_mib,
                                 cfg.memory_mib, definition_overhead("auto"), cfg.max_vms)
        self.parts.create(PartitionSpec(name=PARTITION, cpus=list(self.parts.host.cpus),
                                        memory_mib=part_mib, qemu=self.qemu))
        if mode.startswith("template"):
            r.template_mib = self._make_template()
        r.first_event = self.parts.db.last_event_id()
        while True:
            count, why = next_step(r.points, cfg.budget_mib, cap)
            if not count:
                r.stop = why or "budget"
                if why == "cap" and cap < cfg.max_vms:
                    r.note = (f"stopped at {cap} VMs, the most this host admits in this "
                              "mode (fusuma admits each VM's whole RAM and QEMU overhead, "
                              "not what it uses), before the budget was reached")
                return
            before = r.vms
            for _ in range(count):
                if not self._add_vm(mode, r) and r.failed_starts >= MAX_FAILED_STARTS:
                    r.stop = "failed starts"
                    r.note = (f"{r.failed_starts} VMs did not answer HTTP after their "
                              "start (see the VMs' console logs)")
                    return
            if len(r.names) == before:
                continue
            host, waited, ok = self._settled(mode, r)
            while host > cfg.budget_mib:
                r.rejected_mib = host
                self.say(f"{mode}: with {len(r.names)} VMs the host uses {host} MiB, more "
                         f"than the budget of {cfg.budget_mib} MiB: removing the newest")
                self.vms.delete(r.names.pop(), force=True)
                if len(r.names) == before:
                    r.stop = "budget"
                    return
                host, waited, ok = self._settled(mode, r)
            self._point(mode, r, host, waited, ok)
            if r.rejected_mib is not None:
                r.stop = "budget"
                return

    def _point(self, mode: str, r: ModeRun, host: float, waited: float, ok: bool) -> None:
        fp = self._footprint(mode, cache=True)
        r.points.append((len(r.names), host))
        r.settle_s.append(waited)
        r.unsettled += 0 if ok else 1
        r.tcg_mib.append(round(sum(p.exec_anon_kib for p in fp.processes) / 1024, 1))
        r.page_cache_mib.append(round(sum(f.mib for f in fp.cached), 1))
        self.say(f"{mode}: {len(r.names)} VM(s): host {host} MiB (settled in {waited:.0f} "
                 "s)")

    def _finish(self, mode: str, r: ModeRun) -> None:
        """With every VM of the mode running: the request loop, then the last readings."""
        ports = [self.ports[name] for name in r.names]
        self.say(f"{mode}: {self.cfg.requests} requests over {r.vms} VM(s)")
        if "ksm" in mode:      # scanning as a host runs it, not at the settling rate
            self.ksm.set_run(1, pages_to_scan=KSM_LOAD_PAGES_TO_SCAN,
                             sleep_millisecs=KSM_SLEEP_MS)
        r.requests_per_s, r.requests, r.failed_requests = httpload.request_loop(
            ports, self.cfg.requests, HTTP_CONCURRENCY, self.cfg.loop_deadline_s)
        fp = self._footprint(mode, cache=True)
        r.host_after_requests_mib = fp.total_mib
        r.private_mib = [round(p.private_kib / 1024, 1) for p in fp.processes]
        r.private_no_tcg_mib = [round((p.private_kib - p.exec_anon_kib) / 1024, 1)
                                for p in fp.processes]
        r.files = fp.as_json()
        if "ksm" in mode:
            r.ksm_saved_mib = round(self.ksm.read_settings().saved_bytes / 2**20, 1)
        for ev in self.parts.db.events_since(r.first_event, limit=100_000):
            ctx = ev["context"]
            if ev["action"] == "vm-clone-ready" and not ctx.get("error"):
                if ctx.get("restore_ms") is not None:
                    r.clone_restore_ms.append(float(ctx["restore_ms"]))
                if ctx.get("agent_ms") is not None:
                    r.clone_agent_ms.append(float(ctx["agent_ms"]))
        recs = [self.parts.db.vm(name) for name in r.names]
        r.page_reporting = all(reporting.recorded(v) for v in recs)
        self.say(f"{mode}: {r.vms} VM(s) in {self.cfg.budget_mib} MiB ({r.stop}); "
                 f"{r.requests_per_s} requests/s, {r.failed_requests} failed")

    # pieces ----------------------------------------------------------------------------
    def _disk_files(self, mode: str) -> list[Path]:
        if "segment" in mode:
            return [self.paths.segment_file(SEGMENT)]
        root = find_image(self.paths.cache, kind=self.image_kind).root
        return [root] if root is not None else []

    def _footprint(self, mode: str, cache: bool = False) -> footprint.Footprint:
        """The mode's VMs now; with ``cache``, the page cache of the disk files they
        read too (reported beside the total)."""
        pids = [v.pid for v in self.parts.db.vms(PARTITION)
                if v.pid is not None and v.name != SOURCE_VM]
        return footprint.measure(pids, [self.paths.shm],
                                 self._disk_files(mode) if cache else ())

    def _settled(self, mode: str, r: ModeRun) -> tuple[float, float, bool]:
        """The host memory once it holds still (in the KSM modes: once KSM settled
        too); (MiB, seconds waited, whether it settled in time)."""
        ksm_ok = True
        started = time.monotonic()
        if "ksm" in mode:
            ksm_ok = self._ksm_settled(mode, r)
            host, _, ok = settle(lambda: self._footprint(mode).total_mib, min_s=0.0)
        else:
            host, _, ok = settle(lambda: self._footprint(mode).total_mib)
        return host, round(time.monotonic() - started, 1), ok and ksm_ok

    def _ksm_settled(self, mode: str, r: ModeRun) -> bool:
        """Wait for KSM to settle. KSM is the host's: another program (another
        benchmark) may stop it or slow it down meanwhile; then it is set again, counted
        in ``r.ksm_resets``, and the wait starts over (three times at most)."""
        for _ in range(3):
            s = self.ksm.read_settings()
            if (s.run, s.pages_to_scan, s.sleep_millisecs) != (1, KSM_PAGES_TO_SCAN,
                                                                KSM_SLEEP_MS):
                r.ksm_resets += 1
                self.say(f"{mode}: KSM was changed by another program (run={s.run}, "
                         f"pages_to_scan={s.pages_to_scan}); setting it again")
                self.ksm.set_run(1, pages_to_scan=KSM_PAGES_TO_SCAN,
                                 sleep_millisecs=KSM_SLEEP_MS)
            try:
                self.ksm.wait_settled(KSM_SETTLE_TIMEOUT_S)
                return True
            except StateError as exc:
                self.say(f"{mode}: {exc}")
        return False

    def _create_args(self, mode: str, name: str, port: int) -> list[str]:
        args = ["vm", "create", name, "-p", PARTITION, "--port", f"{port}:80"]
        if mode.startswith("template"):
            args += ["--template", TEMPLATE]
        else:
            args += ["--image", "debian", "--memory", str(self.cfg.memory_mib)]
        if "segment" in mode:
            args += ["--segment", f"{SEGMENT}:{ROOT_MOUNT}"]
        if "ksm" in mode:
            args += ["--mergeable"]
        return [*args, "--start", "--json"]

    def _add_vm(self, mode: str, r: ModeRun) -> bool:
        """Create and start the next VM with the CLI and wait for its HTTP answer;
        whether it answered (one that did not is removed and counted)."""
        name = vm_name(self._index)
        self._index += 1
        port = httpload.free_port(self.taken)
        self.ports[name] = port
        self.say(f"{mode}: starting VM {len(r.names) + 1} ({name})")
        t0 = time.monotonic()
        self._cli(*self._create_args(mode, name, port))
        cli_ms = round((time.monotonic() - t0) * 1000, 1)
        timeout = CLONE_READY_TIMEOUT_S if mode.startswith("template") else READY_TIMEOUT_S
        try:
            ready_ms = self._ready(name, port, t0, timeout)
        except httpload.NotReady as exc:
            r.failed_starts += 1
            self.say(f"{mode}: {name}: {exc} Removing it.")
            with contextlib.suppress(FusumaError):
                self.vms.delete(name, force=True)
            return False
        r.names.append(name)
        r.cli_ms.append(cli_ms)
        r.start_ms.append(ready_ms)
        return True

    def _ready(self, name: str, port: int, started: float, timeout: float) -> float:
        """Wait until VM ``name`` (started at ``started``, time.monotonic()) is ready: its
        guest answers HTTP on ``port``; ms since ``started``, or httpload.NotReady."""
        return httpload.wait_http(port, started, timeout)

    def _make_template(self) -> float | None:
        """Boot the template's source VM (root on the disk, apache2 answering), let it
        settle, make the template of it; what the shm dir holds afterwards (the
        template's RAM, if it is kept there), MiB."""
        port = httpload.free_port(self.taken)
        self.say(f"booting {SOURCE_VM} for template {TEMPLATE}")
        t0 = time.monotonic()
        self._cli("vm", "create", SOURCE_VM, "-p", PARTITION, "--image", self.image_kind,
                  "--memory", str(self.cfg.memory_mib), "--port", f"{port}:80", "--start")
        self._ready(SOURCE_VM, port, t0, READY_TIMEOUT_S)
        settle(lambda: self._footprint("none").total_mib)
        self.say(f"making template {TEMPLATE} from {SOURCE_VM}")
        self._cli("template", "create", TEMPLATE, "--from", SOURCE_VM, "--json")
        held = footprint.measure([], [self.paths.shm]).files_kib
        return round(held / 1024, 1) if held else None

    def _delete_template(self) -> None:
        res = self._cli("template", "delete", TEMPLATE, check=False)
        if res.returncode != 0 and "no template" not in (res.stderr + res.stdout).lower():
            self.say(f"cleanup of template {TEMPLATE}: "
                     f"{(res.stderr or res.stdout).strip()}")

    def _cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run_cli(self.env, *args, check=check)

    def _cleanup(self) -> None:
        if self.parts.db.find_partition(PARTITION) is not None:
            try:
                self.parts.delete(PARTITION, force=True)
            except FusumaError as exc:
                self.say(f"cleanup of partition {PARTITION} failed: {exc}")
        if self.parts.db.find_segment(SEGMENT) is not None:
            try:
                self.segs.delete(SEGMENT)
            except FusumaError as exc:
                self.say(f"cleanup of segment {SEGMENT} failed: {exc}")


def run_cli(env: dict[str, str], *args: str,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    """`fusuma ARGS` as a child process with ``env``; CliFailed (its last error line)
    when it exits non-zero and ``check``."""
    try:
        proc = subprocess.run(spawn.module_argv("fusuma.cli.main", *args),
                              env=spawn.child_env(env), cwd=spawn.CWD,
                              capture_output=True, text=True,
                              timeout=CLI_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise CliFailed(args, -1, f"no answer within {CLI_TIMEOUT_S:.0f} s") from None
    if check and proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if "PVM" not in ln]
        raise CliFailed(args, proc.returncode,
                        (lines[-1] if lines else proc.stdout.strip()).strip())
    return proc


def vm_name(i: int) -> str:
    return f"{VM_PREFIX}{i}"
