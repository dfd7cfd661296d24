"""Report of a `fusuma bench dcss` result file: DIR/report.md and DIR/dcss.png.

Made from the result file alone, so it can be redrawn later with
`fusuma bench report dcss FILE DIR`. Targets are checked against the file's numbers;
a target without numbers is NOT MEASURED, never PASS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fusuma_bench.report import (
    FAIL,
    PASS,
    UNMEASURED,
    dash,
    figure,
    load_result,
    table,
    write_report,
)

TARGET_IDLE_PCT = 40.0
TARGET_APACHE_PCT = 50.0
TARGET_RPS_PCT = 5.0
ZERO_COPY_MODES = ("none", "segment")


def _parse(data: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(data["results"], list) or not isinstance(data["summary"], list):
        raise TypeError("results and summary must be lists")
    return data


def load(path: Path) -> dict[str, Any]:
    return load_result(path, "dcss", _parse, unnamed_ok=True)


def _best(summary: list[dict[str, Any]], load: str, modes: tuple[str, ...] | None = None,
          metric: str = "saving_pss_pct") -> dict[str, Any] | None:
    rows = [r for r in summary if r["load"] == load and r["mode"] != "none"
            and r.get(metric) is not None and (modes is None or r["mode"] in modes)]
    return max(rows, key=lambda r: r[metric]) if rows else None


def targets(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) rows."""
    out: list[tuple[str, str, str]] = []
    summ = data["summary"]
    for load, target in (("idle", TARGET_IDLE_PCT), ("apache2", TARGET_APACHE_PCT)):
        best = _best(summ, load)
        if best is None:
            out.append((f"saving per added VM, {load}, best mode >= {target:g}%", "–",
                        UNMEASURED))
        else:
            out.append((f"saving per added VM, {load}, best mode >= {target:g}%",
                        f"{best['saving_pss_pct']}% ({best['mode']})",
                        PASS if best["saving_pss_pct"] >= target else FAIL))
        seg = _best(summ, load, ("segment",))
        out.append((f"  zero-copy-compatible mode (segment), {load}", "–" if seg is None
                    else f"{seg['saving_pss_pct']}%", "reported"))
    rows = [r for r in summ if r["load"] == "apache2" and r["mode"] != "none"]
    if not rows or any(r.get("requests_vs_none_pct") is None for r in rows):
        out.append((f"apache2 requests/s within {TARGET_RPS_PCT:g}% of none", "–",
                    UNMEASURED))
    else:
        worst = min(rows, key=lambda r: r["requests_vs_none_pct"])
        out.append((f"apache2 requests/s within {TARGET_RPS_PCT:g}% of none",
                    f"worst {worst['requests_vs_none_pct']}% ({worst['mode']})",
                    PASS if worst["requests_vs_none_pct"] >= -TARGET_RPS_PCT else FAIL))
    return out


def render(result_file: Path, out_dir: Path) -> list[Path]:
    data = load(result_file)
    return write_report(out_dir, _markdown(data, "dcss.png"),
                        {"dcss.png": lambda png: _plot(data, png)})


