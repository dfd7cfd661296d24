"""Report of a `fusuma bench network` result file: DIR/report.md and DIR/network.png.

Made from the result file alone (`fusuma bench report network FILE DIR`): per path the
median throughput of a tap NIC and of the user-mode network, their ratio, the spread of
the runs; per kind of move the echoes lost, the longest outage, the TCP stream's longest
stall and the downtime (or why it has none); and a zero-copy move's downtime with and
without a NIC, side by side (DIR/network-moves.png).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from fusuma.frozen import frozen
from fusuma_bench.report import dash, figure, load_result, opt_float, table, write_report

LABELS = {"host_to_vm": "host -> VM", "vm_to_vm": "VM -> VM",
          "vm_to_nat": "VM -> server through NAT"}


@frozen
class Row:
    path: str
    tap: float | None
    tap_min: float | None
    tap_max: float | None
    user: float | None
    user_min: float | None
    user_max: float | None
    ratio: float | None
    runs: int


@frozen
class Result:
    meta: dict[str, Any]
    rows: list[Row]
    moves: dict[str, Any] | None     # None: run with --no-moves
    errors: list[str]


def parse(data: dict[str, Any]) -> Result:
    rows = [Row(path=str(r["path"]), tap=opt_float(r["tap_mbit_s_median"]),
                tap_min=opt_float(r["tap_mbit_s_min"]), tap_max=opt_float(r["tap_mbit_s_max"]),
                user=opt_float(r["user_mode_mbit_s_median"]),
                user_min=opt_float(r["user_mode_mbit_s_min"]),
                user_max=opt_float(r["user_mode_mbit_s_max"]),
                ratio=opt_float(r["tap_over_user_mode"]),
                runs=min(int(r["tap_runs"]), int(r["user_mode_runs"])))
            for r in data["summary"]]
    errors = [f"{s['path']} {s['kind']} run {s['run']}: {s['error']}"
              for s in data["samples"] if s.get("error")]
    moves = data["moves"]
    if moves is not None:
        moves = dict(moves)
        for k in moves["kinds"]:       # every row names its kind and its counts
            if not isinstance(k["kind"], str) or int(k["runs"]) < 0 or int(k["failed"]) < 0:
                raise ValueError(f"a move row is malformed: {k!r}")
        errors += [f"move {m['kind']} run {m['run']}: {m['error']}"
                   for m in moves["samples"] if m.get("error")]
        errors += [f"zero-copy {'with' if m['nic'] else 'without'} a NIC, run {m['run']}: "
                   f"{m['error']}" for m in moves["downtime_samples"] if m.get("error")]
    return Result(meta=dict(data["meta"]), rows=rows, moves=moves, errors=errors)


def load(path: Path) -> Result:
    return load_result(path, "network", parse)


def render(result_file: Path, out_dir: Path) -> list[Path]:
    res = load(result_file)
    plots = {"network.png": partial(plot, res)}
    if res.moves is not None:
        plots["network-moves.png"] = partial(plot_moves, res.moves)
    return write_report(out_dir, markdown(res, result_file), plots)


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:g}"


def _spread(lo: float | None, hi: float | None) -> str:
    return "–" if lo is None or hi is None else f"{lo:g}–{hi:g}"


def markdown(res: Result, result_file: Path) -> str:
    m = res.meta
    lines = [
        "# fusuma bench network: a tap NIC against the user-mode network, and what "
        "moves cost it", "",
        f"From `{result_file.name}`: git {m['git_revision']}, {m['date']}, host "
        f"{m['host']} ({m['host_cpu']}, {m['host_cores']} cores), accelerator "
        f"**{m['accel']}**, {m['qemu']}, {m['iperf3']}.", "",
        f"Each figure is the median of {m['runs']} iperf3 TCP runs of "
        f"{m['seconds_per_run']} s (one stream), tap and user-mode interleaved in one "
        f"run of the benchmark; guests: the {m['guest_image']} image, "
        f"{m['guest_memory_mib']} MiB, {m['vcpus']} vCPU. Under TCG the absolute numbers "
        "are low (the guest's CPU is emulated); the ratio is what a tap buys.", "",
        *table(["path", "tap, Mbit/s", "runs' range", "user-mode, Mbit/s", "runs' range",
                "tap / user-mode"],
               [[LABELS.get(r.path, r.path), _num(r.tap), _spread(r.tap_min, r.tap_max),
                 _num(r.user), _spread(r.user_min, r.user_max),
                 "–" if r.ratio is None else f"**{r.ratio:g}x**"] for r in res.rows]),
        "",
        "- host -> VM: from fusuma's network namespace to the tap VM's address on the "
        "bridge; to the user-mode VM through its port forward on 127.0.0.1.",
        "- VM -> VM: across the bridge; two user-mode VMs reach each other only out of "
        "one slirp and into the other's port forward.",
        "- VM -> NAT: to a server in another namespace, through the network's nftables "
        "masquerade; out of slirp (QEMU's own sockets).", "",
        *moves_markdown(res.moves, m)]
    if res.errors:
        lines += ["## Failed runs", "", *(f"- {e}" for e in res.errors), ""]
    lines += ["![throughput](network.png)", ""]
    if res.moves is not None:
        lines += ["![moves](network-moves.png)", ""]
    return "\n".join(lines)


def _lost(k: dict[str, Any]) -> str:
    if k.get("echoes_lost_median") is None:
        return "–"
    return f"{k['echoes_lost_median']:g} of {k['echoes_sent_median']:g}"


def _whole(k: dict[str, Any]) -> str:
    if not k["runs"] and not k["failed"]:
        return "–"
    return "yes" if k.get("stream_whole") else "**no**"


def moves_markdown(moves: dict[str, Any] | None, m: dict[str, Any]) -> list[str]:
    """The moves' two tables, or why there are none."""
    lines = ["## Moves", ""]
    if moves is None:
        return [*lines, "Not measured in this run (`--no-moves`).", ""]
    d = moves["nic_downtime"]
    if moves.get("error"):
        lines += [f"**The moves part stopped early**: {moves['error']}", ""]
    lines += [
        f"A guest of the default image ({m.get('move_guest_memory_mib')} MiB, one vCPU) "
        "with a tap NIC on the managed network moves while a TCP stream (a line every "
        "5 ms, echoed by the guest) and an ICMP echo every millisecond run from "
        "fusuma's namespace to it. Each figure is the median of a kind's runs "
        f"({m.get('move_runs')} asked; the kinds interleaved): echoes lost of those "
        "sent, the longest outage (echoes lost in a row, 1 ms each), the stream's "
        "longest stall (its slowest line's round trip), fusuma's downtime (the "
        "source's STOP to the destination's RESUME) and QEMU's own (`query-migrate`), "
        "both summed over the moves of a run (`maintain --via` moves the guest out "
        "and back: two). \"stream whole\": every run kept the connection with every "
        "line back once and in order.", "",
        *table(["kind of move", "QEMU", "runs", "echoes lost", "longest outage, ms",
                "TCP stall, ms", "downtime, ms", "QEMU's downtime, ms", "stream whole"],
               [[str(k["kind"]) + (f" ({k['moves_per_run']} moves)"
                                   if (k.get("moves_per_run") or 1) > 1 else ""),
                 dash(k.get("qemu")),
                 str(k["runs"]) + (f" ({k['failed']} failed)" if k["failed"] else ""),
                 _lost(k),
                 *(_num(opt_float(k.get(f"{key}_ms_median")))
                   for key in ("outage", "tcp_stall", "downtime", "qemu_downtime")),
                 _whole(k)]
                for k in moves["kinds"] if not k.get("skipped")]),
        ""]
    skipped = [k for k in moves["kinds"] if k.get("skipped")]
    if skipped:
        lines += ["Not run here: " + "; ".join(f"{k['kind']} ({k['skipped']})"
                                                for k in skipped) + ".", ""]
    diff = d.get("nic_minus_no_nic_ms")
    overlap = d.get("ranges_overlap")
    lines += [
        "### A NIC and the downtime", "",
        f"The same guest with a tap NIC and without any NIC, moved by {d['mode']} in "
        f"turn (QEMU {d.get('qemu') or 'unknown'}; nothing else ran meanwhile):", "",
        *table(["guest", "moves", "downtime median, ms", "range, ms",
                "QEMU's downtime median, ms"],
               [[label, str(d[f"{key}_moves"]), _num(opt_float(d[f"{key}_downtime_ms_median"])),
                 _spread(d[f"{key}_downtime_ms_min"], d[f"{key}_downtime_ms_max"]),
                 _num(opt_float(d[f"{key}_qemu_downtime_ms_median"]))]
                for label, key in (("tap NIC", "with_nic"), ("no NIC", "without_nic"))]),
        "",
        "Median with a NIC minus without: " + ("–" if diff is None else f"{diff:g} ms")
        + ("" if overlap is None else
           ("; the two ranges overlap." if overlap else "; the two ranges do not overlap."))
        , "", *_steps(d)]
    return lines


