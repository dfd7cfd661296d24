"""Report of a `fusuma bench memory` result file: DIR/report.md, DIR/memory-fit.png and
DIR/memory-burst.png.

Made from the result file alone (`fusuma bench report memory FILE DIR`). A target the
file has no numbers for is NOT MEASURED, never PASS.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fusuma_bench.memory import targets
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
from fusuma_bench.report_density import draw_host_memory


def _parse(data: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(data["fit"], list):
        raise TypeError("fit must be a list")
    if data["burst"] is not None and not isinstance(data["burst"], dict):
        raise TypeError("burst must be an object or null")
    return data


def load(path: Path) -> dict[str, Any]:
    return load_result(path, "memory", _parse)


def render(result_file: Path, out_dir: Path) -> list[Path]:
    data = load(result_file)
    plots: dict[str, Callable[[Path], None]] = {}
    if any(m["overcommits"] for m in data["fit"]):
        plots["memory-fit.png"] = lambda png: _plot_fit(data, png)
    b = data["burst"]
    if b is not None and "failed" not in b:
        plots["memory-burst.png"] = lambda png: _plot_burst(data, png)
    return write_report(out_dir, markdown(data, list(plots)), plots)


def verdict(met: bool | None) -> str:
    return UNMEASURED if met is None else PASS if met else FAIL


def markdown(data: dict[str, Any], pngs: list[str]) -> str:
    m = data["meta"]
    lines = [
        "# Memory as a governed resource: overcommit, fit and a burst",
        "",
        f"Revision {m['git_revision']}, {m['date']}, host {m['host']} ({m['host_cores']} "
        f"cores), {m['accel']}, partitions on QEMU {m['partition_qemu']} (system: "
        f"{m['qemu']}); minimal image {m['image']}. Parts: {', '.join(m['parts'])}"
        f"{' (--quick)' if m['quick'] else ''}. Run took {m['duration_s']:.0f} s.",
        "",
        "## Targets",
        "",
        *table(["target", "measured", "verdict"],
               [[t, ms, f"**{verdict(ok)}**"] for t, ms, ok in targets(data)]),
    ]
    if data["fit"]:
        lines += _fit_md(data)
    lines += _burst_md(data)
    lines += ["", *(f"![{p}]({p})" for p in pngs)]
    return "\n".join(lines) + "\n"


def _fit_md(data: dict[str, Any]) -> list[str]:
    m = data["meta"]
    lines = [
        "", "## Fit: VMs in a budget of {} MiB".format(m["budget_mib"]), "",
        f"Burstable minimal guests of {m['memory_mib']} MiB with a floor of "
        f"{m['floor_mib']} MiB, at most {m['max_vms']} per mode; each VM's QEMU overhead "
        f"as fusuma admits it: {dash(m['overhead_mib'], ' MiB')} (of which "
        f"{dash(m['tcg_tb_mib'], ' MiB')} TCG translation buffer). fusuma sees a host of "
        "the budget's size (a defined, never started guaranteed VM holds the rest of its "
        f"{m['host_room_mib']} MiB); *admitted* is what `partition resize` and `vm "
        "create` accepted, *computed* what fusuma.capacity's arithmetic says, *running* "
        "the admitted VMs started whose settled host memory stayed within the budget. "
        f"Segment modes: {m['segment_modes']}.", "",
        *table(["mode", "overcommit", "admitted", "computed", "running in budget",
                "host MiB", "admission stopped by"],
               [[r["mode"], f"{o['overcommit']:g}", str(o["admitted_vms"]),
                 str(o["admitted_vms_computed"]), str(o["running_vms"]),
                 dash(o["host_mib"]), o["stop"] + (f": {o['refusal']}" if o["refusal"]
                                                   else "")]
                for r in data["fit"] for o in r["overcommits"]]),
        "", *table(["mode", "first VM MiB", "per added VM MiB", "start to agent ms "
                    "(median)", "note"],
                   [[r["mode"], dash(r["first_vm_mib"]), dash(r["per_vm_mib"]),
                     dash(_median(r["start_ms"])), r["note"] or r["stop"]]
                    for r in data["fit"]])]
    return lines


def _median(xs: list[float]) -> float | None:
    import statistics

    return round(statistics.median(xs), 1) if xs else None


def _burst_md(data: dict[str, Any]) -> list[str]:
    b = data["burst"]
    if b is None:
        return []
    if "failed" in b:
        return ["", "## Burst", "", f"FAILED: {b['failed']}"]
    ep = b["episode"]
    return [
        "", "## Burst", "",
        f"{b['burst_vms']} burstable guests of {b['ram_mib']} MiB (floor "
        f"{b['floor_mib']} MiB) at overcommit 2 on core {b['cores']['burstable']}, each "
        f"writing {b['burst_mib']} MiB into its tmpfs; a guaranteed guest of "
        f"{b['guaranteed_ram_mib']} MiB on core {b['cores']['guaranteed']}. The "
        f"governor's target: {b['target_free_mib']} MiB free "
        f"({b['free_before_mib']} free before the burst, less "
        f"{b.get('target_margin_mib', data['meta']['target_margin_mib'])} MiB). "
        "The guests freed what they wrote "
        f"{dash(b['released_after_s'], ' s')} after the burst began.", "",
        *table(["figure", "value"], [
            ["the burstable guests' RAM files grew by (host side)",
             dash(b.get("ram_files_grew_mib"), " MiB")],
            ["least free memory (MemAvailable) the bench saw during the burst",
             dash(b.get("host_free_seen_min_mib"), " MiB")],
            ["burst start to the governor's first short decision",
             dash(ep["burst_to_short_s"], " s")],
            ["shortage, first short decision to `recovered` (governor's short_s)",
             dash(ep["short_s"], " s")],
            ["release to `recovered`", dash(ep["release_to_recovered_s"], " s")],
            ["least free memory the governor saw while short",
             dash(ep["host_free_min_mib"], " MiB")],
            ["steps taken", ", ".join(f"{k} {v}" for k, v in ep["steps"].items()) or "–"],
            ["lowest balloon QEMU reported", dash(b["balloon_actual_min_mib"], " MiB")],
            ["guaranteed loop alone, median of {}".format(len(b["alone_s"])),
             dash(b["alone_s_median"], " s")],
            ["guaranteed loop during the burst, median of {}".format(len(b["during_s"])),
             dash(b["during_s_median"], " s")],
            ["guaranteed guest's speed during / alone", dash(b["speed_ratio"])],
            ["decisions about the guaranteed guest", str(b["guaranteed_decisions"])],
            ["host OOM kills / guest OOM kills", f"{dash(b['oom_kills'])} / "
             f"{b['guest_oom_kills']}"],
            ["guests alive (same QEMU pids)", str(b["guests_alive"]).lower()]])]


def _plot_fit(data: dict[str, Any], png: Path) -> None:
    rows = [r for r in data["fit"] if r["overcommits"]]
    with figure(png, dpi=110, ncols=2, figsize=(12, 4.5)) as (fig, (ax, bx)):
        labels, adm, run = [], [], []
        for r in rows:
            for o in r["overcommits"]:
                labels.append(f"{r['mode']}\n{o['overcommit']:g}x")
                adm.append(o["admitted_vms"])
                run.append(o["running_vms"])
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], adm, width=0.4, label="admitted")
        ax.bar([x + 0.2 for x in xs], run, width=0.4, label="running in budget")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("VMs")
        ax.set_title("VMs per mode and overcommit")
        ax.legend(fontsize=8)
        draw_host_memory(bx, rows, data["meta"]["budget_mib"])
        fig.suptitle(f"fusuma bench memory: budget {data['meta']['budget_mib']} MiB")


def _plot_burst(data: dict[str, Any], png: Path) -> None:
    b = data["burst"]
    ep = b["episode"]
    with figure(png, dpi=110, ncols=2, figsize=(12, 4.5)) as (fig, (ax, bx)):
        ax.boxplot([b["alone_s"], b["during_s"]])
        ax.set_xticks([1, 2], ["alone", "during the burst"])
        ax.set_ylabel("guaranteed guest's loop (s, guest clock)")
        ax.set_title(f"speed during / alone: {dash(b['speed_ratio'])}")
        t0 = ep["first_short_at"]
        for action, pts in _decision_points(b).items():
            bx.scatter([t for t, _ in pts], [f for _, f in pts], label=action, s=18)
        bx.axhline(b["target_free_mib"], color="grey", linestyle="--", label="target")
        if b["released_after_s"] is not None and t0 is not None:
            bx.axvline(b["released_after_s"] - ep["burst_to_short_s"], color="tab:red",
                       linestyle=":", label="released")
        bx.set_xlabel("s since the first short decision")
        bx.set_ylabel("host free memory the governor saw (MiB)")
        bx.set_title(f"shortage {dash(ep['short_s'], ' s')}")
        bx.legend(fontsize=7)
        fig.suptitle("fusuma bench memory: a burst")


def _decision_points(b: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    t0 = b["episode"]["first_short_at"]
    for d in b.get("decisions", []):
        free = d["numbers"].get("host_free_mib")
        if t0 is None or free is None:
            continue
        out.setdefault(d["action"], []).append((round(d["at"] - t0, 2), free))
    return out
