"""`ddp-amp run` and `ddp-amp multinode`: what torchrun's agent is asked to do on this node (ElasticJob), the
equivalent torchrun command line, the network detection and failure reports (the Slurm job: launch.slurm).

ddp_amp.launch.agent runs the job with torchrun's own agent in this process; `--dry-run` prints the torchrun
command that does the same job by hand.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shlex
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ddp_amp import network
from ddp_amp.errors import RunFailed, UsageError
from ddp_amp.network import Endpoint
from ddp_amp.process import usable_cores

WORKER_MODULE = "ddp_amp.worker"


def check_rendezvous_timeout(rdzv_timeout: float) -> None:
    if rdzv_timeout <= 0:
        raise UsageError(f"--rdzv-timeout must be > 0 seconds, got {rdzv_timeout:g}")


def check_restart_options(max_restarts: int, monitor_interval: float) -> None:
    if max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {max_restarts}")
    if not monitor_interval > 0:
        raise UsageError(f"--monitor-interval must be > 0 seconds, got {monitor_interval:g}")


@dataclass(frozen=True)
class Nnodes:
    min: int
    max: int

    def __str__(self) -> str:
        return str(self.min) if self.min == self.max else f"{self.min}:{self.max}"


def parse_nnodes(text: str) -> Nnodes:
    """N or MIN:MAX (an elastic range), as torchrun takes it."""
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high) if sep else int(low)
    except ValueError:
        raise UsageError(f"--nnodes {text!r} is not N or MIN:MAX") from None
    if lo < 1:
        raise UsageError(f"--nnodes must be >= 1, got {text!r}")
    if hi < lo:
        raise UsageError(f"--nnodes {text!r}: MAX is smaller than MIN")
    return Nnodes(lo, hi)


NPROC_WORDS = ("gpu", "cpu", "auto")
"""--nproc-per-node's words, as torchrun takes them: a GPU count, a core count, or the first where there is one."""


def parse_nproc(text: str) -> int:
    """--nproc-per-node: a count, or torchrun's gpu / cpu / auto, resolved to a count here so it is shown. The one
    reading of it: spawn, run, multinode, bench and doctor."""
    if text.lstrip("-").isdigit():
        count = int(text)
        if count < 1:
            raise UsageError(f"--nproc-per-node must be >= 1, got {count}")
        return count
    if text not in NPROC_WORDS:
        raise UsageError(f"--nproc-per-node {text!r} is not a number, gpu, cpu or auto")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if text == "gpu" and gpus == 0:
        raise UsageError("--nproc-per-node gpu: no CUDA GPU is visible")
    if text == "gpu" or (text == "auto" and gpus):
        return gpus
    return os.cpu_count() or 1


def nproc_before_torch(text: str) -> int | None:
    """--nproc-per-node checked before torch is imported: a count, or None for gpu, cpu and auto (parse_nproc
    resolves them with torch's answer later); a bad word or count is refused now, before anything starts."""
    return None if text in NPROC_WORDS else parse_nproc(text)