# What each step of a move's downtime is (fusuma.migration.DOWNTIME_STEPS).
STEP_TEXT = {"source_saved": "source QEMU: STOP to its stream's end (device state sent)",
             "dest_loaded": "destination QEMU: to the device state loaded",
             "event": "destination supervisor: to seeing it (QMP event)",
             "decision": "the decision recorded", "taps": "the taps' handover",
             "cont": "`cont` to the guest running (RESUME)"}


def _steps(d: dict[str, Any]) -> list[str]:
    """Where the downtime went, per step, each side's median (older files: nothing)."""
    yes, no = d.get("with_nic_steps_ms_median"), d.get("without_nic_steps_ms_median")
    if not yes and not no:
        return []
    yes, no = yes or {}, no or {}
    names = list(dict.fromkeys([*yes, *no]))

    def diff(k: str) -> str:
        a, b = opt_float(yes.get(k)), opt_float(no.get(k))
        return "–" if a is None or b is None else f"{a - b:+.2f}"

    return ["Where the downtime went: each step's median, from the end of the one "
            "before (the medians need not add up to the downtime's).", "",
            *table(["step", "tap NIC, ms", "no NIC, ms", "difference, ms"],
                   [[STEP_TEXT.get(k, k), _num(opt_float(yes.get(k))),
                     _num(opt_float(no.get(k))), diff(k)] for k in names]), ""]


