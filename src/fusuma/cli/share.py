"""`fusuma share ...`: memory shared between VMs (segments, KSM) and where it comes from
(the data: ``fusuma.views.share``)."""

from __future__ import annotations

from typing import Any

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table
from fusuma.memshare.ksm import KSM_RISK, ZERO_COPY_NOTE, Ksm
from fusuma.memshare.smaps import ModeAnalysis
from fusuma.views.share import analysis, host_ksm, report_data


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


@click.group()
def share() -> None:
    """Memory shared between VMs, and exactly where every shared MiB comes from.

    Two mechanisms: segments (read-only erofs files mapped into many VMs, run in place
    from one host copy) and KSM (the kernel merges identical private pages).
    `report` shows each VM's host memory and the saving of each; `analyze` shows how
    much of a process could be shared at all; `ksm` controls the host's KSM."""


def _report_text(rep: dict[str, Any]) -> str:
    rows = [[v["name"], str(v["pid"]), _mib(v["pss_mib"]), _mib(v["split_mib"]["private"]),
             _mib(v["split_mib"]["template"]), _mib(v["split_mib"]["segments"]),
             _mib(v["split_mib"]["ksm"]), _mib(v["pss_anon_mib"]), _mib(v["pss_file_mib"]),
             _mib(v["pss_shmem_mib"]), _mib(v["ksm_merged_mib"])] for v in rep["vms"]]
    lines = [table(rows, ["vm", "pid", "pss_mib", "private", "template", "segments", "ksm",
                          "anon", "file", "shmem", "ksm_merged_mib"]) if rows
             else "no running VMs"]
    lines += [f"skipped {s['vm']}: {s['reason']}" for s in rep["skipped"]]
    tot, sav, ksm = rep["totals"], rep["savings_mib"], rep["ksm"]
    lines += ["", f"total: {tot['vms']} VM(s), PSS {_mib(tot['pss_mib'])} MiB, "
                  f"RSS {_mib(tot['rss_mib'])} MiB",
              f"saved by segments: {_mib(sav['segments'])} MiB (segment pages resident "
              "in each VM, minus their PSS)"]
    lines += [f"  {n}: {s['vms']} VM(s), rss {_mib(s['rss_mib'])} MiB, pss "
              f"{_mib(s['pss_mib'])} MiB, saved {_mib(s['saved_mib'])} MiB"
              for n, s in rep["segments"].items()]
    lines.append(f"saved by templates: {_mib(sav['templates'])} MiB (template pages mapped "
                 "by each clone, minus their PSS)")
    lines.append(f"saved by shared bases: {_mib(sav['bases'])} MiB ((VMs - 1) × the base "
                 "image's bytes in the host's page cache)")
    for n, b in rep["bases"].items():
        if b["error"] is not None:
            lines.append(f"  {n}: {b['vms']} VM(s), not counted: {b['error']}")
            continue
        lines.append(f"  {n}: {b['vms']} VM(s), file {_mib(b['file_bytes'] / 2**20)} MiB, "
                     f"cached {_mib(b['resident_mib'])} MiB, saved {_mib(b['saved_mib'])} MiB")
    if ksm is None:
        lines.append("saved by KSM: - (KSM is not available on this host)")
    else:
        profit = ("" if sav["ksm_vm_profit"] is None
                  else f"; the VMs' KSM profit {_mib(sav['ksm_vm_profit'])} MiB")
        lines.append(f"saved by KSM: {_mib(sav['ksm'])} MiB host-wide (KSM {ksm['state']}, "
                     f"pages_sharing {ksm['pages_sharing']}){profit}")
        if ksm["run"] != 1 and ksm["pages_sharing"]:
            # ksmd drops the rmap items of exited processes only while it scans.
            lines.append("  (KSM is not running: its counters may still include pages of "
                         "processes that have exited; they are cleaned when it runs again)")
    return "\n".join(lines)


