"""Where a trainer's ranks meet, and the torchrun command and environment that start them.

One machine: torchrun's ``--standalone`` rendezvous on localhost and gloo on loopback. Several machines
(``--nnodes``/``--node-rank``/``--rdzv-endpoint``): the static rendezvous at node 0's endpoint and gloo on
the interface towards it. Pure checks and command lines (no torch, no processes), so the launcher refuses
bad flags in a moment and tests can check every combination.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prime_node.errors import NodeError
from prime_node.p2p.local_addresses import addresses_of


@dataclass(frozen=True)
class Rendezvous:
    """Where this machine's ranks meet the others': ``nnodes`` machines, this one's ``node_rank``, node
    0's ``host:port`` (``endpoint``) and the network interface gloo uses (None: loopback on one node,
    else found by ``gloo_interface``). One node with no endpoint is torchrun's ``--standalone``."""

    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None
    interface: str | None = None

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


SINGLE_NODE = Rendezvous()


def parse_rendezvous(
    nnodes: int, node_rank: int, endpoint: str | None, interface: str | None = None
) -> Rendezvous:
    """The checked multi-node flags (NodeError ``bad_flag`` naming the flag), before torch loads."""
    if nnodes < 1:
        raise NodeError(f"--nnodes {nnodes}: at least 1", reason="bad_flag")
    if not 0 <= node_rank < nnodes:
        raise NodeError(
            f"--node-rank {node_rank}: must be from 0 to --nnodes - 1 ({nnodes - 1})", reason="bad_flag"
        )
    if nnodes > 1 and endpoint is None:
        raise NodeError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT: node 0's address, where every node meets",
            reason="bad_flag",
        )
    if nnodes == 1 and endpoint is not None:
        raise NodeError("--rdzv-endpoint is for --nnodes above 1", reason="bad_flag")
    if endpoint is not None:
        split_endpoint(endpoint)
    if interface is not None and not interface.strip():
        raise NodeError("--gloo-interface: empty interface name", reason="bad_flag")
    return Rendezvous(nnodes, node_rank, endpoint, interface)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port); NodeError ``bad_flag`` otherwise."""
    host, _, port_text = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            valid = isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
        except ValueError:
            valid = False
    else:  # a name or IPv4 address (a bare IPv6 address makes its port ambiguous)
        valid = bool(host) and not any(c.isspace() or c in ":/[]@" for c in host)
    if not (valid and port_text.isascii() and port_text.isdigit()):
        raise NodeError(
            f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT (e.g. 10.0.0.1:29400, [fd00::1]:29400)",
            reason="bad_flag",
        )
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise NodeError(f"--rdzv-endpoint {endpoint!r}: port must be 1-65535", reason="bad_flag")
    return host, port


def torchrun_command(
    module: str, args: Sequence[str], nproc: int, rendezvous: Rendezvous = SINGLE_NODE
) -> list[str]:
    """torchrun on this interpreter: ``--standalone`` (a rendezvous on localhost) on one node; across
    nodes the static rendezvous at node 0's endpoint, where node rank R's ranks are global ranks
    R*nproc .. R*nproc+nproc-1. (The c10d backend would number nodes by its own sort of host names and
    pids, ignoring --node-rank: rank 0, which holds the key, could land on any machine.) No restarts: a
    lost rank ends the run on every node, and it resumes from its last checkpoint when started again."""
    if rendezvous.endpoint is None:
        placement = ["--standalone"]
    else:
        placement = [
            f"--nnodes={rendezvous.nnodes}",
            f"--node-rank={rendezvous.node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={rendezvous.endpoint}",
            "--max-restarts=0",
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *placement,
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *args,
    ]


def torchrun_env(
    interface: str | None = None, *, environ: Mapping[str, str] | None = None, linux: bool | None = None
) -> dict[str, str]:
    """``environ`` (default ours), with one torch/BLAS thread per rank unless OMP_NUM_THREADS says
    otherwise, and gloo's sockets on ``interface`` (one node: default ``lo`` on Linux, where every rank
    is on this machine, unless GLOO_SOCKET_IFNAME is set). torchrun's own rendezvous store cannot be
    told where to listen (TCPStore binds every interface; measured with ``ss -ltnp`` on torch 2.13), so
    keep the trainer machines' firewalls closed to what they do not serve."""
    base = os.environ if environ is None else environ
    env = {**base, "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1")}
    if interface is not None:
        env["GLOO_SOCKET_IFNAME"] = interface
    elif sys.platform.startswith("linux") if linux is None else linux:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def gloo_interface(rendezvous: Rendezvous, environ: Mapping[str, str] | None = None) -> str | None:
    """The interface gloo should use: ``--gloo-interface``, else GLOO_SOCKET_IFNAME, else (across nodes)
    the one holding the address this machine reaches the endpoint from (on node 0: the endpoint's own).
    None on one node (loopback). NodeError ``bad_flag`` if it cannot tell or the interface is absent."""
    base = os.environ if environ is None else environ
    name = rendezvous.interface or base.get("GLOO_SOCKET_IFNAME")
    if name is None and rendezvous.endpoint is not None:
        host, port = split_endpoint(rendezvous.endpoint)
        name = interface_towards(host, port)
    if name is None:
        return None
    try:
        socket.if_nametoindex(name)
    except OSError:
        raise NodeError(
            f"no network interface {name!r} on this machine (--gloo-interface)", reason="bad_flag"
        ) from None
    return name


def interface_towards(host: str, port: int) -> str:
    """The interface holding this machine's source address towards ``host`` (a UDP ``connect`` only
    asks the routing table: nothing is sent). NodeError ``bad_flag`` when there is none."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            local = ipaddress.ip_address(probe.getsockname()[0])
    except OSError as exc:
        raise NodeError(
            f"no route to the rendezvous host {host}: {exc} (pass --gloo-interface)", reason="bad_flag"
        ) from None
    for _, name in socket.if_nameindex():
        if local in addresses_of(name):
            return name
    raise NodeError(
        f"no interface holds {local}, this machine's address towards {host} (pass --gloo-interface)",
        reason="bad_flag",
    )