def plot_moves(moves: dict[str, Any], png: Path) -> None:
    """Left: per kind of move its outage, TCP stall and downtime (log scale: a paused
    copy is two orders above the rest). Right: each zero-copy downtime with and without
    a NIC, and their medians."""
    kinds = [k for k in moves["kinds"] if not k.get("skipped") and k["runs"]]
    with figure(png, figsize=(10, 4), ncols=2,
                gridspec_kw={"width_ratios": [2, 1]}) as (_, (left, right)):
        width = 0.27
        series = (("outage_ms_median", "longest outage (echo)"),
                  ("tcp_stall_ms_median", "TCP stall"),
                  ("downtime_ms_median", "downtime"))
        for i, (key, label) in enumerate(series):
            left.bar([x + (i - 1) * width for x in range(len(kinds))],
                     [k.get(key) or 0.0 for k in kinds], width, label=label)
        left.set_xticks(list(range(len(kinds))), [str(k["kind"]) for k in kinds],
                        fontsize=8)
        left.set_yscale("log")
        tallest = max((k.get(key) or 0.0 for k in kinds for key, _ in series), default=0.0)
        if tallest > 0:
            left.set_ylim(top=tallest * 6)      # room for the legend above the bars
        left.set_ylabel("ms (median)")
        left.set_title("each kind of move, tap NIC")
        left.legend(fontsize=8, ncol=3, loc="upper center")
        samples = moves["downtime_samples"]
        top = 0.0
        for x, nic in enumerate((True, False)):
            ys = [s["downtime_ms"] for s in samples
                  if s["nic"] is nic and s.get("downtime_ms") is not None
                  and not s.get("error")]
            right.scatter([x] * len(ys), ys, alpha=0.7)
            top = max([top, *ys])
            key = "with_nic" if nic else "without_nic"
            med = moves["nic_downtime"][f"{key}_downtime_ms_median"]
            if med is not None:
                right.hlines(med, x - 0.25, x + 0.25)
        right.set_xticks([0, 1], ["tap NIC", "no NIC"])
        right.set_xlim(-0.6, 1.6)
        right.set_ylim(0, top * 1.15 or 1.0)
        right.set_ylabel("downtime, ms")
        right.set_title("zero-copy: each move, median")


def plot(res: Result, png: Path) -> None:
    with figure(png, figsize=(7, 4)) as (_, ax):
        xs = range(len(res.rows))
        width = 0.38
        taps = [r.tap or 0.0 for r in res.rows]
        users = [r.user or 0.0 for r in res.rows]
        ax.bar([x - width / 2 for x in xs], taps, width, label="tap (managed network)")
        ax.bar([x + width / 2 for x in xs], users, width, label="user-mode (slirp)")
        for x, r in zip(xs, res.rows, strict=True):
            if r.ratio is not None:
                ax.annotate(f"{r.ratio:g}x", (x, max(r.tap or 0, r.user or 0)),
                            ha="center", va="bottom", fontsize=9)
        ax.set_xticks(list(xs), [LABELS.get(r.path, r.path) for r in res.rows])
        ax.set_ylabel("Mbit/s (median)")
        ax.set_title(f"iperf3 TCP throughput, {res.meta['accel']}")
        ax.legend()
