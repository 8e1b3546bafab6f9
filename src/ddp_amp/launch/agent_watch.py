"""A bound, kept from the launcher's thread, on an elastic agent that no longer sees its own ranks.

torch's agent (launch.agent) monitors its ranks between calls to the rendezvous store: while its worker group
is healthy, each monitor interval asks the store whether nodes wait to join (`num_nodes_waiting`). When this
node is cut off from the network, that call blocks in the socket until TCP gives up (tcp_retries2, about 15
minutes), below the store's own read timeout, which is therefore never honoured: the agent never looks at its
ranks again, and the launcher lived ~15 minutes after they had failed. The launcher's thread sees the ranks end
(their pids) while the agent still holds them healthy; once that lasts longer than the agent's monitor interval
plus the store's read timeout (torch's own bound on the call), it gives up on the agent.

The same watch ends a second way of waiting forever, on one node too: a rank that leaves by os._exit(0) (a
pattern of scripts that dodge a slow teardown) hands torch's function-entry worker context no return value, and
the agent polls for it for good, its group HEALTHY, where torchrun's subprocess workers end with exit 0. A
standalone job's store is local (no call of it blocks): its bound is the monitor interval plus a grace for a
loaded machine's slow poll.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddp_amp.launch.torchrun import ElasticJob

STANDALONE_GRACE_S = 10.0
"""Past the monitor interval, how long a standalone agent may hold ended ranks healthy: its store is local, so
only a starved thread (a loaded machine) delays its next poll."""
READ_TIMEOUT_S = 60
"""The c10d rendezvous store's read timeout when rdzv_configs sets none (torch's own default:
elastic/rendezvous/c10d_rendezvous_backend.py)."""


class AgentWatch:
    """`overdue()`, polled by the launcher: None, or how long ago this node's ranks ended and their failures
    (global rank -> torch's ProcessFailure, read as the agent would have read them; {} when every rank exited 0;
    None where they cannot be read), once the agent has held them healthy past its bound."""

    def __init__(self, agents: list, job: ElasticJob) -> None:
        """`agents`: where launch.agent records the agent launch_agent makes, once it has made it."""
        self.agents = agents
        multinode = job.nnodes.max > 1 and job.rdzv_endpoint is not None
        self.bound_s = job.monitor_interval + (float(job.rdzv_configs.get("read_timeout", READ_TIMEOUT_S))
                                               if multinode else STANDALONE_GRACE_S)
        self._ended_at: float | None = None

    def overdue(self) -> tuple[float, dict | None] | None:
        agent = self.agents[-1] if self.agents else None
        if agent is None or not _healthy_without_ranks(agent):
            self._ended_at = None  # the agent saw them (a restart, a failure, success), or they still run
            return None
        now = time.monotonic()
        if self._ended_at is None:
            self._ended_at = now
        if now - self._ended_at <= self.bound_s:
            return None
        return now - self._ended_at, _failures(agent)


def _healthy_without_ranks(agent) -> bool:
    """The agent's worker group is still HEALTHY (set when its ranks started, changed only by its monitor) and
    none of its ranks is alive. False where torch's private attributes are not as expected."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    group, context = getattr(agent, "_worker_group", None), getattr(agent, "_pcontext", None)
    if getattr(group, "state", None) != WorkerState.HEALTHY or context is None:
        return False
    try:
        pids = list(context.pids().values())
    except Exception:  # noqa: BLE001 - torch's context without its processes: nothing to judge by
        return False
    return bool(pids) and not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """Running, not a zombie. The ranks are the fork server's children, which it reaps at once; a zombie waits
    only for that, and has ended as much as a reaped one has."""
    try:
        os.kill(pid, 0)  # the check every system has; /proc, where there is one, tells a zombie apart
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _failures(agent) -> dict | None:
    """Global rank -> ProcessFailure for each of the agent's ranks that failed, from their exit codes and the error
    files they wrote (what the agent's monitor would have found): {} when every one exited 0; None where an exit
    code or torch's attributes are not as expected."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    context = agent._pcontext
    processes = getattr(getattr(context, "_pc", None), "processes", None)
    error_files = getattr(context, "error_files", None)
    workers = getattr(getattr(agent, "_worker_group", None), "workers", None)
    if not processes or not error_files or not workers:
        return None
    failures = {}
    for local_rank, process in enumerate(processes):
        exitcode = getattr(process, "exitcode", None)
        if exitcode is None or local_rank >= len(workers):
            return None  # its status unknown
        if exitcode == 0:
            continue
        failures[workers[local_rank].global_rank] = ProcessFailure(
            local_rank=local_rank, pid=process.pid, exitcode=exitcode, error_file=error_files.get(local_rank, ""))
    return failures
