"""lsync-doctor: check a multi-process / multi-node set-up before training on it.

Run it under the same launcher, with the same ``devices`` / ``num_nodes`` as the training job::

    lsync-doctor --devices 2                                   # spawns 2 local ranks, like Lightning
    torchrun --nproc_per_node=2 -m lightning_sync.doctor --devices 2
    torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=2 --master_addr=$HEAD --master_port=29500 \\
        -m lightning_sync.doctor --devices 2 --num-nodes 2
    srun -N2 --ntasks-per-node=2 python -m lightning_sync.doctor --devices 2 --num-nodes 2

Every rank first checks what it can see on its own: the launcher's variables (torchrun, SLURM,
Lightning's launcher), world size against ``devices x num_nodes``, the SLURM task layout, what
MASTER_ADDR resolves to and whether MASTER_PORT answers, the address gloo will bind (from
GLOO_SOCKET_IFNAME, else from the hostname), NCCL_SOCKET_IFNAME, GPU visibility and versions.
Ranks then exchange these reports through the rendezvous store (a TCP connection to
MASTER_ADDR:MASTER_PORT only, so this works even when the full gloo/NCCL mesh cannot form), compare
them, and - unless a finding already shows the group cannot form - join the process group with a
short timeout and run one ``all_reduce``. Rank 0 prints a table of every rank and a diagnosis; a rank
that cannot reach rank 0 prints its own findings. Every rank exits 1 when anything is wrong, else 0.

Only torch and the standard library are imported (plus ``lightning_sync.collectives``), so it starts
in about a second; Lightning's version is read from package metadata.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import ipaddress
import json
import os
import platform
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from lightning_sync.peers import local_address
from lightning_sync.ranks import free_port

__all__ = ["Launch", "Problem", "detect_launch", "diagnose", "main"]

_STORE_PREFIX = "lsync_doctor"
_package_version: Callable[[str], str] = metadata.version
_SLURM_INTERACTIVE_NAMES = ("bash", "interactive")


# --------------------------------------------------------------------------------------------------
# what the launcher says


@dataclass
class Problem:
    """One finding that would break or distort the training run.

    Attributes:
        text: what is wrong, with every rank's value where ranks are involved.
        fix: what to change.
        blocking: the process group cannot form with it; the doctor does not try to join.
    """

    text: str
    fix: str
    blocking: bool = False

    def render(self) -> str:
        return f"{self.text}\n   Fix: {self.fix}"


@dataclass
class Launch:
    """This process's place in the job, as the launcher describes it (mirrors Lightning's detection).

    Attributes:
        launcher: ``"torchrun"``, ``"slurm"``, ``"lightning"`` (processes started by Lightning's launcher
            or by hand with LOCAL_RANK/NODE_RANK set) or ``"none"`` (nothing started us: the doctor
            spawns the local ranks itself).
        agent_store: torchrun's agent already serves the store at MASTER_ADDR:MASTER_PORT.
    """

    launcher: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    agent_store: bool = False
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _int(env: dict[str, str], key: str, default: int | None = None) -> int | None:
    value = env.get(key)
    if value is None or value == "":
        return default
    match = re.match(r"\d+", value)  # SLURM writes "2(x2)" or "2,1"
    return int(match.group()) if match else default


def slurm_root_node(nodes: str) -> str:
    """First host of a SLURM node list (``n[0-1]`` -> ``n0``), as Lightning's SLURMEnvironment picks it."""
    nodes = re.sub(r"\[(.*?)[,-].*\]", "\\1", nodes)
    nodes = re.sub(r"\[(.*?)\]", "\\1", nodes)
    return nodes.split(" ")[0].split(",")[0]


