"""Report of a `fusuma bench density` result file: DIR/report.md and DIR/density.png.

Made from the result file alone, so it can be redrawn later with
`fusuma bench report density FILE DIR`. Targets are checked against the file's numbers;
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

TARGET_SEGMENT_PCT = 25.0      # the DCSS paper's own figure
TARGET_BEST_PCT = 75.0
TARGET_FIT_RATIO = 3.0
TARGET_CLONE_PRIVATE = 0.30
TARGET_CLONE_AGENT_MS = 300.0
# The paper's rows and the nearest fusuma mode: NSS shares the kernel's pages (here a
# template's clones share them, with the rest of the booted guest).
TABLE1_OURS = {"DASD": "none", "NSS (kernel shared)": "template",
               "DCSS (root fs shared)": "segment", "NSS+DCSS": "segment+ksm"}


def _parse(data: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(data["results"], list):
        raise TypeError("results must be a list")
    return data


def load(path: Path) -> dict[str, Any]:
    return load_result(path, "density", _parse)


def _row(data: dict[str, Any], mode: str) -> dict[str, Any] | None:
    return next((r for r in data["results"] if r["mode"] == mode and r["vms"]), None)


def targets(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) rows."""
    out: list[tuple[str, str, str]] = []
    rows = [r for r in data["results"] if r["vms"]]
    seg = _row(data, "segment")
    name = f"segment alone saves >= {TARGET_SEGMENT_PCT:g}% per added VM vs none"
    if seg is None or seg["saving_pct"] is None:
        out.append((name, "–", UNMEASURED))
    else:
        out.append((name, f"{seg['saving_pct']}%",
                    PASS if seg["saving_pct"] >= TARGET_SEGMENT_PCT else FAIL))
    saving = [r for r in rows if r["mode"] != "none" and r["saving_pct"] is not None]
    name = f"best mode saves >= {TARGET_BEST_PCT:g}% per added VM vs none"
    if not saving:
        out.append((name, "–", UNMEASURED))
    else:
        best = max(saving, key=lambda r: r["saving_pct"])
        out.append((name, f"{best['saving_pct']}% ({best['mode']})",
                    PASS if best["saving_pct"] >= TARGET_BEST_PCT else FAIL))
    none = _row(data, "none")
    others = [r for r in rows if r["mode"] != "none"]
    name = f"best mode fits >= {TARGET_FIT_RATIO:g}x the VMs of none in the budget"
    if none is None or not others:
        out.append((name, "–", UNMEASURED))
    else:
        best = max(others, key=lambda r: r["vms"])
        ratio = best["vms"] / none["vms"]
        capped = " (capped before the budget)" if best["stop"] == "cap" else ""
        out.append((name, f"{best['vms']} vs {none['vms']} = {ratio:.1f}x "
                    f"({best['mode']}){capped}",
                    PASS if ratio >= TARGET_FIT_RATIO else FAIL))
    clone = _row(data, "template") or _row(data, "template+ksm")
    name = f"clone private memory <= {TARGET_CLONE_PRIVATE:.0%} of a booted VM's"
    if (clone is None or none is None or not clone["private_mib_median"]
            or not none["private_mib_median"]):
        out.append((name, "–", UNMEASURED))
    else:
        frac = clone["private_mib_median"] / none["private_mib_median"]
        c, n = (clone.get("private_without_tcg_buffer_mib_median"),
                none.get("private_without_tcg_buffer_mib_median"))
        rest = f"; without the TCG buffer {c} / {n} MiB = {c / n:.0%}" if c and n else ""
        out.append((name, f"{clone['private_mib_median']} / {none['private_mib_median']} "
                    f"MiB = {frac:.0%} ({clone['mode']}){rest}",
                    PASS if frac <= TARGET_CLONE_PRIVATE else FAIL))
    name = (f"a clone is ready for the guest agent in <= {TARGET_CLONE_AGENT_MS:g} ms "
            "(median, from the start request)")
    agent: float | None = clone.get("clone_agent_ms_median") if clone else None
    if clone is None or agent is None:
        out.append((name, "–", UNMEASURED))
    else:
        out.append((name, f"{agent} ms, restored in {clone['clone_restore_ms_median']} "
                    f"ms ({clone['mode']})", PASS if agent <= TARGET_CLONE_AGENT_MS
                    else FAIL))
    return out


