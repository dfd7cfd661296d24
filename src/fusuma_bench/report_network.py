"""Report of a `fusuma bench network` result file: DIR/report.md and DIR/network.png.

Made from the result file alone (`fusuma bench report network FILE DIR`): per path the
median throughput of a tap NIC and of the user-mode network, their ratio, the spread of
the runs, and per kind of move its ping loss and TCP stall (or why it has none).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from fusuma_bench.report import dash, figure, load_result, opt_float, table, write_report

LABELS = {"host_to_vm": "host -> VM", "vm_to_vm": "VM -> VM",
          "vm_to_nat": "VM -> server through NAT"}


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Result:
    meta: dict[str, Any]
    rows: list[Row]
    moves: list[dict[str, Any]]
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
    return Result(meta=dict(data["meta"]), rows=rows, moves=list(data["moves"]),
                  errors=errors)


def load(path: Path) -> Result:
    return load_result(path, "network", parse)


def render(result_file: Path, out_dir: Path) -> list[Path]:
    res = load(result_file)
    return write_report(out_dir, markdown(res, result_file),
                        {"network.png": partial(plot, res)})


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:g}"


def _spread(lo: float | None, hi: float | None) -> str:
    return "–" if lo is None or hi is None else f"{lo:g}–{hi:g}"


def markdown(res: Result, result_file: Path) -> str:
    m = res.meta
    lines = [
        "# fusuma bench network: a tap NIC against the user-mode network", "",
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
        "## Moves", "",
        "Ping loss (a 1 ms ping from the host) and the longest TCP stall of a stream to "
        "the guest while it moves, per kind of move:", "",
        *table(["kind of move", "status", "pings sent", "lost", "TCP stall, ms", "why"],
               [[str(mv["kind"]), str(mv["status"]), dash(mv["ping_sent"]),
                 dash(mv["ping_loss_packets"]), dash(mv["tcp_stall_ms"]),
                 str(mv.get("reason") or "")] for mv in res.moves]),
        ""]
    if res.errors:
        lines += ["## Failed runs", "", *(f"- {e}" for e in res.errors), ""]
    lines += ["![throughput](network.png)", ""]
    return "\n".join(lines)


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