@dataclass
class TorchrunCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for torchrun on top of the inherited environment."""

    def shell(self) -> str:
        """The copy-pasteable command line, environment included."""
        prefix = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items()))
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


def cpu_threads_env(nproc_per_node: int, device_type: str) -> dict[str, str]:
    """torchrun sets OMP_NUM_THREADS=1 for several ranks; give each CPU rank its share of the cores instead,
    as spawn does, so both launchers train at the same speed. A user's own OMP_NUM_THREADS wins."""
    if device_type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return {}
    cores = usable_cores()
    return {"OMP_NUM_THREADS": str(max(1, cores // nproc_per_node))}


def threads_env(nproc_per_node: int, device_type: str, script: bool) -> dict[str, str]:
    if script:
        from ddp_amp.launch.script import script_threads_env

        return script_threads_env(nproc_per_node)
    return cpu_threads_env(nproc_per_node, device_type)


def restart_env(max_restarts: int, elastic: bool = False) -> dict[str, str]:
    # With the agent's rendezvous store shared with the workers, restarts failed 4 times in 6 here;
    # with a store of their own, 4 of 4 passed. A node joining an elastic job needs it too: with the shared
    # store, the agents already running never publish the new round's MASTER_ADDR, and the newcomer waits
    # for it until the join timeout.
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if max_restarts > 0 or elastic else {}


@dataclass(frozen=True)
class ElasticJob:
    """One node's share of a torchrun job: what ddp-amp runs with torchrun's agent in-process
    (ddp_amp.launch.agent), and what `torchrun_command` prints for running it by hand."""

    nproc_per_node: int
    nnodes: Nnodes
    rdzv_endpoint: str | None
    """host:port of the c10d store; None: torchrun's --standalone (its own store on a free port)."""
    rdzv_id: str
    rdzv_configs: dict[str, str]
    local_addr: str | None
    max_restarts: int
    monitor_interval: float
    env: dict[str, str]
    """Variables set for the agent and the workers on top of the inherited environment."""
    node_rank: int | None = None

    def torchrun_command(self, config_path: Path, kind: str = "train", script=None) -> TorchrunCommand:
        """`script`: a launch.script.Script run instead of ddp-amp's worker."""
        argv = [sys.executable, "-m", "torch.distributed.run"]
        if self.rdzv_endpoint is None:
            argv += ["--standalone", "--nnodes", str(self.nnodes)]
        else:
            argv += ["--nnodes", str(self.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint,
                     "--rdzv-id", self.rdzv_id]
            if self.rdzv_configs:
                argv += ["--rdzv-conf", ",".join(f"{key}={value}" for key, value in self.rdzv_configs.items())]
        argv += ["--nproc-per-node", str(self.nproc_per_node), "--max-restarts", str(self.max_restarts),
                 "--monitor-interval", f"{self.monitor_interval:g}"]
        if self.node_rank is not None:
            argv += ["--node-rank", str(self.node_rank)]
        if self.local_addr:
            argv += ["--local-addr", self.local_addr]
        if script is not None:
            argv += script.argv()
        else:
            argv += ["-m", WORKER_MODULE, str(config_path), *([kind] if kind != "train" else [])]
        return TorchrunCommand(argv, dict(self.env))


def standalone_job(*, nproc_per_node: int, max_restarts: int, monitor_interval: float, device_type: str,
                   store_port: int | None = None, script: bool = False) -> ElasticJob:
    """One node. store_port: the port of a loopback-only rendezvous store the launcher serves (see
    ddp_amp.dist.loopback_store); without it, torchrun's --standalone, whose stores listen on every interface
    (what --dry-run prints, for a command that runs by hand). `script`: the ranks run a user's script, whose
    threads are torchrun's."""
    env = {**threads_env(nproc_per_node, device_type, script), **restart_env(max_restarts)}
    common = {"nproc_per_node": nproc_per_node, "nnodes": Nnodes(1, 1), "max_restarts": max_restarts,
              "monitor_interval": monitor_interval}
    if store_port is None:
        # standalone: a local c10d store on a free port that torchrun picks, so two jobs never collide.
        return ElasticJob(rdzv_endpoint=None, rdzv_id="none", rdzv_configs={}, local_addr=None, env=env, **common)
    # The agent joins our store as a client (is_host=0); workers get 127.0.0.1 as MASTER_ADDR, and with a
    # store of their own (not the agent's), rank 0 serves it on loopback too (ddp_amp.dist.process_group).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return ElasticJob(rdzv_endpoint=f"127.0.0.1:{store_port}", rdzv_id=f"ddp-amp-{os.getpid()}-{store_port}",
                      rdzv_configs={"is_host": "0"}, local_addr="127.0.0.1", env=env, **common)


def default_rdzv_id(endpoint: Endpoint, nnodes: Nnodes, nproc_per_node: int, run_name: str) -> str:
    """Derived from what every node's command shares, so the same command on every node agrees."""
    digest = hashlib.sha1(f"{endpoint}|{nnodes}|{nproc_per_node}|{run_name}".encode()).hexdigest()
    return f"ddp-amp-{digest[:12]}"


def multinode_job(*, endpoint: Endpoint, nnodes: Nnodes, nproc_per_node: int, node_rank: int | None, rdzv_id: str,
                  is_host: bool | None, local_addr: str | None, ifname_env: dict[str, str] | None,
                  max_restarts: int, monitor_interval: float, rdzv_timeout: float, device_type: str,
                  rdzv_last_call: int = 30, script: bool = False) -> ElasticJob:
    configs = {} if is_host is None else {"is_host": str(int(is_host))}
    # torchrun reads these as whole seconds (a fraction would fail its int() parse in every agent).
    configs["join_timeout"] = str(math.ceil(rdzv_timeout))
    if nnodes.min != nnodes.max:
        configs["last_call_timeout"] = str(rdzv_last_call)
    # A loopback endpoint puts every node on this machine: their ranks share its cores.
    ranks_here = nproc_per_node * (nnodes.max if network.is_loopback(endpoint.host, resolve=True) else 1)
    env = {**threads_env(ranks_here, device_type, script), **restart_env(max_restarts, nnodes.min != nnodes.max),
           **(ifname_env or {})}
    return ElasticJob(nproc_per_node=nproc_per_node, nnodes=nnodes, rdzv_endpoint=str(endpoint), rdzv_id=rdzv_id,
                      rdzv_configs=configs, local_addr=local_addr, max_restarts=max_restarts,
                      monitor_interval=monitor_interval, env=env, node_rank=node_rank)


def node_job(endpoint: Endpoint, nnodes: Nnodes, nproc_per_node: int, net: NodeNetwork, **job):
    """This node's job of a multi-node run, for a device type (known only after the preflight)."""
    return lambda device_type: multinode_job(
        endpoint=endpoint, nnodes=nnodes, nproc_per_node=nproc_per_node, is_host=net.is_host,
        local_addr=net.local_addr, ifname_env=net.ifname_env, device_type=device_type, **job)


IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def restart_causes(torchrun_log: str) -> list[tuple[int, str]]:
    """(local rank, what happened) for each worker failure torchrun logged, restarts included."""
    causes = []
    for match in re.finditer(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", torchrun_log):
        code, local_rank = int(match.group(1)), int(match.group(2))
        if code < 0:
            try:
                causes.append((local_rank, f"died with {signal.Signals(-code).name}"))
                continue
            except ValueError:
                pass
        causes.append((local_rank, f"exited with code {code}"))
    return causes


@dataclass(frozen=True)
class NodeNetwork:
    """What this node tells torchrun about the network, each value detected unless the user gave it."""

    endpoint: Endpoint
    is_host: bool | None
    """None: let torchrun try to host and fall back to joining (several nodes on one machine, loopback)."""
    local_addr: str | None
    ifname_env: dict[str, str]
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to set for torchrun: never one the user exported, unless
    --ifname was given."""
    note: str | None = None
    """One line saying which interface the collectives use, and why."""


def ifname_environment(ifname: str | None, *, given: bool, environ: dict[str, str]) -> tuple[dict[str, str], str]:
    """The interface variables to set, and a line explaining the choice. An explicit --ifname sets both; a
    detected one fills only the variables the user has not exported (their choice may be a fast fabric NIC
    rather than the route to the store)."""
    if given:
        return dict.fromkeys(IFNAME_VARS, ifname), f"collectives on interface {ifname} (--ifname)"
    exported = {var: environ[var] for var in IFNAME_VARS if environ.get(var)}
    if ifname is None:
        if exported:
            return {}, "collectives on " + ", ".join(f"{k}={v}" for k, v in exported.items()) + " (exported)"
        return {}, "collectives on the interface gloo/nccl pick (none detected for the route to the endpoint)"
    env = {var: ifname for var in IFNAME_VARS if var not in exported}
    parts = [f"interface {ifname} (it holds the address that routes to the endpoint)"] if env else []
    parts += [f"{k}={v} (exported, kept)" for k, v in exported.items()]
    return env, "collectives on " + "; ".join(parts)


def detect_node_network(endpoint: Endpoint, *, is_host: bool | None, local_addr: str | None,
                        ifname: str | None, rdzv_timeout: float, check_reachable: bool,
                        environ: dict[str, str] | None = None) -> NodeNetwork:
    """Resolve the endpoint, decide whether this node hosts the c10d store, find the address and interface
    that route to it, and (on other nodes) wait until the store answers. Problems are one-line errors."""
    from ddp_amp import network

    environ = dict(os.environ) if environ is None else environ
    addresses = network.resolve(endpoint)
    if local_addr is not None and not network.is_local_address(local_addr):
        raise UsageError(f"--local-addr {local_addr!r} is not an address of this machine")
    if ifname is not None:
        try:
            socket.if_nametoindex(ifname)
        except OSError:
            raise UsageError(f"--ifname {ifname!r}: no such network interface on this machine") from None
    loopback = all(network.is_loopback(address, resolve=True) for address in addresses)
    if is_host is None and not loopback:
        # A loopback endpoint is "local" to every node on this machine; there torchrun's own try-to-host,
        # else-join fallback is right, and forcing is_host=1 would make every node try to host.
        is_host = any(network.is_local_address(address) for address in addresses)
    given_local_addr = local_addr is not None
    if local_addr is None:
        try:
            local_addr = network.route_source_address(addresses[0], endpoint.port)
        except OSError:
            local_addr = None
    if not loopback and (local_addr is None or network.is_loopback(local_addr, resolve=True)):
        # Advertised, a loopback address (or the hostname torchrun falls back to, which Debian-style hosts map
        # to 127.0.1.1) sends every other node to itself.
        problem = (f"--local-addr {local_addr} is a loopback address" if given_local_addr
                   else f"no non-loopback address of this machine routes to --endpoint {endpoint}")
        raise UsageError(f"{problem}; pass --local-addr with this node's address that the other nodes reach")
    detected_ifname = ifname
    if detected_ifname is None and local_addr and not network.is_loopback(local_addr, resolve=True):
        detected_ifname = network.interface_of(local_addr)
    ifname_env, note = ifname_environment(detected_ifname, given=ifname is not None, environ=environ)
    if check_reachable and is_host is False and not network.wait_until_reachable(addresses[0], endpoint.port,
                                                                               rdzv_timeout):
        raise RunFailed(f"--endpoint {endpoint} could not be reached within {rdzv_timeout:g}s: check that the "
                        "host node (the one owning that address) is running ddp-amp multinode and that the port "
                        "is open between the nodes")
    return NodeNetwork(endpoint, is_host, local_addr, ifname_env, note if not loopback else None)