def render(result_file: Path, out_dir: Path) -> list[Path]:
    data = load(result_file)
    return write_report(out_dir, markdown(data, "density.png"),
                        {"density.png": lambda png: _plot(data, png)})


def markdown(data: dict[str, Any], png: str) -> str:
    m = data["meta"]
    lines = [
        "# Density on fusuma: Debian+apache2 VMs in a host memory budget",
        "",
        f"Revision {m['git_revision']}, {m['date']}, host {m['host']} ({m['host_cores']} "
        f"cores), {m['accel']}, partitions on QEMU {m['partition_qemu']} (system: "
        f"{m['qemu']}). Budget {m['budget_mib']} MiB{' (--quick)' if m['quick'] else ''}; "
        f"Debian guests of {m['memory_mib']} MiB (image {m['image']}), apache2 running, "
        f"at most {m['max_vms']} per mode; {m['requests']} requests per mode, "
        f"{m['http_concurrency']} at a time, round-robin over the mode's VMs. "
        f"Run took {m['duration_s']:.0f} s.",
        "",
        "Host memory in use is the VMs' QEMU processes' own memory (anonymous PSS, so "
        "pages KSM merged and a clone's copy-on-write copies count as they should, plus "
        "page-cache PSS: the segment's DAX pages once among its users) and every tmpfs "
        "file once: guest RAM files and a template's RAM by their allocated blocks. The "
        "host page cache of the segment or the image's read-only root disk beyond what "
        "is mapped (readahead, pages QEMU read once and copied into the guest) is the "
        "kernel's to drop and is shown beside the total, not in it. It is read after each "
        "VM answered HTTP and the memory settled (page reporting, KSM). The next VM is "
        "started while the last VM's cost fits once more; one that lands above the "
        "budget is removed again. `per added VM` is (host(N) - host(1)) / (N - 1); "
        "`saving` compares it with mode none. Under TCG each QEMU holds a translation "
        f"buffer of {dash(m.get('tcg_tb_mib'))} MiB that a KVM host does not: the "
        "column without it shows the rest.",
        "",
        "## Targets",
        "",
        *table(["target", "measured", "verdict"], [list(t) for t in targets(data)]),
        "",
        "## Per mode",
        "",
        "| mode | VMs in budget | stopped by | first VM MiB | per added VM MiB | saving | "
        "per added VM without TCG buffer | start to HTTP ms (median) | requests/s | "
        "private MiB per VM (median) | KSM saved MiB | host page cache MiB (not counted) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        lines.append(
            f"| {r['mode']} | {r['vms']} | {r['stop']} | {dash(r['first_vm_mib'])} | "
            f"{dash(r['per_vm_mib'])} | {dash(r['saving_pct'], '%')} | "
            f"{dash(r['per_vm_without_tcg_buffer_mib'])} | {dash(r['start_ms_median'])} | "
            f"{dash(r['requests_per_s'])} | {dash(r['private_mib_median'])} | "
            f"{dash(r['ksm_saved_mib'])} | "
            f"{dash(r['page_cache_mib'][-1] if r.get('page_cache_mib') else None)} |")
    notes = [r for r in data["results"] if r.get("note")]
    if notes:
        lines += ["", *[f"- **{r['mode']}**: {r['note']}" for r in notes]]
    lines += ["", f"![host memory vs VMs]({png})", "",
              "## Host memory by VM count", "",
              "Read after each step (two VMs at a step while the budget is far).", "",
              "| mode | VMs: host MiB |", "|---|---|"]
    for r in data["results"]:
        if r["vms"]:
            pts = ", ".join(f"{p['vms']}: {p['mib']}" for p in r["host_mib"])
            lines.append(f"| {r['mode']} | {pts} |")
    lines += _paper(data)
    return "\n".join(lines) + "\n"