@share.command("report", short_help="Each VM's host memory and the savings by mechanism.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@pass_ctx
def report(c: Ctx, as_json: bool) -> None:
    """Host memory of each running VM's QEMU and the host's savings by mechanism.

    Per VM: PSS (shared pages split among the processes that map them) split by where
    its pages come from: private (its own), template (its part of its template's RAM
    file, for a clone: `fusuma template`), segments (its part of the segments it maps)
    and ksm (its part of the pages KSM merged); and by page kind: anon, file, shmem.
    Savings: segments and templates = their pages resident in each VM minus their PSS
    (what separate copies would cost beyond the shared one); KSM = pages_sharing * page
    size, host-wide, and the VMs' own KSM profit (saving minus KSM's metadata).

    Shared bases: for each imported image that running VMs boot from (each on a thin
    disk of its own over the one read-only base file), its size, how much of it is in
    the host's page cache (mincore, which reads nothing in) and the VMs whose QEMU holds
    it open; saved = (VMs - 1) x cached: what a full copy of the image per VM would
    cache beyond the one shared copy if each VM read the same blocks (an upper bound
    when they read different ones; page cache is reclaimable memory)."""
    data = report_data(c)
    if as_json:
        emit_json(data)
    else:
        click.echo(_report_text(data))


def _analysis_text(a: ModeAnalysis) -> str:
    total = a.total_rss_kib
    rows = [[mode, str(kib), f"{100 * kib / total:.1f}" if total else "-",
             "no" if mode[1] == "w" else "yes"] for mode, kib in a.by_mode.items()]
    return "\n".join([
        f"pid {a.pid} ({a.comm}): {total} KiB resident",
        table(rows, ["mode", "rss_kib", "pct", "shareable"]),
        f"shareable (resident in mappings that are not writable): "
        f"{100 * a.shareable_fraction:.1f}%"])


@share.command("analyze", short_help="Resident memory by mapping mode; shareable fraction.")
@click.argument("pid", type=int, required=False)
@click.option("--vm", "vm_name", help="Analyze this VM's QEMU process instead of PID.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"pid", "comm", "by_mode": {mode: rss_kib}, "total_rss_kib", '
                   '"shareable_fraction"} as JSON.')
@pass_ctx
def analyze_cmd(c: Ctx, pid: int | None, vm_name: str | None, as_json: bool) -> None:
    """A process's resident memory by mapping mode (r-xp, r--p, rw-p, ...) and the
    fraction that could be shared (resident in mappings that are not writable): the
    DCSS paper's Table 4, for PID or for the QEMU of VM."""
    result = analysis(c, pid, vm_name)
    if as_json:
        emit_json(result.as_json())
    else:
        click.echo(_analysis_text(result))


@share.group("ksm", help=f"""The host's Kernel Samepage Merging (off by default).

KSM merges identical private memory pages of VMs marked `mergeable` into one
copy-on-write page.

Risk: {KSM_RISK}

{ZERO_COPY_NOTE}""")
def ksm_group() -> None:
    pass


def _ksm_text(s: dict[str, Any]) -> str:
    zero = "" if s["ksm_zero_pages"] is None else f" + ksm_zero_pages {s['ksm_zero_pages']}"
    profit = ("" if s["general_profit_mib"] is None
              else f"; net of KSM's metadata {_mib(s['general_profit_mib'])} MiB")
    return "\n".join([
        f"KSM {s['state']} (run={s['run']}): scans {s['pages_to_scan']} pages every "
        f"{s['sleep_millisecs']} ms; {s['full_scans']} full scan(s) done",
        f"pages_shared {s['pages_shared']}, pages_sharing {s['pages_sharing']}, "
        f"pages_unshared {s['pages_unshared']}, pages_volatile {s['pages_volatile']}",
        f"saved {_mib(s['saved_mib'])} MiB: (pages_sharing {s['pages_sharing']}{zero}) × "
        f"{s['page_size'] // 1024} KiB pages{profit}"])


def _show(ksm: Ksm, as_json: bool, note: str = "") -> None:
    data = ksm.read_settings().as_json()
    if as_json:
        emit_json(data)
        return
    click.echo(_ksm_text(data))
    if note:
        click.echo(note)


@ksm_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the sysfs settings as JSON.")
def ksm_status(as_json: bool) -> None:
    """KSM's settings and counters, and the memory it saves now."""
    _show(host_ksm(), as_json)


@ksm_group.command("on", help=f"""Run the KSM scanner (run=1).

Only memory marked mergeable is scanned: VMs created with `mergeable = true`.

Risk: {KSM_RISK}""")
@click.option("--pages-to-scan", type=click.IntRange(min=1),
              help="Pages to scan per batch (kernel default 100; more settles faster "
                   "and costs more CPU).")
@click.option("--sleep-ms", type=click.IntRange(min=0),
              help="Milliseconds between batches (kernel default 20).")
@click.option("--json", "as_json", is_flag=True, help="Print the new settings as JSON.")
def ksm_on(pages_to_scan: int | None, sleep_ms: int | None, as_json: bool) -> None:
    ksm = host_ksm()
    ksm.set_run(1, pages_to_scan=pages_to_scan, sleep_millisecs=sleep_ms)
    click.echo(f"note: {KSM_RISK}", err=True)
    _show(ksm, as_json)


@ksm_group.command("off")
@click.option("--unmerge", is_flag=True,
              help="Also split every merged page back into private copies (run=2); this "
                   "needs the memory the merging saved.")
@click.option("--json", "as_json", is_flag=True, help="Print the new settings as JSON.")
def ksm_off(unmerge: bool, as_json: bool) -> None:
    """Stop the KSM scanner (run=0).

    Pages already merged stay merged (and keep saving memory) until they are written
    or until `fusuma share ksm off --unmerge` (run=2) splits them all."""
    ksm = host_ksm()
    ksm.set_run(2 if unmerge else 0)
    note = ("" if unmerge else "merged pages stay merged until written; "
            "`fusuma share ksm off --unmerge` splits them now")
    _show(ksm, as_json, note)


__all__ = ["share"]
