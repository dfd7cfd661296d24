"""`fusuma agent`, `fusuma cluster ...` and `fusuma host ...`: the cluster's own
commands (listed in the program's command table, ``fusuma.cli.main.COMMANDS``).

Kept light: the agent's modules (and PyYAML) are imported when a command runs."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

import click

from fusuma.console import pass_ctx, progress
from fusuma.ops.context import Ctx

if TYPE_CHECKING:
    from fusuma.cluster.kube import Kube


@click.command()
@click.option("--kubeconfig", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              required=True, help="Credentials for the API server: this host's own "
                                  "identity (`fusuma cluster join NAME`). Never found "
                                  "by default as the admin commands' are: an agent "
                                  "run with an admin's credentials could write any "
                                  "host's objects.")
@click.option("--namespace", "-n", default=None,
              help="Reconcile FusumaVMs of this namespace only (default: every namespace).")
@click.option("--host-name", default=None,
              help="This host's FusumaHost name (default: the machine's short hostname).")
@click.option("--address", default=None,
              help="Address other hosts reach this host at for live moves (default: the "
                   "source address of this host's route to the API server).")
@click.option("--lease-seconds", type=click.IntRange(3, 3600), default=40, show_default=True,
              help="Heartbeat Lease duration: the host is lost this long after its last "
                   "renewal.")
@click.option("--workers", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Objects reconciled at once (moves between hosts have threads of "
                   "their own).")
@click.option("--moves-per-pair", type=click.IntRange(1, 16), default=4, show_default=True,
              help="Live moves this host runs at once to any one other host; more wait "
                   "their turn (the VM's Moved condition says MoveQueued).")
@pass_ctx
def agent(c: Ctx, kubeconfig: Path, namespace: str | None, host_name: str | None,
          address: str | None, lease_seconds: int, workers: int,
          moves_per_pair: int) -> None:
    """Run this host's fusuma agent: register it, reconcile the cluster's objects here.

    \b
    It registers a FusumaHost and renews its heartbeat Lease (namespace fusuma-system),
    makes the FusumaPartitions of this host, and runs, stops, moves and deletes the
    FusumaVMs assigned to it through fusuma's own operations, writing their status,
    conditions and Kubernetes Events. Every agent also runs the placement controller
    (one active at a time, through a Lease): it places VMs without a host, and when a
    host's Lease expires marks its VMs lost and starts the restartable ones elsewhere.
    Restarting the agent is safe: it re-reads the cluster and the host and does only
    what is still missing. Install the CRDs and policy first (`fusuma cluster
    install`), and give the host its identity (`fusuma cluster join NAME`).
    """
    import logging

    from fusuma.cluster.agent import Agent
    from fusuma.cluster.context import AgentConfig

    # One line per request is too much even with -v; -vv shows them.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    import os

    from fusuma.cluster.context import PLAIN_MOVES_ENV
    from fusuma.cluster.kube import KubeConfig

    cfg = KubeConfig.load(kubeconfig)
    name = host_name or socket.gethostname().split(".")[0].lower()
    Agent(c.paths, cfg, AgentConfig(host=name, address=address, namespace=namespace,
                                    lease_seconds=lease_seconds, workers=workers,
                                    moves_per_pair=moves_per_pair,
                                    plain_moves=os.environ.get(PLAIN_MOVES_ENV) == "1")).run()


@click.group()
def cluster() -> None:
    """fusuma on Kubernetes: the CRDs, policy and host identities the agents need."""


@cluster.command("install")
@click.option("--apply", "do_apply", is_flag=True,
              help="Create or update them in the cluster instead of printing them.")
@click.option("--kubeconfig", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="Credentials for --apply (an admin's: it creates CRDs, roles and the "
                   "admission policy). Default: $KUBECONFIG, else ~/.kube/config.")
def install(do_apply: bool, kubeconfig: Path | None) -> None:
    """Print the CRDs, roles, namespace and admission policy as YAML for `kubectl apply -f -`.

    \b
    FusumaHost, FusumaPartition, FusumaVM and FusumaSegment (group fusuma.io), the
    namespace fusuma-system (Leases), view/edit roles aggregated into Kubernetes' own
    `view` and `edit`, and the ValidatingAdmissionPolicy fusuma-host-restriction
    (Kubernetes >= 1.30) that lets each host write only its own objects. Each host
    then needs an identity of its own: `fusuma cluster join NAME`. With --apply, the
    identity all agents shared before (fusuma-agent) is removed, and the CA of the move
    stream between hosts is made if there is none (Secret fusuma-system/fusuma-move-ca,
    readable by admins only); `fusuma cluster rotate-certs` issues hosts' certificates.
    """
    from fusuma.cluster.crds import render_yaml
    from fusuma.cluster.install import manifests

    if not do_apply:
        click.echo(render_yaml(manifests()), nl=False)
        return
    from fusuma.cluster.certs import ensure_ca
    from fusuma.cluster.install import apply, remove_legacy

    kube = _kube(kubeconfig)
    apply(kube, manifests(), progress=progress)
    remove_legacy(kube, progress=progress)
    ensure_ca(kube, progress)


@cluster.command("join")
@click.argument("host")
@click.option("--kubeconfig", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="An admin's credentials (it creates the host's ServiceAccount and "
                   "roles). Default: $KUBECONFIG, else ~/.kube/config.")
@click.option("--output", "-o", type=click.Path(path_type=Path, dir_okay=False),
              help="Write the host's kubeconfig here (mode 0600) instead of to stdout.")
@click.option("--server", default=None,
              help="API server URL the host reaches (default: the admin kubeconfig's).")
@click.option("--token-hours", type=click.IntRange(1, 24 * 3650), show_default=True,
              default=24 * 365, help="How long the host's token is valid; run join "
                                     "again to renew it.")
def join(host: str, kubeconfig: Path | None, output: Path | None, server: str | None,
         token_hours: int) -> None:
    """Make HOST's own identity and print (or write) a kubeconfig for its agent.

    \b
    The ServiceAccount fusuma-system/fusuma-host-HOST, a ClusterRole and a Role (its
    heartbeat Lease and its certificate Secret by name) bound to it and to the user
    fusuma:host:HOST (for a client certificate from your own CA instead), and a token
    for it. The admission policy of `fusuma cluster install` lets this identity write
    only HOST's own FusumaHost status and the objects placed on HOST. Run it again to
    renew the token; `fusuma cluster leave HOST` revokes it.
    """
    from fusuma.cluster import identity
    from fusuma.cluster.install import apply
    from fusuma.cluster.kube import Kube, KubeConfig, find_kubeconfig

    identity.check_host_name(host)
    cfg = KubeConfig.load(find_kubeconfig(kubeconfig))
    kube = Kube(cfg)
    apply(kube, identity.host_objects(host), progress=progress)
    token, expires = identity.request_token(kube, host, token_hours)
    text = identity.kubeconfig(cfg, host, token, server)
    if output is None:
        click.echo(text, nl=False)
        return
    identity.write_private(output, text)
    progress(f"kubeconfig of host {host} written to {output} (token valid until "
             f"{expires or 'the API server says'})")


@cluster.command("leave")
@click.argument("host")
@click.option("--kubeconfig", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="An admin's credentials. Default: $KUBECONFIG, else ~/.kube/config.")
def leave(host: str, kubeconfig: Path | None) -> None:
    """Remove HOST's identity: its ServiceAccount (every token of it stops working at
    once), roles and bindings. Its FusumaHost and VMs stay (delete or move them)."""
    from fusuma.cluster import identity

    identity.check_host_name(host)
    gone = identity.remove(_kube(kubeconfig), host)
    progress(f"host {host}'s identity removed ({', '.join(gone)})" if gone else
             f"host {host} has no identity in this cluster")


@cluster.command("rotate-certs")
@click.option("--kubeconfig", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="An admin's credentials (it reads the CA's Secret). Default: "
                   "$KUBECONFIG, else ~/.kube/config.")
@click.option("--host", "hosts", multiple=True,
              help="Also issue a certificate for this host (repeatable): a host whose "
                   "agent has not registered yet.")
@click.option("--ca", "new_ca", is_flag=True,
              help="Make a new CA first; both CAs are trusted until --drop-previous-ca.")
@click.option("--drop-previous-ca", is_flag=True,
              help="Then stop trusting the CA the current one replaced.")
@click.option("--timeout", type=click.FloatRange(1, 86400), default=600, show_default=True,
              help="Seconds to wait for the agents to take up a new CA, and for the "
                   "moves under way to end.")
def rotate_certs(kubeconfig: Path | None, hosts: tuple[str, ...], new_ca: bool,
                 drop_previous_ca: bool, timeout: float) -> None:
    """Issue new certificates for the move stream between hosts.

    \b
    Every host (registered, holding a certificate, or named with --host) gets a new key
    and certificate from the cluster's move CA, in Secret fusuma-system/fusuma-host-HOST,
    which only that host's identity (`fusuma cluster join HOST`) may read; the agents
    take them up within a heartbeat. Moves under way are not disturbed:
    QEMU reads its credentials when a move begins, and every host trusts the CA.
    With --ca a new CA is made: every host first trusts both, and only once every live
    host's agent reports it (FusumaHost status.moveTLS) and the moves under way then
    have ended do hosts get certificates of the new CA.

    \b
    Example (the first certificates, before the agents start):
      fusuma cluster rotate-certs --kubeconfig admin.conf --host h0 --host h1
    """
    from fusuma.cluster.certs import Rotation

    kube = _kube(kubeconfig)
    Rotation(kube, progress, timeout).run(list(hosts), new_ca=new_ca,
                                          drop_previous=drop_previous_ca)


# `fusuma host ...`'s credentials: a user's, found as kubectl finds them.
KUBECONFIG_OPTION = click.option(
    "--kubeconfig", type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Credentials for the API server that may patch FusumaHosts (an admin's, or "
         "a user's with the fusuma-edit role bound cluster-wide). Default: "
         "$KUBECONFIG, else ~/.kube/config.")


def _kube(kubeconfig: Path | None) -> Kube:
    from fusuma.cluster.kube import Kube, KubeConfig, find_kubeconfig

    return Kube(KubeConfig.load(find_kubeconfig(kubeconfig)))


@click.group()
def host() -> None:
    """The cluster's hosts: list them, cordon, drain and uncordon one.

    \b
    These talk to the Kubernetes API server (--kubeconfig), not to this host: each
    changes a FusumaHost's spec, and the agents do the work. Cordon: no new VM is
    placed on the host. Drain: cordon, and move every VM off it live to the other
    hosts (or, with --partition, only one partition's VMs into the host's other
    partitions, zero-copy, for a QEMU upgrade). Uncordon: both end. They need the
    fusuma-edit role (or Kubernetes' edit) bound cluster-wide: a FusumaHost is not in a
    namespace. For a host that is down, its restartable VMs are
    started on other hosts by the placement controller whether it is drained or not
    (`kubectl get fvm` says why for each that is not).
    """


@host.command("list")
@KUBECONFIG_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the hosts as JSON.")
def host_list(kubeconfig: Path | None, as_json: bool) -> None:
    """Show each host: ready, whether it takes new VMs, its VMs, its drain."""
    from fusuma.cluster.drain import summary
    from fusuma.cluster.kube import HOST
    from fusuma.console import emit_json, table

    rows = summary(_kube(kubeconfig).list(HOST)[0])
    if as_json:
        emit_json(rows)
        return
    click.echo(table([[r["name"], "yes" if r["ready"] else "no",
                       "draining" if r["drain"] else "yes" if r["schedulable"]
                       else "cordoned", str(r["vms"] if r["vms"] is not None else "-"),
                       str(r["freeMiB"] if r["freeMiB"] is not None else "-"),
                       r["drainState"] or "-", r["address"] or "-"] for r in rows],
                     ["host", "ready", "schedulable", "vms", "free_mib", "drain",
                      "address"]))


@host.command("cordon")
@click.argument("name")
@KUBECONFIG_OPTION
def host_cordon(name: str, kubeconfig: Path | None) -> None:
    """Place no new VM on host NAME; the VMs it runs stay (sets spec.unschedulable)."""
    from fusuma.cluster import hostctl

    new = hostctl.cordon(_kube(kubeconfig), name)
    n = (new.get("status") or {}).get("vms")
    progress(f"host {name} takes no new VM; its {'' if n is None else f'{n} '}VM(s) keep "
             f"running there (`fusuma host drain {name}` moves them off)")


@host.command("drain")
@click.argument("name")
@KUBECONFIG_OPTION
@click.option("--partition", "partitions", multiple=True, metavar="P",
              help="Drain only partition P of the host (repeatable), into the host's "
                   "other partitions, zero-copy: for upgrading P's QEMU. The host keeps "
                   "taking VMs.")
@click.option("--wait", is_flag=True,
              help="Follow the drain, a line per VM, until no VM is left or those left "
                   "cannot leave; exit 1 then, saying why for each.")
@click.option("--timeout", type=click.FloatRange(1, 86400), default=600, show_default=True,
              help="With --wait: give up following after this many seconds (the drain "
                   "goes on).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the drain's progress (the FusumaHost's status.drain) as JSON "
                   "(without --wait: null until the host's agent took the drain up).")
def host_drain(name: str, kubeconfig: Path | None, partitions: tuple[str, ...],
               wait: bool, timeout: float, as_json: bool) -> None:
    """Move every VM off host NAME, live, to the other hosts; place no new VM there.

    \b
    Sets spec.drain and spec.unschedulable of FusumaHost NAME. Its agent then moves
    each of its VMs live to the host and partition with the most room left (the same
    capacity rules as placement, with the room reserved so that the placement
    controller cannot give it away meanwhile), a few at a time, exactly as a change of
    the VM's spec.host would; it writes the progress to the host's status.drain
    (`kubectl get fh NAME -o yaml`): VMs left, moving, moved, and a sentence for each
    that cannot leave:
      - pinned to NAME by spec.host: clear it or name another host;
      - no other host has room (the sums, per host and partition);
      - its move failed and no other host can take it (the reason; it is tried again
        within a minute). A move that fails where another host has room is sent
        there instead, and the host where it failed is avoided for five minutes.
    The VMs keep running throughout; the host stays cordoned until `fusuma host
    uncordon NAME`. A host that is down cannot move anything: its restartable VMs
    are started on other hosts from their images by the placement controller
    (failover), and --wait shows each VM's outcome or why it cannot be.

    \b
    With --partition P (for upgrading P's QEMU, or emptying P to resize or remove it)
    only P is drained, into NAME's other partitions: it takes no new VM
    (spec.drainPartitions), and each VM in it not pinned there by spec.partition moves
    zero-copy to the partition with the most room, as a change of its spec.partition
    would; the guests' RAM is not copied and the host keeps its VMs. On one host
    without a cluster, `fusuma maintain P --via Q` does the same and moves the VMs back;
    in a cluster the VMs' placements are the cluster's, so drain P here instead (the
    agent would move them back to P under maintain).

    \b
    Examples:
      fusuma host drain h0 --wait      # ... then upgrade or reboot h0
      fusuma host uncordon h0
      fusuma host drain h0 --partition p0 --wait   # p0's VMs to h0's other partitions
      fusuma host uncordon h0 --partition p0
    """
    from fusuma.cluster import hostctl
    from fusuma.cluster.drain import describe
    from fusuma.cluster.drain import progress as drain_progress
    from fusuma.cluster.kube import VM
    from fusuma.console import emit_json

    kube = _kube(kubeconfig)
    new = hostctl.drain(kube, name, partitions)
    if not wait:
        st = drain_progress(new, kube.list(VM)[0])
        if as_json:
            emit_json(st)
            return
        if st is not None and st.get("down"):
            progress(f"host {name} is cordoned; {st['message']}")
        elif partitions:
            progress(f"partition(s) {', '.join(partitions)} of host {name} are draining: "
                     f"its agent moves their VMs to its other partitions; add --wait to "
                     "follow it")
        else:
            progress(f"host {name} is cordoned and draining: its agent moves its VMs off; "
                     f"`fusuma host drain {name} --wait` follows it")
        for line in describe(st or {}):
            click.echo(line)
        return
    st = hostctl.follow(kube, name, timeout, progress)
    if as_json:
        emit_json(st)
    else:
        click.echo(st["message"])
    err = hostctl.blocked(name, st)
    if err is not None:
        raise err


@host.command("uncordon")
@click.argument("name")
@KUBECONFIG_OPTION
@click.option("--partition", "partitions", multiple=True, metavar="P",
              help="End only partition P's drain (repeatable); the host's own cordon or "
                   "drain stays.")
def host_uncordon(name: str, kubeconfig: Path | None, partitions: tuple[str, ...]) -> None:
    """Let VMs be placed on host NAME again, and end its drains.

    Clears spec.unschedulable, spec.drain and spec.drainPartitions (with --partition,
    only those partitions). VMs moved off stay where they went; a move already under
    way finishes."""
    from fusuma.cluster import hostctl

    hostctl.uncordon(_kube(kubeconfig), name, partitions)
    if partitions:
        progress(f"partition(s) {', '.join(partitions)} of host {name} take new VMs again")
    else:
        progress(f"host {name} takes new VMs again")
