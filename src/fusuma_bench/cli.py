"""`fusuma bench ...`: benchmarks that write result files, and reports made from them.

fusuma finds this group through the `fusuma.commands` entry point (pyproject.toml): the
runtime never imports the benchmarks. Each command imports its benchmark (and, for
reports, matplotlib) when it runs, so that `fusuma bench --help` stays fast."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, progress
from fusuma_bench.report import REPORTS, render_report

FC = TypeVar("FC", bound=Callable[..., Any])


def publish(data: dict[str, Any], json_file: Path | None, report_dir: Path | None,
            name: str, summary: Callable[[dict[str, Any]], Iterable[str]],
            inline: bool = False) -> None:
    """What every benchmark command does with its result: print it (no --json, no
    --report), or write the result file (DIR/NAME.json with only --report), print the
    summary lines and where the file went (on the summary's last line with
    ``inline``), then with --report render report NAME into DIR."""
    from fusuma_bench.report import write_result

    if json_file is None and report_dir is not None:
        json_file = report_dir / f"{name}.json"
    if json_file is None:
        emit_json(data)
        return
    write_result(json_file, data)
    lines = list(summary(data))
    if inline:
        lines[-1] += f"; written to {json_file}"
    else:
        lines.append(f"written to {json_file}")
    for line in lines:
        click.echo(line)
    if report_dir is not None:
        paths = render_report(name, json_file, report_dir)
        click.echo(f"report: {', '.join(str(p) for p in paths)}")


@click.group()
def bench() -> None:
    """Run benchmarks; each writes a JSON result file with a `meta` block
    (git revision, date, host, accelerator) and metric names that carry units."""


def _json_option(report: str | None = None) -> Callable[[FC], FC]:
    """--json FILE; with a REPORT, its default under --report DIR is DIR/REPORT.json."""
    default = "print it" if report is None else f"print it, or DIR/{report}.json with --report"
    return click.option("--json", "json_file", type=click.Path(path_type=Path), default=None,
                        help=f"Write the result file here (default: {default}).")


def _report_option(plots: str, from_file: bool = True) -> Callable[[FC], FC]:
    """--report DIR: render report.md and PLOTS there after the run."""
    return click.option("--report", "report_dir", type=click.Path(path_type=Path), default=None,
                        help=f"After the run, render DIR/report.md and DIR/{plots}"
                             + (" from the result file." if from_file else "."))


@bench.command("boot")
@click.option("--vms", "n", type=click.IntRange(1, 64), default=1, show_default=True,
              help="VMs started together.")
@click.option("--runs", type=click.IntRange(1, 50), default=3, show_default=True,
              help="Repetitions; the summary is the median over all VMs and runs.")
@click.option("--memory", "memory_mib", type=click.IntRange(64, 65536), default=256,
              show_default=True, help="Guest RAM of each VM, MiB.")
@_json_option()
@pass_ctx
def boot_cmd(c: Ctx, n: int, runs: int, memory_mib: int, json_file: Path | None) -> None:
    """Time from `vm start` to the guest agent answering, N VMs started together.

    Uses a scratch partition on the cores no partition holds, removed afterwards."""
    from fusuma_bench import boot

    c.accel_notice("auto")
    data = boot.run(c.parts, c.vms, n, runs=runs, memory_mib=memory_mib, progress=progress)

    def summary(data: dict[str, Any]) -> list[str]:
        s = data["summary"]
        return [f"boot to guest agent, {n} VM(s) x {runs} run(s): median "
                f"{s['median_boot_ms']} ms (min {s['min_boot_ms']}, max {s['max_boot_ms']})"]

    publish(data, json_file, None, "boot", summary, inline=True)


@bench.command("cli")
@click.option("--runs", type=click.IntRange(1, 100), default=10, show_default=True,
              help="Timed runs of each command; the summary is their median.")
@click.option("--vms", "n", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Also time `ps --json` with this many VMs running (in up to two "
                   "scratch partitions on the free cores, removed afterwards).")
@click.option("--memory", "memory_mib", type=click.IntRange(64, 4096), default=256,
              show_default=True, help="Guest RAM of each VM for --vms, MiB.")
@click.option("--revision", default=None, metavar="REV",
              help="Time the fusuma of git revision REV of this checkout (its src/, "
                   "extracted to a scratch dir) instead of this one, e.g. to compare "
                   "with an older revision.")
@_json_option()
@pass_ctx
def cli_cmd(c: Ctx, runs: int, n: int, memory_mib: int, revision: str | None,
            json_file: Path | None) -> None:
    """Wall time of whole `fusuma` processes: the CLI's start-up.

    \b
    Times, each the median of --runs whole processes (after one uncounted warm-up):
      ps_json_empty_ms, vm_list_json_empty_ms, help_ms, migrate_help_ms
                          in an empty namespace (scratch FUSUMA_HOME etc.)
      migrate_startup_ms  a `fusuma migrate` refused before its first supervisor call
                          (unknown VM): everything a move pays besides the move itself
                          (and migrate_startup_over_click_ms: minus python_click_ms)
      ps_json_NVMS_ms     with --vms N, afterwards: `ps --json` with N VMs running
                          (and python_click_NVMS_ms, the floor while they run)
      python_bare_ms, python_click_ms
                          the interpreter alone and with click: the floor
    The commands run round-robin; Python's bytecode cache is on (in a scratch dir).
    See fusuma_bench/clitime.py for exactly what each number covers."""
    from fusuma_bench import clitime

    if revision and n:
        raise click.UsageError("--revision times the empty-host commands only (an older "
                               "fusuma may not read this host's state DB); leave out --vms.")
    if n:
        c.accel_notice("auto")
    data = clitime.run(c.parts, c.vms, runs=runs, vms=n, memory_mib=memory_mib,
                       revision=revision, progress=progress)
    publish(data, json_file, None, "cli", _cli_summary)


def _cli_summary(data: dict[str, Any]) -> Iterable[str]:
    for r in data["results"]:
        yield (f"{r['metric']:24} median {r['median_ms']:7.1f} ms (min {r['min_ms']}, "
               f"max {r['max_ms']})  {r['command']}")
    own = data["summary"].get("migrate_startup_over_click_ms")
    if own is not None:
        yield (f"{'migrate_startup_over_click_ms':24} {own:14.1f} ms  (migrate_startup_ms - "
               "python_click_ms: fusuma's own part)")
    yield from _targets(data, "median_ms")


def _targets(data: dict[str, Any], key: str, ms: bool = True) -> Iterable[str]:
    """The result's targets, one line each: met or not, and the measured value (KEY),
    in milliseconds (target_ms) or as the result file gives them (target)."""
    for t in data["targets"]:
        target, value = ((f"{t['target_ms']:.0f} ms", f"{t[key]} ms") if ms
                         else (t["target"], t[key]))
        yield f"target {t['metric']} <= {target}: {'met' if t['met'] else 'NOT met'} ({value})"


@bench.command("api")
@click.option("--vms", "n", type=click.IntRange(2, 64), default=16, show_default=True,
              help="Running VMs (128 MiB each) while the API is measured.")
@_json_option()
@pass_ctx
def api_cmd(c: Ctx, n: int, json_file: Path | None) -> None:
    """Latency and throughput of `fusuma serve` with N running VMs.

    \b
    Makes two scratch partitions on the cores no partition holds, boots N VMs in them
    (a few at a time, each to its guest agent), starts its own `fusuma serve` (access
    log off) and measures over the UNIX socket, client-side wall time per request:
      get_vms_p50_ms, get_vms_p99_ms      200 GET /1.0/vms, one after another
      scrape_p50_ms, scrape_p99_ms        50 GET /metrics, one after another
      rps_16_clients, rps_100_clients     GET /1.0/vms requests/s with 16 and 100
                                          concurrent clients (a connection each, back
                                          to back, 10 s each); p99_ms_K_clients too
      event_after_move_ms_median          10 zero-copy moves through the API: arrival
                                          of the vm-moved event on /1.0/events minus
                                          the event's timestamp (written when the move
                                          ended); event_after_op_end_ms_median: minus
                                          the move operation's end instead
    Targets: get_vms_p99_ms <= 20, scrape_p99_ms <= 100,
    event_after_move_ms_median <= 100; the result file says which were met.

    \b
    Needs two free cores and no other `fusuma serve` in this namespace (it starts its
    own on the namespace's socket). The daemon is stopped by its pid and the partitions
    and VMs are removed afterwards, also when the benchmark fails. Under TCG, booting
    16 guests takes a few minutes; progress lines go to stderr.

    \b
    Example:
      fusuma bench api --vms 16 --json results/api.json"""
    from fusuma_bench import api

    c.accel_notice("auto")
    data = api.run(c.parts, c.vms, n, progress=progress)

    def summary(data: dict[str, Any]) -> Iterable[str]:
        s = data["summary"]
        yield (f"GET /1.0/vms  p50 {s['get_vms_p50_ms']} ms, p99 {s['get_vms_p99_ms']} ms "
               f"({n} VMs running)")
        yield f"GET /metrics  p50 {s['scrape_p50_ms']} ms, p99 {s['scrape_p99_ms']} ms"
        for k in api.LOAD_CLIENTS:
            yield (f"{k:3} clients   {s[f'rps_{k}_clients']} requests/s, p99 "
                   f"{s[f'p99_ms_{k}_clients']} ms")
        yield (f"move -> event median {s['event_after_move_ms_median']} ms after the "
               f"move's timestamp, {s['event_after_op_end_ms_median']} ms after its "
               "operation ended")
        yield from _targets(data, "value_ms")

    publish(data, json_file, None, "api", summary)


def _ints(value: str | None, lo: int, hi: int | None, what: str) -> list[int] | None:
    """A comma-separated list of integers in [lo, hi], or None without a value; a
    BadParameter ending in WHAT ("a list of ..., e.g. ...") otherwise."""
    if value is None:
        return None
    try:
        ints = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        ints = []
    if not ints or any(n < lo or (hi is not None and n > hi) for n in ints):
        raise click.BadParameter(f"{value!r} is not {what}.")
    return ints


def _sizes(value: str | None) -> list[int] | None:
    return _ints(value, 64, None, "a list of sizes in MiB (each >= 64), e.g. 256,1024,4096")


def _counts(value: str | None) -> list[int] | None:
    return _ints(value, 1, 64, "a list of VM counts (1-64), e.g. 1,2,4,8")


@bench.command("vmbeam")
@click.option("--sizes", default=None,
              help="Guest memory sizes in MiB, comma-separated  [default: 256,1024,4096; "
                   "with --quick 256,1024].")
@click.option("--moves", type=click.IntRange(1, 100), default=None,
              help="Moves per (mode, size); figures are their median  [default: 5; with "
                   "--quick 2].")
@click.option("--quick", is_flag=True, help="Fewer sizes and moves (a few minutes).")
@click.option("--modes", default=None,
              help="Which moves, comma-separated, in this order for each size: raw (two "
                   "bare QEMUs doing the zero-copy move, no fusuma), zero-copy, copy  "
                   "[default: raw,zero-copy,copy].")
@_json_option("vmbeam")
@_report_option("vmbeam.png")
@pass_ctx
def vmbeam_cmd(c: Ctx, sizes: str | None, moves: int | None, quick: bool,
               modes: str | None, json_file: Path | None, report_dir: Path | None) -> None:
    """The VMBeam experiment: move a running VM back and forth between two partitions,
    zero-copy and by copy, for each guest memory size; check its data after every move.
    Beside them, raw QEMU's own zero-copy move of the same guest (no fusuma), measured
    the same way.

    Needs every core (two scratch partitions, removed afterwards), so no partition may
    exist."""
    from fusuma_bench import vmbeam

    mode_list = [m.strip() for m in modes.split(",") if m.strip()] if modes else list(
        vmbeam.MODES)
    bad = [m for m in mode_list if m not in vmbeam.MODES]
    if bad or not mode_list or len(set(mode_list)) != len(mode_list):
        raise click.BadParameter(f"give each of {', '.join(vmbeam.MODES)} at most once, "
                                 f"comma-separated (not {modes!r}).", param_hint="--modes")

    size_list = _sizes(sizes) or list(vmbeam.QUICK_SIZES if quick else vmbeam.DEFAULT_SIZES)
    n = moves or (vmbeam.QUICK_MOVES if quick else vmbeam.DEFAULT_MOVES)
    c.accel_notice("auto")
    data = vmbeam.run(c.parts, c.vms, size_list, moves=n, progress=progress,
                      modes=mode_list)
    publish(data, json_file, report_dir, "vmbeam", lambda data: (
        f"{r['mode']:9} {r['memory_mib']:6} MiB: total {r['total_ms']} ms, "
        f"downtime {r['downtime_ms']} ms, {r['bytes_sent']} bytes, "
        f"data intact {str(r['data_intact']).lower()}{_error(r)}" for r in data["results"]))


def _error(r: dict[str, Any]) -> str:
    return f" ({r['error']})" if r.get("error") else ""


@bench.command("maintain")
@click.option("--vms", "vms_opt", default="1,4,16", show_default=True,
              help="VM counts, comma-separated: one maintained partition of that many "
                   "running VMs each.")
@click.option("--from", "source", default="7.2", show_default=True,
              help="QEMU the VMs start on (a version from `fusuma qemu list` or a path).")
@click.option("--to", "target", default="10.0", show_default=True,
              help="QEMU `maintain --via --qemu` upgrades the partition to.")
@click.option("--in-place", "in_place", is_flag=True,
              help="Then also `maintain --in-place` (cpr-transfer, --to -> --to) on the "
                   "same VMs, and compare.")
@click.option("--compare-pipeline", "compare_pipeline", is_flag=True,
              help="Run each method twice on the same VMs: first serially (each move "
                   "begun once the one before is done, `maintain --serial`), then "
                   "pipelined as maintain runs by default (the next move's QEMU started "
                   "while this one's source QEMU is ended), to compare the two in one "
                   "run.")
@click.option("--busy", is_flag=True,
              help="Each guest runs a CPU loop (bounded to 10 minutes, ended after each "
                   "maintain) while it is maintained, instead of maintaining idle "
                   "guests; the guests' CPU use before each maintain is recorded.")
@_json_option("maintain")
@_report_option("maintain.png")
@pass_ctx
def maintain_cmd(c: Ctx, vms_opt: str, source: str, target: str, in_place: bool,
                 compare_pipeline: bool, busy: bool, json_file: Path | None,
                 report_dir: Path | None) -> None:
    """Upgrade a partition's QEMU under N running VMs: the whole maintain's time, every
    move's downtime and bytes, data intact; --via (zero-copy) and, with --in-place,
    cpr-transfer.

    Makes two scratch partitions on two cores no partition holds (removed
    afterwards)."""
    from fusuma_bench import maintain

    counts = _counts(vms_opt) or list(maintain.DEFAULT_VMS)
    c.accel_notice("auto")
    data = maintain.run(c.parts, c.vms, counts, source, target, in_place,
                        progress=progress, compare_pipeline=compare_pipeline, busy=busy)
    publish(data, json_file, report_dir, "maintain", lambda data: (
        f"{r['method']:12} {'' if r.get('pipelined', True) else '(serial) '}"
        f"x{r['vms']:<3} {r['from_qemu']} -> {r['to_qemu']}: "
        f"maintain {r['maintain_s']} s, downtime max {r['downtime_ms_max']} ms, "
        f"data intact {str(r['data_intact']).lower()}{_error(r)}" for r in data["results"]))


@bench.command("mint")
@click.option("--quick", is_flag=True, help="Smaller loop counts and 256 MiB guests "
              "(about a minute under TCG).")
@_json_option("mint")
@_report_option("mint-*.png")
@click.option("--disk-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Where the two scratch disk files go, in a storage directory (`fusuma "
                   "storage list`)  [default: FUSUMA_HOME/disks/bench-mint].")
@pass_ctx
def mint_cmd(c: Ctx, quick: bool, json_file: Path | None, report_dir: Path | None,
             disk_dir: Path | None) -> None:
    """The Mint + KVM evaluation: the paper's probe (register, copy, O_DIRECT io) on the
    host, in partitions and in VMs, alone, concurrently and beside a CPU hog
    (nine configurations).

    Needs every core (scratch partitions, VMs and disks, removed afterwards), so no
    partition may exist."""
    from fusuma_bench import mint

    c.accel_notice("auto")
    data = mint.run(c.parts, c.vms, quick=quick, disk_dir=disk_dir, progress=progress)
    publish(data, json_file, report_dir, "mint", lambda data: [
        f"{len(data['results'])} results in {data['meta']['duration_s']} s"], inline=True)


@bench.command("scheduler")
@click.option("--dummies", default=None,
              help="Dummy VM counts, comma-separated  [default: 0,1,2,4,8,16; with --quick "
                   "0,4].")
@click.option("--policies", default=None,
              help="Any of default,nice,governor,partition  [default: all; with --quick "
                   "default,governor].")
@click.option("--loads", default=None,
              help="Dummy load: idle,cpu  [default: both; with --quick cpu].")
@click.option("--test-seconds", type=click.FloatRange(0.5, 120), default=None,
              help="Seconds per workload test, and between the two readings of the "
                   "dummies' progress  [default: 5; with --quick 3].")
@click.option("--runs", type=click.IntRange(1, 20), default=None,
              help="Workload runs per point; each test's rate is the median over them  "
                   "[default: 3; with --quick 1].")
@click.option("--quick", is_flag=True, help="Fewer counts, loads and policies (a few "
              "minutes).")
@click.option("--target-emulator", default="shared", show_default=True, metavar="WHERE",
              help="The target VM's emulator threads: shared, isolated (a core of its "
                   "partition with no guaranteed vCPU; policies whose layout has none are "
                   "skipped, saying why) or a core list.")
@_json_option("scheduler")
@_report_option("scheduler.png")
@pass_ctx
def scheduler_cmd(c: Ctx, dummies: str | None, policies: str | None, loads: str | None,
                  test_seconds: float | None, runs: int | None, quick: bool,
                  target_emulator: str, json_file: Path | None,
                  report_dir: Path | None) -> None:
    """The KVM scheduler study's dummy-VM experiment: a target VM's benchmark index
    beside 0..16 idle or CPU-bound dummy VMs, under each policy (default, nice -5, the
    governor, a partition of its own).

    Needs both cores (scratch partitions, removed afterwards), so no partition may
    exist."""
    from fusuma_bench import scheduler, scheduler_run

    test_s = test_seconds or (scheduler.QUICK_TEST_S if quick else scheduler.TEST_S)
    cfg = scheduler.Config(
        dummies=scheduler.parse_counts(dummies) if dummies else list(
            scheduler.QUICK_DUMMIES if quick else scheduler.DEFAULT_DUMMIES),
        policies=scheduler.parse_choice(policies, scheduler.POLICIES, "policies")
        if policies else list(scheduler.QUICK_POLICIES if quick else scheduler.POLICIES),
        loads=scheduler.parse_choice(loads, scheduler.LOADS, "loads") if loads else list(
            scheduler.QUICK_LOADS if quick else scheduler.LOADS),
        test_s=test_s, progress_s=max(test_s, scheduler.MIN_PROGRESS_S),
        runs=runs or (scheduler.QUICK_RUNS if quick else scheduler.RUNS),
        target_emulator=target_emulator)
    run = scheduler_run.Bench(c.parts, c.vms, cfg, progress)
    run.check_host()          # a refusal is the only line printed
    c.accel_notice("auto")
    publish(run.run(), json_file, report_dir, "scheduler", _scheduler_summary)


def _scheduler_summary(data: dict[str, Any]) -> Iterable[str]:
    for r in data["results"]:
        yield (f"{r['policy']:9} {r['dummies']:2} {r['dummy_load']:4} dummies: index "
               f"{r['index']:6.1f}")
    for p in data["dummy_progress"]:
        yield (f"{p['policy']:9} {p['dummies']:2} cpu  dummies, target idle: "
               f"{p['progressing']}/{p['dummies']} progressing "
               f"({p.get('read', p['dummies'])} read), {p['iterations_per_s']} iterations/s")


@bench.command("dcss")
@click.option("--vms", "counts", default=None,
              help="VM counts, comma-separated  [default: 1,2,4,8; with --quick 1,2].")
@click.option("--modes", default=None,
              help="Any of none,segment,ksm,segment+ksm  [default: all].")
@click.option("--loads", default=None, help="Any of idle,apache2  [default: both].")
@click.option("--memory", "memory_mib", type=click.IntRange(128, 4096), default=256,
              show_default=True, help="Guest RAM of each VM, MiB.")
@click.option("--requests", type=click.IntRange(1, 10**6), default=None,
              help="apache2 requests per ab run (ab -c 4)  [default: 1000; with --quick "
                   "300].")
@click.option("--ab-runs", type=click.IntRange(1, 20), default=None,
              help="ab runs per VM; its requests/s is their median  [default: 3; with "
                   "--quick 1].")
@click.option("--quick", is_flag=True, help="VM counts 1,2 and fewer requests.")
@_json_option("dcss")
@_report_option("dcss.png", from_file=False)
@pass_ctx
def dcss_cmd(c: Ctx, counts: str | None, modes: str | None, loads: str | None,
             memory_mib: int, requests: int | None, ab_runs: int | None, quick: bool,
             json_file: Path | None, report_dir: Path | None) -> None:
    """The DCSS experiment: host memory of 1..N Debian guests, idle and serving apache2,
    with /usr on a private disk (none), in a shared segment, with KSM, or both; the
    memory each added VM costs and the saving of each mode against none.

    Needs every core (one scratch partition and a segment, removed afterwards), so no
    partition may exist; it changes the host's KSM settings while it runs and puts
    them back afterwards. Needs the debian image (`fusuma image build --kind debian`)
    and ab (`apt-get install apache2-utils`)."""
    from fusuma.memshare.segments import SegmentManager
    from fusuma_bench import dcss

    count_list = _counts(counts) or list(dcss.QUICK_COUNTS if quick else dcss.DEFAULT_COUNTS)
    mode_list = [m.strip() for m in modes.split(",")] if modes else list(dcss.MODES)
    load_list = [x.strip() for x in loads.split(",")] if loads else list(dcss.LOADS)
    n_req = requests or (dcss.QUICK_REQUESTS if quick else dcss.DEFAULT_REQUESTS)
    c.accel_notice("auto")
    data = dcss.run(c.parts, c.vms, SegmentManager(c.paths, c.db), count_list, mode_list,
                    load_list, memory_mib=memory_mib, requests=n_req,
                    ab_runs=ab_runs or (dcss.QUICK_AB_RUNS if quick else dcss.AB_RUNS),
                    progress=progress)
    publish(data, json_file, report_dir, "dcss", lambda data: (
        f"{r['load']:7} {r['mode']:11}: {r['slope_pss_mib']} MiB per added VM, "
        f"saving {r['saving_pss_pct']}%, requests/s {r['requests_per_s']}"
        for r in data["summary"]))


@bench.command("density")
@click.option("--budget-mib", type=click.IntRange(1, 10**7), default=None,
              help="Host memory the VMs may use, MiB  [default: 4096; with --quick 1536].")
@click.option("--modes", default=None,
              help="Any of none,segment,ksm,segment+ksm,template,template+ksm  "
                   "[default: all].")
@click.option("--memory", "memory_mib", type=click.IntRange(128, 4096), default=256,
              show_default=True, help="Guest RAM of each VM, MiB.")
@click.option("--requests", type=click.IntRange(1, 10**6), default=None,
              help="HTTP requests per mode over its VMs  [default: 1000; with --quick "
                   "200].")
@click.option("--max-vms", type=click.IntRange(1, 256), default=64, show_default=True,
              help="At most this many VMs per mode, whatever the budget.")
@click.option("--qemu", default="auto", show_default=True,
              help="QEMU of every mode's partition: auto (10.0 when installed: template "
                   "clones need it), system, or a version.")
@click.option("--quick", is_flag=True, help="A 1536 MiB budget and fewer requests.")
@_json_option("density")
@_report_option("density.png", from_file=False)
@pass_ctx
def density_cmd(c: Ctx, budget_mib: int | None, modes: str | None, memory_mib: int,
                requests: int | None, max_vms: int, qemu: str, quick: bool,
                json_file: Path | None, report_dir: Path | None) -> None:
    """How many Debian+apache2 VMs fit in a host memory budget, per way of sharing:
    none, segment (the root from a shared segment), ksm, segment+ksm, template (clones
    of a booted VM's RAM, copy-on-write), template+ksm.

    VMs start one by one until the next would take the host memory in use (the QEMUs'
    own memory plus shared files counted once) past the budget; each answers HTTP
    through its forwarded port. Needs every core (a scratch partition, segment and
    template, removed afterwards), so no partition may exist; it changes the host's KSM
    settings while it runs and puts them back. Needs the debian image (`fusuma image
    build --kind debian`)."""
    from fusuma.memshare.segments import SegmentManager
    from fusuma_bench import density, density_run, report_density

    cfg = density.Config(
        budget_mib=budget_mib or (density.QUICK_BUDGET_MIB if quick
                                  else density.DEFAULT_BUDGET_MIB),
        modes=tuple(density.parse_modes(modes)), memory_mib=memory_mib,
        requests=requests or (density.QUICK_REQUESTS if quick else density.DEFAULT_REQUESTS),
        max_vms=max_vms, qemu=qemu, quick=quick,
        loop_deadline_s=density.QUICK_LOOP_DEADLINE_S if quick else density.LOOP_DEADLINE_S)
    run = density_run.Bench(c.parts, c.vms, SegmentManager(c.paths, c.db), cfg,
                        progress=progress)
    run.check_host()          # a refusal is the only line printed
    c.accel_notice("auto")

    def summary(data: dict[str, Any]) -> Iterable[str]:
        for r in data["results"]:
            yield (f"{r['mode']:12} {r['vms']:3} VMs ({r['stop']}), "
                   f"{r['per_vm_mib']} MiB per added VM, saving {r['saving_pct']}%, "
                   f"start {r['start_ms_median']} ms, {r['requests_per_s']} requests/s"
                   + (f"; {r['note']}" if r["note"] else ""))
        for target, measured, verdict in report_density.targets(data):
            yield f"target {target}: {verdict} ({measured})"

    publish(run.run(), json_file, report_dir, "density", summary)


@bench.command("memory")
@click.option("--parts", default=None, help="Any of fit,burst  [default: both].")
@click.option("--budget-mib", type=click.IntRange(256, 10**7), default=None,
              help="Fit: the host memory budget, MiB  [default: 4096; with --quick 2048].")
@click.option("--modes", default=None,
              help="Fit: any of none,ksm,template,template+ksm  [default: all; with "
                   "--quick none].")
@click.option("--overcommits", default=None,
              help="Fit: memory overcommits, comma-separated  [default: 1,1.5,2].")
@click.option("--memory", "memory_mib", type=click.IntRange(64, 65536), default=None,
              help="Fit: each guest's RAM, MiB  [default: 1024].")
@click.option("--floor", "floor_mib", type=click.IntRange(16, 65536), default=None,
              help="Fit: each guest's floor (--memory-min), MiB  [default: 128].")
@click.option("--max-vms", type=click.IntRange(1, 256), default=None,
              help="Fit: VMs defined per mode at most  [default: 24].")
@click.option("--runs", type=click.IntRange(1, 50), default=None,
              help="Burst: the guaranteed guest's timed loops alone, before and again "
                   "after  [default: 5; with --quick 3].")
@click.option("--burst-mib", type=click.IntRange(8, 4096), default=None,
              help="Burst: MiB each burstable guest writes  [default: 128; with --quick "
                   "96].")
@click.option("--hold-s", type=click.FloatRange(1, 600), default=None,
              help="Burst: the guests free what they wrote once the governor has nothing "
                   "left to take, or this many seconds after the burst began  [default: "
                   "60].")
@click.option("--quick", is_flag=True, help="Mode none only, a 2048 MiB budget, a "
              "smaller burst (a few minutes).")
@_json_option("memory")
@_report_option("memory-*.png")
@pass_ctx
def memory_cmd(c: Ctx, parts: str | None, budget_mib: int | None, modes: str | None,
               overcommits: str | None, memory_mib: int | None, floor_mib: int | None,
               max_vms: int | None, runs: int | None, burst_mib: int | None,
               hold_s: float | None, quick: bool, json_file: Path | None,
               report_dir: Path | None) -> None:
    """Memory as a governed resource: burstable minimal guests that fusuma admits and
    that run in a host memory budget, at each overcommit and way of sharing (fit); and
    a burst that pushes the host past the memory governor's target beside a guaranteed
    guest: how long the host stays short, by the governor's decision log, and the
    guaranteed guest's speed meanwhile against alone (burst).

    \b
    Needs both cores and no partition (scratch partitions, removed afterwards); it
    changes the host's KSM settings in the ksm modes and puts them back. The template
    modes need QEMU 10.0 (`fusuma qemu install 10.0`). See fusuma_bench/memory.py for
    exactly what each figure covers.

    \b
    Example:
      fusuma bench memory --quick --report docs/results/memory-report"""
    from fusuma.errors import ResourceError
    from fusuma.memshare.segments import SegmentManager
    from fusuma_bench import memory, memory_run
    from fusuma_bench.scheduler import parse_choice

    try:
        cfg = memory.Config(
            parts=tuple(parse_choice(parts, memory.PARTS, "parts")) if parts
            else memory.PARTS,
            budget_mib=budget_mib or (memory.QUICK_BUDGET_MIB if quick
                                      else memory.DEFAULT_BUDGET_MIB),
            modes=tuple(parse_choice(modes, memory.FIT_MODES, "modes")) if modes
            else (("none",) if quick else memory.FIT_MODES),
            overcommits=memory.parse_overcommits(overcommits),
            memory_mib=memory_mib or memory.MEMORY_MIB,
            floor_mib=floor_mib or memory.FLOOR_MIB, max_vms=max_vms or memory.MAX_VMS,
            burst_mib=burst_mib or (memory.QUICK_BURST_MIB if quick else memory.BURST_MIB),
            runs=runs or (memory.QUICK_RUNS if quick else memory.RUNS),
            hold_s=hold_s or memory.HOLD_MAX_S, quick=quick)
    except ResourceError as exc:
        raise click.UsageError(str(exc)) from exc
    if cfg.floor_mib > cfg.memory_mib:
        raise click.BadParameter(f"the floor ({cfg.floor_mib} MiB) is above the RAM "
                                 f"({cfg.memory_mib} MiB).", param_hint="--floor")
    run = memory_run.Bench(c.parts, c.vms, SegmentManager(c.paths, c.db), cfg,
                           progress=progress)
    run.check_host()          # a refusal is the only line printed
    c.accel_notice("auto")

    def summary(data: dict[str, Any]) -> Iterable[str]:
        for r in data["fit"]:
            for o in r["overcommits"]:
                yield (f"{r['mode']:12} overcommit {o['overcommit']:<4g} admitted "
                       f"{o['admitted_vms']:3} (computed {o['admitted_vms_computed']}), "
                       f"running in budget {o['running_vms']:3}")
            if not r["overcommits"]:
                yield f"{r['mode']:12} {r['stop']}: {r['note']}"
        b = data["burst"]
        if b is not None and "failed" in b:
            yield f"burst FAILED: {b['failed']}"
        elif b is not None:
            ep = b["episode"]
            yield (f"burst: host short {ep['short_s']} s, back over its target "
                   f"{ep['release_to_recovered_s']} s after the release; steps "
                   f"{ep['steps']}; guaranteed guest at {b['speed_ratio']} of its speed")
        for t in data["targets"]:
            met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
            yield f"target {t['target']}: {met} ({t['measured']})"

    publish(run.run(), json_file, report_dir, "memory", summary)


@bench.group("report")
def report() -> None:
    """Render a report from an existing result file."""


def _report_command(name: str) -> click.Command:
    """`bench report NAME RESULT_FILE OUT_DIR` for REPORTS[name]."""

    @report.command(name, help=REPORTS[name].help)
    @click.argument("result_file", type=click.Path(path_type=Path, exists=True,
                                                   dir_okay=False))
    @click.argument("out_dir", type=click.Path(path_type=Path, file_okay=False))
    def command(result_file: Path, out_dir: Path) -> None:
        paths = render_report(name, result_file, out_dir)
        click.echo(f"report: {', '.join(str(p) for p in paths)}")

    return command


for _name in REPORTS:
    _report_command(_name)


@bench.command("cluster")
@click.option("--hosts", type=click.IntRange(2, 8), default=3, show_default=True,
              help="fusuma hosts, each in a network namespace of its own.")
@click.option("--vms", type=click.IntRange(1, 200), default=24, show_default=True,
              help="FusumaVMs applied at once (128 MiB, 1 vCPU, restartable).")
@click.option("--lease-seconds", type=click.IntRange(3, 120), default=6, show_default=True,
              help="The agents' heartbeat Lease duration.")
@click.option("--in-host-moves", type=click.IntRange(1, 50), default=5, show_default=True,
              help="Zero-copy moves between partitions by the agent, and as many by the "
                   "CLI.")
@click.option("--qemu", default="auto", show_default=True,
              help="QEMU of the partitions: a version (10.0), `system`, or auto (10.0 "
                   "when `fusuma qemu install 10.0` installed it: live copy between hosts "
                   "under TCG needs QEMU >= 9.0).")
@click.option("--cases", default="all", show_default=True,
              help="Which cases run, comma-separated, of in-host, between-hosts, "
                   "parallel and failover (the VMs are applied in any case).")
@click.option("--moves-per-pair", type=click.IntRange(1, 16), default=None,
              help="The agents' --moves-per-pair (default: theirs).")
@click.option("--echo-interval-ms", type=click.FloatRange(1, 100), default=10.0,
              show_default=True,
              help="The parallel case's ICMP echo to each VM: one this often.")
@_json_option()
@pass_ctx
def cluster_cmd(c: Ctx, hosts: int, vms: int, lease_seconds: int, in_host_moves: int,
                qemu: str, cases: str, moves_per_pair: int | None, echo_interval_ms: float,
                json_file: Path | None) -> None:
    """fusuma on a real kube-apiserver: apply to running, moves, failover.

    \b
    Builds a throwaway cluster on this machine (etcd and the kube-apiserver of `make
    kube` in a network namespace, HOSTS fusuma hosts in namespaces of their own, an
    agent on each), then measures like a user with kubectl:
      apply_to_running_s              `kubectl apply` of VMS FusumaVMs to all Running
      in_host_downtime_ms_median      IN_HOST_MOVES zero-copy moves between
                                      partitions (each step of their downtime too)
      cli_in_host_downtime_ms_median  as many of a VM the CLI made on the same host,
                                      by `fusuma migrate`, alternating with them
      in_host_agent_cli_downtime_ratio  the first over the second
      between_hosts_total_ms_median   live moves of a 256 MiB guest between hosts
                                      under TLS (and their downtime, MiB sent)
      tls_slowdown_pct                the same moves in the clear, in alternating
                                      blocks of the same run: how much slower TLS is
      parallel_whole_run_s            every VM re-hosted at once (each to the next
                                      host, one `kubectl apply`) to the last Running
                                      there; each move's downtime as fusuma records
                                      it (parallel_downtime_ms_*) and as an ICMP echo
                                      to each guest sees it (parallel_guest_downtime_
                                      ms_*: median, p99)
      failover_after_expiry_s         a host killed: its restartable VMs running
                                      elsewhere, less the Lease duration
    Targets (TCG): in-host downtime <= 10 ms and at most 1.25 times the CLI's,
    between hosts <= 2 s total, failover <= 30 s after the Lease expires; TLS no more
    than 10 % slower; the parallel case <= 5 s, the guests' downtime <= 100 ms median
    and <= 300 ms at p99.
    Everything made is removed afterwards.

    \b
    Example:
      fusuma bench cluster --hosts 3 --vms 24 --json results/cluster.json"""
    from fusuma_bench import cluster

    version: str | None = None if qemu == "system" else qemu
    if qemu == "auto":
        from fusuma.qemu import versions

        version = "10.0" if versions.resolve_unpacked(c.paths, "10.0") else None
    chosen = cluster.CASES if cases == "all" else \
        tuple(x.strip() for x in cases.split(",") if x.strip())
    unknown = [x for x in chosen if x not in cluster.CASES]
    if unknown:
        raise click.BadParameter(f"no case {', '.join(unknown)}; the cases are "
                                 f"{', '.join(cluster.CASES)}.", param_hint="--cases")
    data = cluster.run(hosts, vms, lease_seconds, version, progress=progress,
                       in_host_moves=in_host_moves, cases=chosen,
                       moves_per_pair=moves_per_pair, echo_interval_ms=echo_interval_ms)
    publish(data, json_file, None, "cluster", lambda data: [
        *(f"{k:36} {v}" for k, v in data["summary"].items()),
        *_targets(data, "value", ms=False)])


@bench.command("network")
@click.option("--runs", type=click.IntRange(1, 20), default=3, show_default=True,
              help="iperf3 runs per path and kind; each figure is their median.")
@click.option("--seconds", type=click.IntRange(1, 60), default=3, show_default=True,
              help="Length of each iperf3 run.")
@click.option("--moves/--no-moves", default=True, show_default=True,
              help="Also measure what each kind of move costs a VM with a tap NIC, and "
                   "a zero-copy move's downtime with and without a NIC.")
@click.option("--move-runs", type=click.IntRange(1, 10), default=3, show_default=True,
              help="Moves per kind of move (each figure is their median).")
@click.option("--downtime-runs", type=click.IntRange(1, 20), default=5, show_default=True,
              help="Zero-copy moves each of the VM with a tap NIC and without a NIC.")
@_json_option("network")
@_report_option("network.png")
def network_cmd(runs: int, seconds: int, moves: bool, move_runs: int, downtime_runs: int,
                json_file: Path | None, report_dir: Path | None) -> None:
    """Throughput of a tap NIC on a fusuma network against QEMU's user-mode network,
    and what each kind of move costs a VM's tap NIC, measured in one run.

    \b
    Builds its own world and removes it afterwards: a network namespace for a scratch
    fusuma (two partitions on cores 0 and 1, managed network `bench`, four Debian
    guests of 256 MiB: two with a tap NIC, two on the user-mode network) and an
    "uplink" namespace behind a veth pair with an iperf3 server. Throughput: host to
    VM, VM to VM and VM out through NAT, each figure the median of RUNS iperf3 TCP
    runs (interleaved); the ratio tap / user-mode is the point (under TCG the absolute
    numbers are low).

    \b
    Moves (unless --no-moves), once the Debian guests are deleted: a minimal guest
    with a tap NIC and the same guest without any NIC move by zero-copy in turn
    (DOWNTIME_RUNS each, the system's QEMU): their downtimes side by side. Then the
    partitions are made again on QEMU 10.0 and the guest with the NIC moves by
    zero-copy, copy, `maintain --via` and `maintain --in-place` (MOVE_RUNS each) while
    a TCP stream and an ICMP echo every millisecond run from fusuma's namespace to it:
    echoes lost, the longest outage, the stream's longest stall, the downtime.

    \b
    Needs the debian image (`fusuma image build --kind debian`: it has iperf3), the
    default image, QEMU 10.0 for --in-place (`fusuma qemu install 10.0`), iperf3 on
    the host and both cores free of other work while it runs (about 5 minutes).

    \b
    Example:
      fusuma bench network --report docs/results/network-report"""
    from fusuma_bench import network

    data = network.run(runs=runs, seconds=seconds, moves=moves, move_runs=move_runs,
                       downtime_runs=downtime_runs, progress=progress)

    def summary(data: dict[str, Any]) -> Iterable[str]:
        for r in data["summary"]:
            yield (f"{r['path']:10} tap {r['tap_mbit_s_median']} Mbit/s, user-mode "
                   f"{r['user_mode_mbit_s_median']} Mbit/s: tap/user-mode "
                   f"{r['tap_over_user_mode']}")
        moved = data["moves"]
        if moved is None:
            return
        for k in moved["kinds"]:
            yield (f"move {k['kind']:19} " + (k["skipped"] or
                   f"echoes lost {k.get('echoes_lost_median')} of "
                   f"{k.get('echoes_sent_median')}, outage {k.get('outage_ms_median')} ms, "
                   f"TCP stall {k.get('tcp_stall_ms_median')} ms, downtime "
                   f"{k.get('downtime_ms_median')} ms ({k['runs']} runs)"))
        d = moved["nic_downtime"]
        yield (f"zero-copy downtime: tap NIC {d['with_nic_downtime_ms_median']} ms, no NIC "
               f"{d['without_nic_downtime_ms_median']} ms (medians of "
               f"{d['with_nic_moves']} and {d['without_nic_moves']})")

    publish(data, json_file, report_dir, "network", summary)


@bench.command("images")
@click.option("--quick", is_flag=True,
              help="A small generated image (64 MiB, 48 MiB of data), no boot: seconds.")
@click.option("--runs", type=click.IntRange(1, 50), default=5, show_default=True,
              help="Imports (and checksums, qemu-img info) timed; each figure is their "
                   "median. Thin disks: at least 5.")
@click.option("--readers", type=click.IntRange(1, 16), default=3, show_default=True,
              help="Processes reading the whole disk through a thin disk each on the one "
                   "base, then through a full copy each.")
@click.option("--boot-vms", type=click.IntRange(0, 8), default=None,
              help="VMs made from the image booted together by SeaBIOS to their guest "
                   "agent [default: 2, 0 with --quick].")
@click.option("--image", "image", type=click.Path(exists=True, dir_okay=False,
                                                 path_type=Path), default=None,
              help="Measure this image file (qcow2 or raw) instead of the bootable "
                   "Debian disk the tests build.")
@_json_option()
@pass_ctx
def images_cmd(c: Ctx, quick: bool, runs: int, readers: int, boot_vms: int | None,
               image: Path | None, json_file: Path | None) -> None:
    """Importing a disk image, thin disks on it, and the page cache VMs on one base share.

    \b
    Figures (medians of RUNS; see fusuma_bench/images.py for exactly what each covers):
      import_ms, import_s_per_gib  `image import` (copy with SHA-256, qemu-img info),
                                   the file in the page cache; sha256_s_per_gib and
                                   probe_ms: its two parts alone
      overlay_create_ms            a thin disk (qcow2 overlay) on the imported base
      sharing                      READERS readers on the one base: its resident bytes
                                   (mincore) after each; then a full copy per reader:
                                   the copies' resident bytes; saved_bytes =
                                   (READERS - 1) x base resident, beside the measured
                                   copies_minus_shared_bytes
      boot_to_agent_ms             BOOT_VMS VMs booted together by SeaBIOS, and what
                                   `share report` says of their base afterwards
      firmware                     one VM at a time: SeaBIOS, UEFI (to the agent and to
                                   sshd's banner on a port forward) and fusuma's Debian
                                   image by direct kernel boot (to the agent); on the
                                   UEFI VM, snapshot create/restore/delete times (disk,
                                   --memory) and a full and an incremental backup's
                                   throughput (MiB/s)
    The image: the bootable Debian disk the tests build (cached in FUSUMA_CACHE;
    `python -m fusuma.images.diskimage` builds it), --image FILE, or with --quick a
    small generated qcow2. Booting needs a free core; a scratch partition is made on
    the free cores. Everything made is removed afterwards.

    \b
    Example:
      fusuma bench images --json docs/results/images.json"""
    from fusuma_bench import images

    n = boot_vms if boot_vms is not None else (0 if quick else 2)
    if n:
        c.accel_notice("auto")
    data = images.run(c.paths, c.db, c.parts, c.vms, quick=quick, runs=runs,
                      readers=readers, boot_vms=n, image=image, progress=progress)

    def summary(data: dict[str, Any]) -> Iterable[str]:
        s, sh = data["summary"], data["sharing"]
        yield (f"import {s['import_ms_median']} ms ({s['import_s_per_gib']} s/GiB; "
               f"sha256 {s['sha256_s_per_gib']} s/GiB, qemu-img info "
               f"{s['probe_ms_median']} ms)")
        yield f"thin disk {s['overlay_create_ms_median']} ms"
        yield (f"{sh['readers']} readers on one base: base resident "
               f"{sh['base_resident_bytes'] / 2**20:.1f} MiB, saved "
               f"{sh['saved_bytes'] / 2**20:.1f} MiB ((readers - 1) x resident); a copy "
               f"each: {sh['copies_resident_bytes'][-1] / 2**20:.1f} MiB resident")
        b = data["boot"]
        if b is not None and "failed" in b:
            yield f"boot of {b['vms']} VM(s) FAILED: {b['failed']}"
        elif b is not None:
            yield (f"{b['vms']} VM(s) by SeaBIOS: boot to agent median "
                   f"{b['boot_to_agent_ms_median']} ms; base resident "
                   f"{(b['base_resident_bytes'] or 0) / 2**20:.1f} MiB held by "
                   f"{b['vms_holding_base']}, saved {b['saved_bytes'] / 2**20:.1f} MiB")
        f = data.get("firmware")
        if f is not None and "failed" in f:
            yield f"firmware boots FAILED: {f['failed']}"
        elif f is not None:
            for fw in ("bios", "uefi", "kernel"):
                yield f"{fw}: {f[fw]}"
            yield f"snapshots (ms): {f['snapshots']}"
            for kind, r in f["backup"].items():
                yield (f"{kind} backup: {r['seconds']} s, {r['disk_mib_per_s']} MiB/s of "
                       f"disk, {r['written_mib_per_s']} MiB/s written")

    publish(data, json_file, None, "images", summary)
