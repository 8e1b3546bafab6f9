"""The process group of one rank: the standard environment contract in, a ready device out.

Every launcher ends here: spawn sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT itself; torchrun sets the same. Nothing else about the launcher is known to the core.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from ddp_amp.network import is_loopback
from ddp_amp.process import BLOCKED_WAIT_STOPS, LOOPBACK, usable_cores

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        missing = [key for key in ENV_KEYS if key not in env]
        if missing:
            raise RuntimeError(f"not launched as a distributed worker: {', '.join(missing)} unset")
        return cls(rank=int(env["RANK"]), local_rank=int(env["LOCAL_RANK"]), world_size=int(env["WORLD_SIZE"]),
                   local_world_size=int(env["LOCAL_WORLD_SIZE"]), master_addr=env["MASTER_ADDR"],
                   master_port=int(env["MASTER_PORT"]))

    shares_run_dir_with_rank0: bool = False
    """This node's run directory is rank 0's (a shared file system): settled by `settle_run_dir_writers`."""

    @property
    def writes_run_dir(self) -> bool:
        """Global rank 0 writes the run directory, and so does local rank 0 of every other node whose run
        directory is not the same one (each node holds the weights without a shared file system, and no two
        processes ever write one file)."""
        return self.rank == 0 or (self.local_rank == 0 and not self.shares_run_dir_with_rank0)


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        # One GPU per local rank; the launcher has already checked that there are enough.
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def set_cpu_threads(local_world_size: int) -> int:
    """Give each rank its share of the cores, unless the user chose OMP_NUM_THREADS themselves.

    N ranks each using every core oversubscribe the machine and run slower than N ranks of cores/N threads.
    """
    explicit = os.environ.get("OMP_NUM_THREADS")
    threads = int(explicit) if explicit and explicit.isdigit() else max(1, usable_cores() // local_world_size)
    torch.set_num_threads(threads)
    return threads


def loopback_store(port: int = 0, *, world_size: int | None = None, timeout_s: float = 300,
                   listener: socket.socket | None = None) -> dist.TCPStore:
    """A TCPStore server reachable from this machine only. Given a host and a port, TCPStore listens on every
    interface, unauthenticated; handed a socket already bound to 127.0.0.1, it serves just that one.
    port 0: a port the kernel chooses (store.port tells which). `listener`: that socket, bound and listening
    already (by a launcher without torch, launch.processes.StoreKeeper); `port` is then ignored."""
    if listener is None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((LOOPBACK, port))
            listener.listen(128)
        except BaseException:
            listener.close()
            raise
    try:
        store = dist.TCPStore(LOOPBACK, listener.getsockname()[1], world_size=world_size, is_master=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now and closes it itself
    return store


@contextlib.contextmanager
def process_group(env: DistEnv, device: torch.device, timeout_s: float = 300) -> Iterator[None]:
    """init_process_group from the environment contract, torn down on every path, error path included.

    Where rank 0 must serve the store itself (torchrun without a shared agent store) on a loopback address,
    it serves it on loopback only (env:// would listen on every interface); otherwise env:// as usual.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    common = {"backend": backend, "rank": env.rank, "world_size": env.world_size, "timeout": timeout,
              "device_id": device if device.type == "cuda" else None}
    with BLOCKED_WAIT_STOPS.blocked_wait("waiting for the other ranks to join the process group"):
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and is_loopback(env.master_addr):
            if env.rank == 0:
                store = loopback_store(env.master_port, world_size=env.world_size, timeout_s=timeout_s)
            else:
                store = dist.TCPStore(LOOPBACK, env.master_port, world_size=env.world_size, is_master=False,
                                      timeout=timeout)
            dist.init_process_group(store=store, **common)
        else:
            dist.init_process_group(init_method="env://", **common)
    try:
        yield
    except BaseException:
        if dist.is_initialized():
            # The failed rank's DDP (or FSDP) model lives on in the exception's frames and is freed after the
            # group is destroyed: its last reference to the gloo group would then run the group's destructor,
            # which joins gloo's threads while holding the GIL and can hang the rank at exit (a rank whose
            # collective timed out never ended, its launcher waiting for it). Kept referenced, the group is never
            # destructed: the rank ends with os._exit (a fork server's child), as a script's rank does.
            KEPT_GROUPS.extend(distributed_c10d._world.pg_map)
        raise
    finally:
        if dist.is_initialized():  # a task that tore the group down itself must not hide its own error
            dist.destroy_process_group()


KEPT_GROUPS: list = []
"""Process groups kept referenced so that their destructors never run in a rank: a failed rank's
(process_group), a ddp_amp.loop script's after finish(), and those a launched script destroys itself
(rank.script)."""


def join_process_group(device: torch.device) -> bool:
    """A script's loop (ddp_amp.loop): join the process group of the environment contract (env://, as torchrun
    and ddp-amp's launchers set it), or make a group of one without it (`python script.py`), so that the same
    calls run; whether it was made here (False where the script made its own)."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(minutes=5))
    return True


class SideGroup:
    """A gloo process group of its own beside the training's, for small flags all-reduced asynchronously (the stop
    agreement, the end of iterable data) or a background writer's collectives (a sharded checkpoint): they never
    interleave with the training's. Making it is itself a collective: every rank makes it at the same point. At
    most one asynchronous all-reduce is in flight."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self._work: dist.Work | None = None

    @property
    def in_flight(self) -> bool:
        return self._work is not None

    def all_reduce_async(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        """Start the all-reduce of `tensor` (in place); wait() before reading it."""
        self._work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)

    def wait(self) -> None:
        """The all-reduce in flight, finished (nothing to wait for when none is)."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    def close(self) -> None:
        """Wait for the all-reduce in flight (none may be pending when a group is torn down), then tear it down;
        nothing the second time."""
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def settle_run_dir_writers(env: DistEnv, run_dir: Path) -> DistEnv:
    """On a multi-node job, find out which nodes see rank 0's run directory (a shared file system): rank 0
    leaves a marker file there, the other nodes' local rank 0 look for it. Two collectives, once."""
    if env.world_size == env.local_world_size:
        return env  # one node: local rank 0 is rank 0
    token = [uuid.uuid4().hex if env.rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    marker = Path(run_dir) / f".writer-{token[0]}"
    if env.rank == 0:
        marker.touch()
    dist.barrier()
    shared = env.rank != 0 and marker.exists()
    dist.barrier()
    if env.rank == 0:
        marker.unlink(missing_ok=True)
    return dataclasses.replace(env, shares_run_dir_with_rank0=shared)