def detect_launch(env: dict[str, str], devices: int | None, num_nodes: int | None) -> Launch:
    """Read this process's rank layout from the environment, in Lightning's order.

    TorchElastic (torchrun) first, then SLURM (unless the job is named ``bash``/``interactive``), then
    Lightning's own variables (LOCAL_RANK set), else nothing: the caller spawns the ranks.

    Args:
        env: the environment (``os.environ``).
        devices: ``--devices``, processes per node; ``None`` when not given.
        num_nodes: ``--num-nodes``; ``None`` when not given.
    """
    if "TORCHELASTIC_RUN_ID" in env:
        world = _int(env, "WORLD_SIZE", 1) or 1
        local_world = _int(env, "LOCAL_WORLD_SIZE", 1) or 1
        return Launch(
            launcher="torchrun", rank=_int(env, "RANK", 0) or 0, world_size=world,
            local_rank=_int(env, "LOCAL_RANK", 0) or 0, local_world_size=local_world,
            node_rank=_int(env, "GROUP_RANK", 0) or 0,
            num_nodes=_int(env, "GROUP_WORLD_SIZE", max(1, world // local_world)) or 1,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT"),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        )
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in _SLURM_INTERACTIVE_NAMES:
        return _slurm_launch(env, devices)
    launch = Launch(launcher="lightning" if "LOCAL_RANK" in env else "none")
    if "SLURM_NTASKS" in env:
        launch.notes.append(f"SLURM job named {env.get('SLURM_JOB_NAME')!r}: Lightning ignores SLURM here and "
                            "starts the processes itself.")
    nodes = num_nodes or 1
    per_node = devices or _default_devices()
    launch.num_nodes = nodes
    launch.local_world_size = per_node
    launch.node_rank = _int(env, "NODE_RANK", 0) or 0
    launch.local_rank = _int(env, "LOCAL_RANK", 0) or 0
    launch.world_size = _int(env, "WORLD_SIZE", per_node * nodes) or 1
    launch.rank = launch.node_rank * per_node + launch.local_rank
    launch.master_addr = env.get("MASTER_ADDR", "127.0.0.1")
    launch.master_port = _int(env, "MASTER_PORT")
    if nodes > 1 and ("MASTER_ADDR" not in env or "MASTER_PORT" not in env):
        launch.problems.append(Problem(
            f"--num-nodes {nodes} without a launcher, but MASTER_ADDR={env.get('MASTER_ADDR', '(unset)')} "
            f"MASTER_PORT={env.get('MASTER_PORT', '(unset)')}: each node would wait for itself.",
            "on every node export MASTER_ADDR=<node 0's address> MASTER_PORT=<a free port, same everywhere> and "
            "NODE_RANK=<0..N-1>, or use torchrun/srun.", blocking=True))
    return launch


def _slurm_launch(env: dict[str, str], devices: int | None) -> Launch:
    ntasks = _int(env, "SLURM_NTASKS", 1) or 1
    nnodes = _int(env, "SLURM_NNODES", _int(env, "SLURM_JOB_NUM_NODES", 1)) or 1
    per_node_raw = env.get("SLURM_NTASKS_PER_NODE")
    per_node = _int(env, "SLURM_NTASKS_PER_NODE") or max(1, ntasks // nnodes)
    job_id = env.get("SLURM_JOB_ID")
    port = _int(env, "MASTER_PORT") or (int(job_id[-4:]) + 15000 if job_id and job_id[-4:].isdigit() else 12910)
    nodelist = env.get("SLURM_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
    launch = Launch(
        launcher="slurm", rank=_int(env, "SLURM_PROCID", 0) or 0, world_size=ntasks,
        local_rank=_int(env, "SLURM_LOCALID", 0) or 0, local_world_size=per_node,
        node_rank=_int(env, "SLURM_NODEID", 0) or 0, num_nodes=nnodes,
        master_addr=env.get("MASTER_ADDR") or slurm_root_node(nodelist), master_port=port,
    )
    if ntasks > 1 and per_node_raw is None:
        even = ntasks // nnodes if ntasks % nnodes == 0 else None
        layout = f"-N{nnodes} --ntasks-per-node={even}" if even else f"--nodes=N --ntasks-per-node=D with N*D={ntasks}"
        launch.problems.append(Problem(
            f"SLURM started {ntasks} tasks with -n/--ntasks={ntasks} and no --ntasks-per-node "
            f"(SLURM_NTASKS={ntasks}, SLURM_NTASKS_PER_NODE unset, SLURM_NNODES={nnodes}). Lightning refuses this: "
            f"\"You set `--ntasks={ntasks}` in your SLURM bash script, but this variable is not supported.\"",
            f"use `srun {layout}` (or `#SBATCH --nodes={nnodes}` + `#SBATCH --ntasks-per-node={even or 'D'}`), "
            "with --ntasks-per-node equal to Trainer(devices=...)."))
    elif per_node_raw is not None and devices is not None and per_node != devices:
        launch.problems.append(Problem(
            f"SLURM --ntasks-per-node={per_node} (SLURM_NTASKS_PER_NODE={per_node_raw}) but --devices {devices}: "
            f"Lightning stops with \"the number of tasks per node configured in SLURM does not match\".",
            f"use --ntasks-per-node={devices}, or devices={per_node}."))
    return launch


def _default_devices() -> int:
    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


# --------------------------------------------------------------------------------------------------
# what this rank sees


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def interface_addresses() -> dict[str, str]:
    """IPv4 address of every interface that has one (``{"lo": "127.0.0.1", "eth0": ...}``)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                out[name] = socket.inet_ntoa(packed[20:24])
            except OSError:
                out.setdefault(name, "")
    return out


def _resolve(host: str) -> list[str]:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def gloo_default_address(hostname: str) -> tuple[str, str]:
    """The address gloo binds when GLOO_SOCKET_IFNAME is unset, and how it got there.

    Mirrors ``ProcessGroupGloo::createDefaultDevice``: resolve the hostname and take the first
    address that can be bound; if none can, fall back to loopback.
    """
    try:
        candidates = _resolve(hostname)
    except OSError as err:
        return "127.0.0.1", f"hostname {hostname!r} does not resolve ({err.strerror}); gloo falls back to loopback"
    for ip in candidates:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((ip, 0))
            return ip, f"hostname {hostname!r} resolves to {ip}"
        except OSError:
            continue
    return "127.0.0.1", f"hostname {hostname!r} resolves to {', '.join(candidates)}, none bindable here; loopback"


def route_interface(target_ip: str, addresses: dict[str, str]) -> tuple[str, str]:
    """The (interface, source address) this host uses to reach ``target_ip``; ``("", "")`` if unknown."""
    source = local_address(target_ip)  # the kernel's route choice; no packet is sent
    if source == "?":
        return "", ""
    names = [name for name, ip in addresses.items() if ip == source]
    return (names[0] if names else ""), source


def _is_private(ip: str) -> bool:
    """Loopback, RFC 1918 / unique-local, link-local or CGNAT (100.64/10): not reachable from the internet."""
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return False
    return addr.is_loopback or addr.is_private or addr.is_link_local or addr in ipaddress.ip_network("100.64.0.0/10")


def security_notes(master_addr: str, master_ips: list[str], interfaces: dict[str, str], port: int | None) -> list[str]:
    """Warnings about who else can reach the rendezvous store and the process group.

    The store rank 0 serves (torch's ``TCPStore``) binds every interface (``*:PORT``), whatever
    MASTER_ADDR is, and takes writes without authentication; the process group and the object
    collectives unpickle what peers send. So both must only be reachable from the job's own nodes.
    Pure: looks at addresses only, sends nothing.
    """
    notes = []
    public_master = [ip for ip in master_ips if not _is_private(ip)]
    if public_master:
        notes.append(
            f"security: MASTER_ADDR={master_addr} is a public address ({', '.join(public_master)}). The rendezvous "
            "store and the process group have no authentication and unpickle what peers send: anyone who reaches "
            "them can disrupt the job or run code in it. Use the nodes' private (cluster) addresses, or a firewall "
            "that admits only the job's nodes (see docs/security.md).")
    exposed = {name: ip for name, ip in interfaces.items() if ip and not _is_private(ip)}
    if exposed:
        where = ", ".join(f"{name} {ip}" for name, ip in exposed.items())
        notes.append(
            f"security: this host has public interface address(es) ({where}); the rendezvous store on rank 0 "
            f"listens on every interface (*:{port if port is not None else 'MASTER_PORT'}), even with "
            "MASTER_ADDR=127.0.0.1, so it is reachable there. Block MASTER_PORT and the gloo/NCCL ports on those "
            "interfaces (see docs/security.md).")
    return notes


def _versions() -> dict[str, str]:
    def dist_version(*names: str) -> str:
        for name in names:
            try:
                return _package_version(name)
            except metadata.PackageNotFoundError:
                continue
        return "-"

    nccl = "-"
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(part) for part in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
        except Exception:  # noqa: BLE001 - a build without NCCL
            nccl = "none"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "lightning": dist_version("lightning", "pytorch-lightning"),
            "lightning_sync": dist_version("lightning_sync"), "nccl": nccl}


@dataclass
class Report:
    """Everything one rank found, exchanged through the store (JSON)."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    num_nodes: int
    launcher: str
    hostname: str
    master: str
    master_ips: list[str]
    backend: str
    gloo_iface: str
    gloo_addr: str
    gloo_how: str
    route_iface: str
    interfaces: dict[str, str]
    versions: dict[str, str]
    cuda_visible: str
    cuda_count: int
    problems: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    reach: str = ""
    group: str = "not tried"

    @property
    def who(self) -> str:
        return f"rank {self.rank} (node {self.node_rank}, host {self.hostname})"


def check_rank(launch: Launch, devices: int | None, num_nodes: int | None, backend: str, accelerator: str) -> Report:
    """Every check one rank can make on its own, before talking to anyone."""
    env = os.environ
    hostname = socket.gethostname()
    addresses = interface_addresses()
    problems = list(launch.problems)
    report = Report(
        rank=launch.rank, world_size=launch.world_size, local_rank=launch.local_rank, node_rank=launch.node_rank,
        num_nodes=launch.num_nodes, launcher=launch.launcher, hostname=hostname,
        master=f"{launch.master_addr}:{launch.master_port}", master_ips=[], backend=backend, gloo_iface="",
        gloo_addr="", gloo_how="", route_iface="", interfaces=addresses, versions=_versions(),
        cuda_visible=env.get("CUDA_VISIBLE_DEVICES", "(unset)"),
        cuda_count=torch.cuda.device_count() if torch.cuda.is_available() else 0, notes=list(launch.notes))
    who = f"rank {launch.rank} on {hostname}"
    multi_node = max(launch.num_nodes, num_nodes or 1) > 1

    # world size against devices x num_nodes
    want_nodes = num_nodes if num_nodes is not None else launch.num_nodes
    if devices is not None:
        expected = devices * want_nodes
        if launch.world_size != expected:
            problems.append(Problem(
                f"world size mismatch: the {launch.launcher} launch has WORLD_SIZE={launch.world_size} "
                f"({launch.num_nodes} node(s) x {launch.local_world_size} process(es)) but devices({devices}) x "
                f"num_nodes({want_nodes}) = {expected}.", _world_fix(launch.launcher, devices, want_nodes)))
    elif num_nodes is not None and num_nodes != launch.num_nodes:
        problems.append(Problem(
            f"the launch spans {launch.num_nodes} node(s) but --num-nodes {num_nodes}.",
            f"start the job on {num_nodes} nodes or pass num_nodes={launch.num_nodes}."))

    # MASTER_ADDR
    try:
        report.master_ips = _resolve(launch.master_addr)
    except OSError as err:
        problems.append(Problem(
            f"{who} cannot resolve MASTER_ADDR={launch.master_addr!r}: {err.strerror}.",
            "use node 0's IP address, or a name every node resolves (DNS or /etc/hosts).", blocking=True))
    if report.master_ips and multi_node and launch.node_rank != 0 and all(_is_loopback(ip) for ip in report.master_ips):
        problems.append(Problem(
            f"{who} (node {launch.node_rank}) resolves MASTER_ADDR={launch.master_addr} to "
            f"{', '.join(report.master_ips)} (loopback) in a {max(launch.num_nodes, num_nodes or 1)}-node job: "
            "it would talk to itself, not to node 0.",
            f"set MASTER_ADDR to node 0's routable address, or map {launch.master_addr} to it in /etc/hosts on "
            "this node.", blocking=True))
    report.notes.extend(security_notes(launch.master_addr, report.master_ips, addresses, launch.master_port))
    master_ip = next((ip for ip in report.master_ips if ":" not in ip), "")
    report.route_iface = route_interface(master_ip, addresses)[0] if master_ip else ""
    if report.route_iface in ("lo", "") and master_ip and _is_loopback(master_ip):
        report.route_iface = ""

    # the interface gloo / NCCL will use
    here = f" (here: {report.route_iface})" if report.route_iface else ""
    gloo_ifname = env.get("GLOO_SOCKET_IFNAME", "")
    if gloo_ifname:
        names = [n.strip() for n in gloo_ifname.split(",") if n.strip()]
        missing = [n for n in names if n not in addresses]
        report.gloo_iface = gloo_ifname
        report.gloo_addr = ",".join(addresses.get(n, "?") for n in names)
        report.gloo_how = f"GLOO_SOCKET_IFNAME={gloo_ifname}"
        if missing:
            have = ", ".join(f"{n} {a}" if a else n for n, a in addresses.items())
            problems.append(Problem(
                f"{who}: GLOO_SOCKET_IFNAME={gloo_ifname} but this host has no interface {', '.join(missing)} "
                f"(it has: {have}). Interface names often differ across nodes.",
                f"set GLOO_SOCKET_IFNAME per node to the interface that reaches MASTER_ADDR{here}, or unset it and "
                "map each hostname to its routable address in /etc/hosts.", blocking=backend == "gloo"))
        elif multi_node and any(_is_loopback(addresses[n]) for n in names):
            problems.append(Problem(
                f"{who}: GLOO_SOCKET_IFNAME={gloo_ifname} is a loopback interface in a multi-node job.",
                f"use the interface that reaches MASTER_ADDR{here}.",
                blocking=backend == "gloo"))
    else:
        report.gloo_addr, report.gloo_how = gloo_default_address(hostname)
        report.gloo_iface = next((n for n, a in addresses.items() if a == report.gloo_addr), "")
    if backend == "nccl":
        nccl_ifname = env.get("NCCL_SOCKET_IFNAME", "")
        if nccl_ifname and not nccl_ifname.startswith("^"):
            prefixes = [p.strip() for p in nccl_ifname.split(",") if p.strip()]
            exact = any(p.startswith("=") for p in prefixes)
            ok = any((n == p.lstrip("=")) if exact else n.startswith(p) for p in prefixes for n in addresses)
            if not ok:
                problems.append(Problem(
                    f"{who}: NCCL_SOCKET_IFNAME={nccl_ifname} matches no interface here ({', '.join(addresses)}).",
                    f"set it to a prefix of the interface that reaches MASTER_ADDR{here}.", blocking=True))

    # GPUs
    if accelerator == "gpu":
        if report.cuda_count == 0:
            problems.append(Problem(
                f"{who}: accelerator gpu but no CUDA device is visible (CUDA_VISIBLE_DEVICES={report.cuda_visible}, "
                f"torch {torch.__version__}, CUDA build {torch.version.cuda}).",
                "check the allocation (--gres=gpu:N / --gpus-per-node=N) and that torch is a CUDA build.",
                blocking=True))
        elif launch.local_rank >= report.cuda_count:
            problems.append(Problem(
                f"{who}: local rank {launch.local_rank} but only {report.cuda_count} GPU(s) visible "
                f"(CUDA_VISIBLE_DEVICES={report.cuda_visible}).",
                "give each node as many GPUs as processes per node (one GPU per local rank); with srun avoid "
                "--gpus-per-task=1 binding, Lightning expects every task to see all the node's GPUs.", blocking=True))
    report.problems = [asdict(p) for p in problems]
    return report


def _world_fix(launcher: str, devices: int, nodes: int) -> str:
    if launcher == "torchrun":
        return f"run torchrun --nnodes={nodes} --nproc_per_node={devices}, or pass the launcher's layout to Trainer."
    if launcher == "slurm":
        return (f"use #SBATCH --nodes={nodes} and --ntasks-per-node={devices} (srun inherits them), or pass the "
                "allocation's layout to Trainer.")
    return f"use Trainer(devices={devices}, num_nodes={nodes}) with WORLD_SIZE={devices * nodes}, or fix WORLD_SIZE."


# --------------------------------------------------------------------------------------------------
# what the ranks see together


def diagnose(reports: dict[int, Report], world_size: int, num_nodes: int | None) -> list[Problem]:
    """Problems visible only when comparing ranks. Every rank computes the same list from the same reports."""
    problems: list[Problem] = []
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        problems.append(Problem(
            f"rank(s) {', '.join(map(str, missing))} never reported: they could not reach MASTER_ADDR:MASTER_PORT, "
            "were not started, or crashed.",
            "read those ranks' own output (each prints what it found); check that every node resolves and reaches "
            "MASTER_ADDR.", blocking=True))
    sizes = {r: rep.world_size for r, rep in sorted(reports.items())}
    if len(set(sizes.values())) > 1:
        problems.append(Problem(
            "ranks disagree on the world size: " + ", ".join(f"rank {r} {s}" for r, s in sizes.items()) + ".",
            "start every node with the same --nnodes/--nproc_per_node (or WORLD_SIZE).", blocking=True))
    for key in ("python", "torch", "lightning", "lightning_sync", "nccl"):
        values = {r: rep.versions.get(key, "-") for r, rep in sorted(reports.items())}
        if len(set(values.values())) > 1:
            problems.append(Problem(
                f"{key} versions differ across ranks: " + ", ".join(f"rank {r} {v}" for r, v in values.items()) + ".",
                "install the same environment on every node (one container image or one shared venv)."))
    nodes = max([num_nodes or 1] + [rep.num_nodes for rep in reports.values()]
                + [len({rep.node_rank for rep in reports.values()})])
    if nodes > 1:
        loop = {r: rep for r, rep in sorted(reports.items())
                if rep.backend == "gloo" and rep.gloo_addr and all(_is_loopback(a) for a in rep.gloo_addr.split(","))}
        if loop:
            per_node = {rep.node_rank: rep.route_iface for rep in reports.values() if rep.route_iface}
            names = set(per_node.values())
            known_nodes = len({rep.node_rank for rep in reports.values()})
            if len(names) == 1 and known_nodes < nodes:
                node, name = next(iter(per_node.items()))
                fix = (f"set GLOO_SOCKET_IFNAME={name} on node {node} (on each node: its interface that reaches "
                       "MASTER_ADDR)")
            elif len(names) == 1:
                fix = f"export GLOO_SOCKET_IFNAME={names.pop()} on every node"
            elif names:
                fix = ("set GLOO_SOCKET_IFNAME per node to the interface that reaches MASTER_ADDR: "
                       + ", ".join(f"node {n} {i}" for n, i in sorted(per_node.items())))
            else:
                fix = "set GLOO_SOCKET_IFNAME to the interface that reaches MASTER_ADDR"
            by_cause: dict[str, list[str]] = {}
            for r, rep in loop.items():
                by_cause.setdefault(rep.gloo_how, []).append(f"{r} (node {rep.node_rank})")
            ranks = "; ".join(f"{_plural_ranks(rs)}: {how}" for how, rs in by_cause.items())
            problems.append(Problem(
                f"gloo would bind loopback in a {nodes}-node job, so peers on other nodes cannot connect "
                f"(gloo fails with \"connectFullMesh ... Connection refused\" or hangs): {ranks}.",
                f"{fix} (or give each node a hosts entry mapping its hostname to its routable address).",
                blocking=True))
    return problems


# --------------------------------------------------------------------------------------------------
# rendezvous, group test, output


def _connect_store(launch: Launch, timeout: float) -> tuple[Store | None, str, Problem | None]:
    """Rank 0 serves the store (unless torchrun's agent does); the others probe, then connect."""
    port = launch.master_port
    if port is None:
        return None, "", Problem(f"rank {launch.rank}: MASTER_PORT is not set.",
                                 "export MASTER_PORT=<a free port, the same on every node>.", blocking=True)
    serve = launch.rank == 0 and not launch.agent_store
    if serve:
        try:
            store = TCPStore(launch.master_addr, port, None, True, timedelta(seconds=timeout), wait_for_workers=False)
        except (RuntimeError, OSError) as err:
            busy = "address already in use" in str(err).lower() or getattr(err, "errno", None) == errno.EADDRINUSE
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__  # no C++ frames
            if busy:
                return None, "", Problem(
                    f"MASTER_PORT={port} is already in use on {socket.gethostname()} (rank 0): another job or a "
                    "stale process holds it.", "pick another free port: export MASTER_PORT=<port> (same on every "
                    "node), or stop the stale process.", blocking=True)
            return None, "", Problem(
                f"rank 0 could not serve the store at MASTER_ADDR:MASTER_PORT = {launch.master_addr}:{port}: {first}",
                "set MASTER_ADDR to an address of rank 0's host (`hostname -I`), reachable from every node.",
                blocking=True)
        return store, "serves the store", None
    start = time.monotonic()
    deadline = start + timeout
    last = "no attempt"
    while True:
        try:
            with socket.create_connection((launch.master_addr, port), timeout=min(2.0, timeout)):
                pass
            break
        except OSError as err:
            last = err.strerror or type(err).__name__
        if time.monotonic() >= deadline:
            return None, f"unreachable: {last}", Problem(
                f"rank {launch.rank} on {socket.gethostname()} cannot reach MASTER_ADDR:MASTER_PORT = "
                f"{launch.master_addr}:{port} within {timeout:.0f} s ({last}).",
                "check that rank 0 runs, that MASTER_ADDR is node 0's routable address on this node "
                "(`getent hosts MASTER_ADDR`) and that no firewall blocks the port.", blocking=True)
        time.sleep(0.2)
    reach = f"ok {time.monotonic() - start:.2f}s"
    try:
        store = TCPStore(launch.master_addr, port, None, False, timedelta(seconds=timeout))
    except (RuntimeError, OSError) as err:
        return None, reach, Problem(f"rank {launch.rank} reached {launch.master_addr}:{port} but the store "
                                    f"handshake failed: {err}", "make sure nothing else listens on MASTER_PORT.",
                                    blocking=True)
    return store, reach, None


def _wait_keys(store: Store, keys: list[str], timeout: float) -> dict[str, bytes]:
    """Fetch the keys that appear within ``timeout`` seconds (missing ones are left out)."""
    deadline = time.monotonic() + timeout
    found: dict[str, bytes] = {}
    pending = list(keys)
    while pending:
        still = []
        for key in pending:
            if store.check([key]):
                found[key] = store.get(key)
            else:
                still.append(key)
        pending = still
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return found


def _group_test(launch: Launch, store: Store, backend: str, timeout: float) -> str:
    from lightning_sync import collectives  # rank-safe collectives; imports torch only

    start = time.monotonic()
    # gloo can wait in connectFullMesh far beyond the group timeout (seen: > 60 s with timeout=15 s)
    watchdog = threading.Timer(timeout + 15, _hung, args=(launch.rank, timeout + 15))
    watchdog.daemon = True
    watchdog.start()
    try:
        if backend == "nccl":
            torch.cuda.set_device(launch.local_rank)
        dist.init_process_group(backend, store=PrefixStore("pg", store), rank=launch.rank,
                                world_size=launch.world_size, timeout=timedelta(seconds=timeout))
        joined = time.monotonic() - start
        value = torch.tensor([launch.rank + 1.0])
        total = float(collectives.all_reduce(value, op="sum")[0])
        expected = launch.world_size * (launch.world_size + 1) / 2
        collectives._device_barrier()
        dist.destroy_process_group()  # clean teardown on every rank (docs/strategy.md: the gloo teardown crash)
        if total != expected:
            return f"FAILED: all_reduce sum {total} != {expected}"
        return f"ok (join {joined:.2f}s, all_reduce {time.monotonic() - start - joined:.3f}s)"
    except Exception as err:  # noqa: BLE001 - reported, then every rank exits 1
        text = " ".join(str(err).split())[:300]
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        return f"FAILED after {time.monotonic() - start:.1f}s: {type(err).__name__}: {text}"
    finally:
        watchdog.cancel()


def _hung(rank: int, seconds: float) -> None:
    print(f"lsync-doctor [rank {rank} {socket.gethostname()}]: joining the process group hung for {seconds:.0f} s "
          "(the group timeout did not fire): some rank cannot connect to another. See the findings of the other "
          "ranks, or set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface that reaches MASTER_ADDR.",
          file=sys.stderr, flush=True)
    os._exit(1)


def _table(reports: dict[int, Report], world_size: int) -> str:
    head = ("rank", "node", "host", "local", "MASTER_ADDR -> ip", "gloo iface addr", "versions", "store", "group")
    rows = [head]
    for r in range(world_size):
        rep = reports.get(r)
        if rep is None:
            rows.append((str(r), "?", "?", "?", "?", "?", "?", "no report", "-"))
            continue
        v = rep.versions
        vers = f"py{v['python']} torch{v['torch']} L{v['lightning']}"
        vers += f" nccl{v['nccl']}" if v["nccl"] != "-" else ""
        rows.append((str(r), str(rep.node_rank), rep.hostname, str(rep.local_rank),
                     f"{rep.master.split(':')[0]} -> {','.join(rep.master_ips) or '?'}",
                     f"{rep.gloo_iface or '?'} {rep.gloo_addr}", vers, rep.reach, rep.group))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _merge(found: list[tuple[int, Problem]]) -> list[Problem]:
    """One entry per distinct problem; the same finding on several ranks names them all."""
    ranks: dict[tuple[str, str], list[int]] = {}
    first: dict[tuple[str, str], Problem] = {}
    for rank, problem in found:
        key = (problem.text, problem.fix)
        ranks.setdefault(key, []).append(rank)
        first.setdefault(key, problem)
    merged = []
    for key, problem in first.items():
        on = ranks[key]
        prefix = "" if problem.text.startswith("rank ") else f"[{_plural_ranks([str(r) for r in on])}] "
        merged.append(Problem(prefix + problem.text, problem.fix, problem.blocking))
    return merged


def _plural_ranks(ranks: list[str]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"


def _render_problems(problems: list[Problem]) -> str:
    return "\n".join(f"{i}. {p.render()}" for i, p in enumerate(problems, 1))


def run_rank(args: argparse.Namespace) -> int:
    """The doctor on one rank: checks, report exchange, group test, verdict. Returns the exit code."""
    return _run_rank(args)[0]


def _run_rank(args: argparse.Namespace) -> tuple[int, bool]:
    """:func:`run_rank`, plus whether this rank got as far as the store."""
    launch = detect_launch(dict(os.environ), args.devices, args.num_nodes)
    accelerator = args.accelerator if args.accelerator != "auto" else ("gpu" if torch.cuda.is_available() else "cpu")
    backend = args.backend if args.backend != "auto" else ("nccl" if accelerator == "gpu" else "gloo")
    report = check_rank(launch, args.devices, args.num_nodes, backend, accelerator)
    tag = f"lsync-doctor [rank {launch.rank} {report.hostname}]"

    known: list[Problem] = []

    def own_findings(cause: str) -> int:
        if not known:  # what this rank's report alone shows (e.g. gloo on loopback in a multi-node job)
            alone = diagnose({report.rank: report}, 1, args.num_nodes)
            known.extend(p for p in alone if "never reported" not in p.text)
        probs = [Problem(**p) for p in report.problems] + [p for p in known if asdict(p) not in report.problems]
        print(f"{tag}: {cause}\n{_render_problems(probs) if probs else '(no problem found on this rank)'}",
              file=sys.stderr, flush=True)
        return 1

    if any(p.blocking for p in launch.problems):
        return own_findings("cannot start: the rendezvous is not configured."), False
    if not report.master_ips:  # the store could never be served or reached: say why now, not after a timeout
        return own_findings(f"cannot start: MASTER_ADDR={launch.master_addr!r} does not resolve."), False
    store, report.reach, store_problem = _connect_store(launch, args.timeout)
    if store is None:
        assert store_problem is not None
        report.problems.append(asdict(store_problem))
        return own_findings("could not reach rank 0's store, so no report from the other ranks."), False
    run = os.environ.get("TORCHELASTIC_RUN_ID", os.environ.get("SLURM_JOB_ID", "local"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_STEP_ID", "0"))
    store = PrefixStore(f"{_STORE_PREFIX}/{run}/{attempt}", store)
    world = launch.world_size

    store.set(f"report/{launch.rank}", json.dumps(asdict(report)))
    raw = _wait_keys(store, [f"report/{r}" for r in range(world)], args.timeout)
    reports = {int(k.split("/")[1]): Report(**json.loads(v)) for k, v in raw.items()}
    problems = _merge([(r, Problem(**p)) for r in sorted(reports) for p in reports[r].problems])
    problems += diagnose(reports, world, args.num_nodes)
    known.extend(p for p in problems if not p.text.startswith(f"[rank {launch.rank}]"))

    if any(p.blocking for p in problems) and not args.always_join:
        report.group = "skipped"
    else:
        report.group = _group_test(launch, store, backend, args.timeout)
    store.set(f"group/{launch.rank}", report.group)

    if launch.rank != 0:
        verdict = _wait_keys(store, ["verdict"], args.timeout + 10)
        if "verdict" not in verdict:
            return own_findings("rank 0 never sent its verdict (it died or could not join)."), True
        failed = verdict["verdict"] != b"ok"
        if failed:
            print(f"{tag}: FAILED, see rank 0's report (group: {report.group})", file=sys.stderr, flush=True)
        store.add("done", 1)
        return (1 if failed else 0), True

    groups = _wait_keys(store, [f"group/{r}" for r in reports], args.timeout + 5)
    for r, rep in reports.items():
        rep.group = groups.get(f"group/{r}", b"no answer").decode()
    reports[0].group = report.group
    failed_groups = {r: rep.group for r, rep in sorted(reports.items()) if not rep.group.startswith(("ok", "skipped"))}
    if failed_groups:
        problems.append(Problem(
            "the process group test failed: " + "; ".join(f"rank {r} {g}" for r, g in failed_groups.items()) + ".",
            "see the findings above; with none, raise --timeout (slow start-up) or run with "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL TORCH_CPP_LOG_LEVEL=INFO to see where it stops.", blocking=True))
    nodes = len({rep.node_rank for rep in reports.values()})
    print(f"lsync-doctor: launcher {launch.launcher}, {world} rank(s) on {nodes} node(s), backend {backend}, "
          f"MASTER_ADDR:MASTER_PORT {report.master}")
    print(_table(reports, world))
    notes = sorted({n for rep in reports.values() for n in rep.notes})
    for note in notes:
        print(f"note: {note}")
    if problems:
        skipped = report.group == "skipped"
        print(f"\nPROBLEMS ({len(problems)}){' - process group not joined, it could not form' if skipped else ''}:")
        print(_render_problems(problems), flush=True)
    else:
        print(f"\nOK: {world} rank(s) joined a {backend} group and all_reduce agreed. Train with "
              f"devices={launch.local_world_size}, num_nodes={nodes} under the same launcher.", flush=True)
    store.set("verdict", "fail" if problems else "ok")
    _wait_keys_count(store, "done", world - 1, 10.0)  # keep serving the store until every rank has read it
    return (1 if problems else 0), True


def _wait_keys_count(store: Store, key: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while count > 0 and store.add(key, 0) < count and time.monotonic() < deadline:
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------------
# no launcher: start the local ranks ourselves, as Lightning's subprocess launcher does


def spawn_local(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``devices - 1`` copies of this command with LOCAL_RANK=1.., run local rank 0 here, reap all."""
    launch = detect_launch(dict(os.environ), args.devices, args.num_nodes)
    if launch.problems:
        print("lsync-doctor: cannot start:\n" + _render_problems(launch.problems), file=sys.stderr)
        return 1
    try:  # before starting anything: every rank would only fail the same way
        _resolve(launch.master_addr)
    except OSError as err:
        print(f"lsync-doctor: cannot start: MASTER_ADDR={launch.master_addr!r} does not resolve ({err.strerror}).\n"
              "   Fix: use node 0's IP address, or a name every node resolves (DNS or /etc/hosts); for one machine "
              "unset MASTER_ADDR (127.0.0.1).", file=sys.stderr)
        return 1
    os.environ["MASTER_ADDR"] = launch.master_addr
    os.environ["MASTER_PORT"] = str(launch.master_port or free_port())
    os.environ["NODE_RANK"] = str(launch.node_rank)
    os.environ["LOCAL_RANK"] = "0"
    os.environ["WORLD_SIZE"] = str(launch.local_world_size * launch.num_nodes)
    children = []
    for local_rank in range(1, launch.local_world_size):
        env = dict(os.environ, LOCAL_RANK=str(local_rank))
        children.append(subprocess.Popen([sys.executable, "-m", "lightning_sync.doctor", *argv], env=env))
    reached = False
    try:
        code, reached = _run_rank(args)
    finally:
        # without rank 0's store the other local ranks can only time out: stop them now
        deadline = time.monotonic() + (args.timeout + 20 if reached else 1.0)
        for child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                if reached:
                    print(f"lsync-doctor: local rank {children.index(child) + 1} did not finish; killed.",
                          file=sys.stderr)
    codes = [code] + [child.returncode for child in children]
    return 0 if all(c == 0 for c in codes) else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lsync-doctor", description="Preflight for multi-process / multi-node lightning_sync runs: run it "
        "under the same launcher and with the same devices/num_nodes as training.")
    parser.add_argument("--devices", type=int, default=None,
                        help="processes per node, as Trainer(devices=...); without a launcher, how many to spawn")
    parser.add_argument("--num-nodes", type=int, default=None, help="as Trainer(num_nodes=...)")
    parser.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="auto: nccl on GPU, gloo on CPU")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds for each step: reaching the store, waiting for reports, joining the group")
    parser.add_argument("--always-join", action="store_true",
                        help="try the process group even when a finding says it cannot form")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``lsync-doctor``); returns the exit code (0 healthy, 1 problems found).
    ``lsync-doctor invariance ...`` runs :func:`lightning_sync.testing.main` (the world-size invariance check)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["invariance"]:  # lsync-doctor invariance MODULE:MODEL MODULE:TRAIN [MODULE:VAL] ...
        from lightning_sync.testing import main as invariance_main

        return invariance_main(argv[1:])
    args = _parser().parse_args(argv)
    for name in ("devices", "num_nodes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            _parser().error(f"--{name.replace('_', '-')} must be >= 1; got {value}.")
    launch = detect_launch(dict(os.environ), args.devices, args.num_nodes)
    if launch.launcher == "none":
        return spawn_local(args, argv)
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
