"""`ddp-amp multinode`: where the nodes meet (the command line, or what a Kubernetes job injected), then one of
three things: the Kubernetes manifest (--emit-k8s), the sbatch script (--emit-slurm), or this node's share of the
job, planned as a Launch (or printed, --dry-run). The command (commands/train.py) parses and shows; this decides."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddp_amp.errors import UsageError
from ddp_amp.launch import torchrun


def multinode_launch(train: dict, output: dict, node: dict, k8s: dict, *, as_flags: Callable[[dict], list[str]],
                     nproc_per_node: str, max_restarts: int, monitor_interval: float, dry_run: bool, script=None):
    """The Launch of this node's ranks, or None when the command's work is done (a manifest or an sbatch script
    written, a dry run printed). `node`: the multinode options (commands.options.NODE_OPTIONS); `as_flags`: the
    training options as flags, the same on every node (commands.options.training_args)."""
    from ddp_amp import network
    from ddp_amp.config import TrainConfig

    if k8s["emit_k8s"] is not None and node["emit_slurm"] is not None:
        raise UsageError("--emit-slurm and --emit-k8s write a job for two different schedulers: pass one of them")
    torchrun.check_restart_options(max_restarts, monitor_interval)
    nnodes, endpoint, node_rank, nproc_per_node = _where_nodes_meet(node, nproc_per_node)
    if node["from_env"] and k8s["emit_k8s"] is None and script is None:
        _take_up_own_run_dir(train, output)
    nodes = _checked_nodes(nnodes, node_rank, node["rdzv_timeout"], node["rdzv_last_call"])
    shared_args = as_flags(train)
    rendezvous = {"rdzv_timeout": node["rdzv_timeout"], "rdzv_last_call": node["rdzv_last_call"],
                  "monitor_interval": monitor_interval, "max_restarts": max_restarts}
    if k8s["emit_k8s"] is not None:
        from ddp_amp.launch.kubernetes import emit_manifest

        emit_manifest(k8s, [*shared_args, "--log-format", output["log_format"]], nodes, device=train["device"],
                      run_dir=output["run_dir"], nproc_per_node=nproc_per_node, max_restarts=max_restarts,
                      stop_timeout=TrainConfig(**train).stop_timeout, script=script)
        return None
    where = network.parse_endpoint(endpoint)
    TrainConfig(**train)  # every cheap check before the network ones, which can wait up to --rdzv-timeout
    if node["emit_slurm"] is not None:
        from ddp_amp.launch.slurm import emit_sbatch

        emit_sbatch(node["emit_slurm"], shared_args, port=where.port, nodes=nodes, device=train["device"],
                    run_dir=output["run_dir"], log_format=output["log_format"], script=script,
                    nproc_per_node=nproc_per_node, ifname=node["ifname"], requeue_signal=node["requeue_signal"],
                    **rendezvous)
        return None
    return _node_launch(train, output, nodes, where, nproc_per_node, dry_run=dry_run, shared_args=shared_args,
                        rdzv_id=node["rdzv_id"], node_rank=node_rank, script=script, **rendezvous,
                        network_options={key: node[key] for key in ("is_host", "local_addr", "ifname")})


def _where_nodes_meet(node: dict, nproc_per_node: str):
    """--nnodes, --endpoint, --node-rank, --nproc-per-node as given or, with --from-env, as a Kubernetes job
    injected them (where the command line does not give its own)."""
    from ddp_amp.launch.kubernetes import rendezvous_from_env
    from ddp_amp.launch.verdict import say

    nnodes, endpoint, node_rank = node["nnodes"], node["endpoint"], node["node_rank"]
    if not node["from_env"]:
        if nnodes is None:
            raise UsageError("--nnodes is required (or --from-env inside a Kubernetes job)")
        return nnodes, endpoint, node_rank, nproc_per_node
    found = rendezvous_from_env(os.environ)
    say(f"ddp-amp: --from-env: {found.source}")
    return (nnodes or found.nnodes, endpoint or found.endpoint, found.node_rank if node_rank is None else node_rank,
            found.nproc_per_node if nproc_per_node == "1" and found.nproc_per_node else nproc_per_node)


def _take_up_own_run_dir(train: dict, output: dict) -> None:
    """--from-env: a pod its controller (re)started takes up its run dir on the claim as a requeued Slurm job
    does, with --resume auto: from the newest checkpoint, else (the first attempt, or one that left none) from
    the beginning."""
    if output["run_dir"] is not None and train["resume"] is None and not output["overwrite"]:
        train["resume"] = "auto"


def _checked_nodes(nnodes: str, node_rank: int | None, rdzv_timeout: float, rdzv_last_call: int):
    """--nnodes parsed, and the rendezvous numbers checked against it."""
    nodes = torchrun.parse_nnodes(nnodes)
    if node_rank is not None and not 0 <= node_rank < nodes.max:
        raise UsageError(f"--node-rank must be in 0..{nodes.max - 1} for --nnodes {nodes}, got {node_rank}")
    torchrun.check_rendezvous_timeout(rdzv_timeout)
    if rdzv_last_call < 1:
        raise UsageError(f"--rdzv-last-call must be >= 1 second, got {rdzv_last_call}")
    return nodes


def _node_launch(train: dict, output: dict, nodes, where, nproc_per_node: str, *, dry_run: bool,
                 shared_args: list[str], rdzv_id: str | None, node_rank: int | None, network_options: dict[str, Any],
                 script=None, **rendezvous: Any):
    """This node's network found, its ranks' plan, and its share of the job as a Launch (None after a dry run,
    which prints torchrun's command instead)."""
    from ddp_amp.launch.preflight import preflight, preflight_script, stops_say
    from ddp_amp.launch.session import Launch, warm_start
    from ddp_amp.launch.verdict import say

    config = warm_start(train, start_ranks_soon=not dry_run)
    nproc = torchrun.parse_nproc(nproc_per_node)
    net = torchrun.detect_node_network(where, rdzv_timeout=rendezvous["rdzv_timeout"], check_reachable=not dry_run,
                                       **network_options)
    job_id = rdzv_id or torchrun.default_rdzv_id(where, nodes, nproc, " ".join(
        [*shared_args, *(script.argv() if script is not None else [])]))
    job_of = torchrun.node_job(where, nodes, nproc, net, node_rank=node_rank, rdzv_id=job_id,
                               script=script is not None, **rendezvous)
    if script is not None and dry_run:  # as under `run`: the command runs the script itself, and nothing is written
        if net.note:
            say(f"ddp-amp: {net.note}")
        print(job_of("cpu").torchrun_command(Path(), script=script).shell())  # a script's threads: any device's
        return None
    extra = {"elastic": nodes.min != nodes.max, "job_id": job_id}
    common = {"nproc_per_node": nproc, "flag": "--nproc-per-node", "overwrite": output["overwrite"],
              "run_dir": output["run_dir"], "lock_run_dir": False, "extra": extra, "dry_run": dry_run}
    if script is not None:
        plan = preflight_script(config, script, **common)
    else:
        plan = preflight(config, world_size=nodes.min * nproc if nodes.min == nodes.max else None, **common)
    with stops_say(plan.changed_on_disk):  # until show() takes over, a stop says what the launch changed
        job = job_of(plan.device_type)
        if net.note:
            say(f"ddp-amp: {net.note}")
        if not dry_run:
            return Launch(plan, nproc, job=job, script=script)
    # A dry run's preflight wrote this node's config.json and nothing else (launch.run_dir.check_dry_run).
    print(job.torchrun_command(plan.config_path).shell())
    print(f"# on every other node: ddp-amp multinode --endpoint {where} --nnodes {nodes} "
          f"--nproc-per-node {nproc} --rdzv-id {job_id} (same training options)")
    return None