def _paper(data: dict[str, Any]) -> list[str]:
    paper = data["paper"]
    ours = {r["mode"]: r for r in data["results"] if r["vms"]}

    def mine(mode: str | None) -> str:
        r = ours.get(mode or "")
        if r is None:
            return "–"
        if mode == "none":
            return f"{r['mode']}: {dash(r['per_vm_mib'])} MiB per added VM"
        return (f"{r['mode']}: {dash(r['per_vm_mib'])} MiB, saved "
                f"{dash(r['saving_pct'], '%')}")

    lines = ["", "## Beside the DCSS paper (z/VM 5.2/5.4, System z, WSS per Linux guest)",
             "", "Table 1, memory sharing efficiency of the Linux OS, per guest:", "",
             "| method | WSS MB | saved | nearest fusuma mode, this run |", "|---|---|---|---|"]
    for r in paper["table1"]:
        lines.append(f"| {r['method']} | {r['wss_mb']} | {dash(r['saved_pct'], '%')} | "
                     f"{mine(TABLE1_OURS.get(r['method']))} |")
    lines += ["", "Table 3, apache2 (memory apache2 took per guest):", "",
              "| method | apache2 MB | saved | fusuma, this run (whole guest with apache2) |",
              "|---|---|---|---|"]
    for r, mode in zip(paper["table3"], ("none", "segment"), strict=False):
        lines.append(f"| {r['method']} | {r['apache2_mb']} | {dash(r['saved_pct'], '%')} | "
                     f"{mine(mode)} |")
    lines += ["", "Peers: " + "; ".join(f"{p['system']} {p['saved_pct']}%"
                                        for p in paper.get("peers", [])) + "."]
    return lines


def _plot(data: dict[str, Any], png: Path) -> None:
    with figure(png, dpi=110, ncols=2, figsize=(12, 4.5)) as (fig, (ax, bx)):
        _draw(data, fig, ax, bx)


def draw_host_memory(ax: Any, rows: list[dict[str, Any]], budget_mib: float) -> None:
    """Host memory in use against the VMs running, a line per mode, and the budget."""
    for r in rows:
        ax.plot([p["vms"] for p in r["host_mib"]], [p["mib"] for p in r["host_mib"]],
                marker="o", label=r["mode"])
    ax.axhline(budget_mib, color="grey", linestyle="--", label="budget")
    ax.set_xlabel("VMs")
    ax.set_ylabel("host memory in use (MiB)")
    ax.set_title("host memory vs VM count")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _draw(data: dict[str, Any], fig: Any, ax: Any, bx: Any) -> None:
    rows = [r for r in data["results"] if r["vms"]]
    draw_host_memory(ax, rows, data["meta"]["budget_mib"])
    measured = [r for r in rows if r["per_vm_mib"] is not None]
    names = [r["mode"] for r in measured]
    full = [r["per_vm_mib"] for r in measured]
    rest = [r["per_vm_without_tcg_buffer_mib"] or 0 for r in measured]
    bx.bar(names, full, color="tab:blue", alpha=0.4, label="per added VM")
    bx.bar(names, rest, color="tab:blue", label="without the TCG buffer")
    for i, r in enumerate(measured):
        bx.text(i, r["per_vm_mib"], f"{r['vms']} VMs", ha="center", va="bottom", fontsize=8)
    bx.set_ylabel("MiB per added VM")
    bx.set_title("cost of each added VM")
    bx.tick_params(axis="x", labelrotation=20)
    bx.legend(fontsize=8)
    fig.suptitle(f"fusuma bench density: budget {data['meta']['budget_mib']} MiB")
