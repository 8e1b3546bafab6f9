"""One launch of the common core that shows nothing of its ranks' progress: for the commands that run the
core to measure something (bench, bench --max-batch, doctor) and read its files afterwards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def launch_quietly(run_options: dict[str, Any], run_dir: Path, *, nproc: int, launcher: str,
                   extra: dict[str, Any], multinode: tuple[int, str, Callable[[str], Any]] | None = None):
    """One ordinary launch of the common core (spawn or torchrun's agent), quiet; its plan. `multinode`:
    (world size, job id, this node's torchrun job for a device type) to run this node's ranks of a
    multi-node job instead (every node runs the same command; each keeps its own run directory)."""
    import sys

    from ddp_amp.dist import loopback_store
    from ddp_amp.launch import torchrun
    from ddp_amp.launch.agent import run_agent
    from ddp_amp.launch.preflight import preflight
    from ddp_amp.launch.spawn import spawn
    from ddp_amp.progress.display import PlainDisplay
    from ddp_amp.progress.session import ProgressSession

    if multinode is not None:
        world_size, job_id, node_job = multinode
        plan = preflight(run_options, nproc_per_node=nproc, flag="--nproc-per-node", run_dir=str(run_dir),
                         extra={**extra, "job_id": job_id}, lock_run_dir=False, world_size=world_size)
    else:
        plan = preflight(run_options, nproc_per_node=nproc, flag="--nproc", run_dir=str(run_dir), extra=extra)
    session = ProgressSession(PlainDisplay(sys.stderr, quiet=True, final_summary=False), run_dir)
    with session:
        if multinode is not None:
            run_agent(node_job(plan.device_type), plan.config_path, session.environment(),
                      run_dir / "logs" / "agent.log")
        elif launcher == "spawn":
            spawn(plan.config, nproc, extra_env=session.environment())
        else:
            store = loopback_store()  # served as long as this launch runs
            job = torchrun.standalone_job(nproc_per_node=nproc, max_restarts=0, monitor_interval=0.1,
                                          device_type=plan.device_type, store_port=store.port)
            run_agent(job, plan.config_path, session.environment(), run_dir / "logs" / "agent.log")
            del store
    return plan
