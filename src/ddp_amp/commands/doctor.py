"""doctor: the ranks and their links measured before a long job (the doctor job), judged (measure.doctor)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from ddp_amp.commands.options import (
    Endpoint,
    Ifname,
    IsHost,
    Launcher,
    LocalAddr,
    RdzvId,
    RdzvTimeout,
    check_json_path,
    run_dir_option,
)
from ddp_amp.errors import RunFailed, UsageError

DoctorRunDir = run_dir_option("runs/doctor-<timestamp>", "Output directory: doctor.json, the ranks' logs")


def doctor(
    nproc: Annotated[str | None, typer.Option("--nproc", "--nproc-per-node", "--gpus", "-n", help="Ranks (per node "
                                              "with --nnodes): a number, or gpu, cpu or auto as spawn takes them "
                                              "\\[default: every visible GPU with CUDA, 2 on CPU, 1 per node with "
                                              "--nnodes].")] = None,
    device: Annotated[Literal["auto", "cpu", "cuda"], typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    amp: Annotated[Literal["auto", "on", "off"], typer.Option("--amp", help="The precision of the matmul rate, "
                                                                "as for training.")] = "auto",
    dtype: Annotated[Literal["auto", "bf16", "fp16"], typer.Option("--dtype", help="auto, bf16 or fp16.")] = "auto",
    launcher: Launcher = "spawn",
    nnodes: Annotated[str | None, typer.Option("--nnodes", help="Check a multi-node job of N nodes: run the same "
                                               "doctor command on every node (as multinode); each node's links "
                                               "are measured too.")] = None,
    endpoint: Endpoint = None,
    rdzv_id: RdzvId = None,
    rdzv_timeout: RdzvTimeout = 600.0,
    is_host: IsHost = None,
    local_addr: LocalAddr = None,
    ifname: Ifname = None,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when a rank or a node is an outlier.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every figure to this file.")] = None,
    run_dir: DoctorRunDir = None,
) -> None:
    """Measure the ranks and their links before a long job; outliers are named.

    Rendezvous time, all-reduce latency and bus bandwidth, each rank's matmul rate, host-to-device copies,
    and with --nnodes each node's link to the others."""
    check_json_path(json_path)
    count = _rank_count(nproc)
    multinode = None
    if nnodes is not None or endpoint is not None:
        multinode = doctor_job(nnodes, endpoint, count, rdzv_id=rdzv_id, rdzv_timeout=rdzv_timeout, is_host=is_host,
                               local_addr=local_addr, ifname=ifname)
        count = count or 1
    report = _measure(count, {"device": device, "amp": amp, "dtype": dtype}, launcher=launcher,
                      multinode=multinode, run_dir=run_dir)
    from rich.console import Console

    from ddp_amp.results.report import doctor_table

    Console().print(doctor_table(report))
    if json_path is not None:
        from ddp_amp.outputs import write_json_report

        write_json_report(json_path, report, "doctor")
        typer.echo(f"ddp-amp: wrote {json_path}", err=True)
    if strict and report["judgement"]["warnings"]:
        raise RunFailed("doctor --strict: " + "; ".join(report["judgement"]["warnings"]))


def _rank_count(nproc: str | None) -> int | None:
    """-n as spawn reads it (launch.torchrun.parse_nproc): a count, or gpu, cpu or auto resolved with torch's
    answer; None: the default (_measure's, or 1 per node with --nnodes)."""
    from ddp_amp.launch import torchrun

    return None if nproc is None else torchrun.parse_nproc(nproc)


def _measure(nproc: int | None, precision: dict[str, str], *, launcher: str, multinode, run_dir: str | None):
    """The doctor job launched quietly with every other option at its default; its figures, judged."""
    import dataclasses
    import json

    import torch

    from ddp_amp.config import NOT_OPTIONS, TrainConfig
    from ddp_amp.launch.preflight import RUNS_ROOT, default_run_dir
    from ddp_amp.launch.session import launch_quietly
    from ddp_amp.measure.doctor import judge
    from ddp_amp.outputs import DOCTOR_FILE

    if nproc is None:
        nproc = torch.cuda.device_count() if precision["device"] != "cpu" and torch.cuda.is_available() else 2
    options = {field.name: getattr(TrainConfig(), field.name) for field in dataclasses.fields(TrainConfig)
               if field.name not in NOT_OPTIONS}
    options.update(precision, steps=1)
    root = Path(run_dir) if run_dir else RUNS_ROOT / f"doctor-{default_run_dir().name}"
    launch_quietly(options, root, nproc=nproc, launcher=launcher, kind="doctor", multinode=multinode)
    report = json.loads((root / DOCTOR_FILE).read_text())
    report["judgement"] = judge(report)
    return report


def doctor_job(nnodes: str | None, endpoint: str | None, nproc: int | None, *, rdzv_id: str | None,
               rdzv_timeout: float, **network_options: Any):
    """doctor --nnodes: (world size, job id, this node's torchrun job for a device type), as multinode runs it."""
    from ddp_amp import network
    from ddp_amp.launch import torchrun

    if nnodes is None or endpoint is None:
        raise UsageError("doctor: --nnodes and --endpoint go together (the nodes meet at the endpoint)")
    nnodes = _node_count(nnodes)
    if nproc is not None and nproc < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {nproc}")
    torchrun.check_rendezvous_timeout(rdzv_timeout)
    where = network.parse_endpoint(endpoint)
    nodes, per_node = torchrun.Nnodes(nnodes, nnodes), nproc or 1
    net = torchrun.detect_node_network(where, rdzv_timeout=rdzv_timeout, check_reachable=True, **network_options)
    if net.note:
        typer.echo(f"ddp-amp: {net.note}", err=True)
    job_id = rdzv_id or torchrun.default_rdzv_id(where, nodes, per_node, "doctor")
    return nnodes * per_node, job_id, torchrun.node_job(where, nodes, per_node, net, node_rank=None, rdzv_id=job_id,
                                                        max_restarts=0, monitor_interval=0.1,
                                                        rdzv_timeout=rdzv_timeout)


def _node_count(nnodes: str) -> int:
    """doctor --nnodes N: a fixed number of nodes. multinode's elastic MIN:MAX, copied from a job's command line,
    is named as such (a typer int would call it "not a valid integer")."""
    if ":" in nnodes:
        raise UsageError(f"--nnodes {nnodes}: doctor measures the nodes it is started on, not an elastic range; "
                         "give their number (--nnodes N)")
    try:
        count = int(nnodes)
    except ValueError:
        raise UsageError(f"--nnodes {nnodes!r} is not a number of nodes") from None
    if count < 1:
        raise UsageError(f"--nnodes must be >= 1, got {count}")
    return count