def _markdown(data: dict[str, Any], png: str) -> str:
    m = data["meta"]
    paper = data["paper"]
    lines = [
        "# DCSS on fusuma: shared segments and KSM",
        "",
        f"Revision {m['git_revision']}, {m['date']}, host {m['host']} ({m['host_cores']} "
        f"cores), {m['accel']}, {m['qemu']}. Debian guests of {m['memory_mib']} MiB "
        f"(image {m['image']}), VM counts {m['counts']}, apache2 load: "
        f"ab with {m['requests']} requests, concurrency {m['ab_concurrency']}, "
        f"{m.get('ab_runs', 1)} run(s) per VM (its median), median over the VMs.",
        "",
        "Memory is the PSS of the VMs' QEMU processes (a shared page is split among the "
        "processes that map it, so a segment's single copy is counted once). `guest` is "
        "the part of it that is the guest's own memory (RAM and segment mappings), the "
        "closest thing to the paper's WSS; the rest is QEMU itself (under TCG mostly its "
        "translation cache).",
        "",
        "## Targets",
        "",
        *table(["target", "measured", "verdict"], [list(t) for t in targets(data)]),
        "",
        "## Cost of each added VM (least-squares slope over the VM counts)",
        "",
        "| load | mode | MiB per VM (PSS) | saving | guest MiB per VM | saving (guest) | "
        "requests/s | vs none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["summary"]:
        lines.append(f"| {r['load']} | {r['mode']} | {dash(r['slope_pss_mib'])} | "
                     f"{dash(r['saving_pss_pct'], '%')} | {dash(r['slope_guest_mib'])} | "
                     f"{dash(r['saving_guest_pct'], '%')} | {dash(r['requests_per_s'])} | "
                     f"{dash(r['requests_vs_none_pct'], '%')} |")
    lines += ["", "## Every point", "",
              "| load | mode | VMs | total PSS MiB | per VM MiB | saving | guest MiB | "
              "segment PSS MiB | KSM saved MiB | requests/s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        lines.append(f"| {r['load']} | {r['mode']} | {r['vms']} | {r['total_pss_mib']} | "
                     f"{r['per_vm_mib']} | {dash(r['saving_pct'], '%')} | {r['guest_mib']} | "
                     f"{r['segments_pss_mib']} | {dash(r['ksm_saved_mib'])} | "
                     f"{dash(r['requests_per_s'])} |")
    lines += ["", f"![total memory vs VMs]({png})", "",
              "## Beside the paper (z/VM 5.2/5.4, System z, WSS per Linux guest)", "",
              "Table 1, per Linux guest:", "",
              "| method | WSS MB | saved |", "|---|---|---|"]
    for r in paper["table1"]:
        lines.append(f"| {r['method']} | {r['wss_mb']} | {dash(r['saved_pct'], '%')} |")
    lines += ["", "Table 3, apache2:", "", "| method | apache2 MB | saved |", "|---|---|---|"]
    for r in paper["table3"]:
        lines.append(f"| {r['method']} | {r['apache2_mb']} | {dash(r['saved_pct'], '%')} |")
    lines += ["", "Fig. 3, memory per added VM:", "",
              "| application | without DCSS MB | with DCSS MB | saved |", "|---|---|---|---|"]
    for r in paper["fig3"]:
        lines.append(f"| {r['app']} | {r['per_vm_mb_plain']} | {r['per_vm_mb_dcss']} | "
                     f"{r['saved_pct']}% |")
    ours = {(r["mode"], r["load"]): r for r in data["summary"]}
    lines += ["", "fusuma's counterpart of those rows (saving per added VM vs mode none):",
              ""]
    for load in ("idle", "apache2"):
        for mode in ("segment", "ksm", "segment+ksm"):
            r = ours.get((mode, load))
            if r:
                lines.append(f"- {load}, {mode}: {dash(r['saving_pss_pct'], '%')} of the "
                             f"VM's host memory, {dash(r['saving_guest_pct'], '%')} of its "
                             "guest memory")
    return "\n".join(lines) + "\n"


def _plot(data: dict[str, Any], png: Path) -> None:
    loads = list(dict.fromkeys(r["load"] for r in data["results"]))
    with figure(png, dpi=110, ncols=max(1, len(loads)),
                figsize=(5.5 * max(1, len(loads)), 4), squeeze=False) as (fig, axes):
        _draw(data, fig, axes, loads)


def _draw(data: dict[str, Any], fig: Any, axes: Any, loads: list[str]) -> None:
    for ax, load in zip(axes[0], loads, strict=False):
        for mode in dict.fromkeys(r["mode"] for r in data["results"]):
            pts = sorted((r["vms"], r["total_pss_mib"]) for r in data["results"]
                         if r["mode"] == mode and r["load"] == load)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_title(f"{load}")
        ax.set_xlabel("VMs")
        ax.set_ylabel("total PSS of the VMs (MiB)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("fusuma bench dcss: host memory vs number of Debian VMs")
