"""Slurm: the sbatch script `ddp-amp multinode --emit-slurm` writes, which runs the same multinode command once on
every node of an allocation, stops at one step with a checkpoint on the requeue signal, and requeues itself to
resume (emit_sbatch writes it). No torch."""

from __future__ import annotations

import shlex
import sys

from ddp_amp.errors import UsageError
from ddp_amp.launch.torchrun import Nnodes, nproc_before_torch
from ddp_amp.process import usable_cores

SLURM_STOP_WARNING_S = 120
"""How long before the time limit Slurm sends the requeue signal: ddp-amp stops at one step and checkpoints."""
REQUEUE_SIGNALS = {"USR1": 10, "USR2": 12, "TERM": 15}
"""--requeue-signal: what Slurm sends before the time limit (`--signal=SIG@N`); each is a stop to ddp-amp."""


# continue_run: the arguments with --resume auto in place of the job's own --resume PATH or --overwrite (which,
# left beside it, would make ddp-amp refuse the pair), for an attempt that continues the job's work.
_CONTINUE = """own_start=0
for arg in "$@"; do case "$arg" in --resume|--resume=*|--overwrite) own_start=1 ;; esac; done
continue_run() {
  local kept=() skip=0 arg
  for arg in "$@"; do
    if [ "$skip" = 1 ]; then skip=0; continue; fi
    case "$arg" in --overwrite|--resume=*) continue ;; --resume) skip=1; continue ;; esac
    kept+=("$arg")
  done
  continued=("${kept[@]}" --resume auto)
}
"""

# Every attempt passes --resume auto: a requeued job continues from its newest checkpoint; without one (the first
# attempt, or one stopped before its first checkpoint) the run starts from the beginning. A job emitted with its
# own --resume PATH or --overwrite keeps it until there is a checkpoint of its own, then continues from that. A
# finished run (model.pt) is never overwritten: ddp-amp refuses it. has_checkpoint decides the requeue too: a
# step-N.pt, or a sharded step-N/ directory that DCP finished (--checkpoint-format sharded).
_RESUME = """has_checkpoint() {
  compgen -G "$RUN_DIR/checkpoints/step-*.pt" >/dev/null ||
    compgen -G "$RUN_DIR/checkpoints/step-*/.metadata" >/dev/null
}
""" + _CONTINUE + """if [ "$own_start" = 0 ] || has_checkpoint; then
  continue_run "$@"
  set -- "${continued[@]}"
fi
"""


# A script's requeued attempt continues its run directory (--resume auto: a ddp_amp.loop script restores its
# newest checkpoint, a plain script resumes itself), in place of the job's own --resume or --overwrite (which
# would start the first attempt's work over). Before the script's name: every word after it is the script's.
_SCRIPT_RESUME = _CONTINUE + """if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
  continue_run "$@"
  set -- "${continued[@]}"
fi
"""


def slurm_script(multinode_args: list[str], port: int, *, nodes: Nnodes, gpus_per_node: int | None,
                 run_dir: str | None, requeue_signal: str = "USR1", script=None, command: str = "multinode") -> str:
    """An sbatch script running the same `ddp-amp multinode` once on every node of the allocation (`command`
    "run": `ddp-amp run` on the one node of a one-node job, its rendezvous on loopback).

    Preemption: Slurm sends `requeue_signal` to every process of the job step before the time limit
    (--signal, without B:), or `scancel --signal` does; ddp-amp stops every rank at one step, checkpoints and
    exits 128 + the signal's number. On exactly that exit code, and only with a checkpoint to continue from,
    the script requeues the job, which resumes from the checkpoint. A finished run exits 0: never requeued.

    `script` (a launch.script.Script): every node runs the user's script, by its absolute path, from the
    directory it was launched in (both must be reachable on the nodes: a shared file system). Stopped by the
    requeue signal, the job is requeued and starts the script again: resuming is the script's own business.
    """
    args = shlex.join(multinode_args)
    cores = usable_cores()
    stop_code = 128 + REQUEUE_SIGNALS[requeue_signal]
    header = [
        "#SBATCH --job-name=ddp-amp",
        f"#SBATCH --nodes={nodes.max if nodes.min == nodes.max else f'{nodes.min}-{nodes.max}'}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={cores}    # all of a node's cores for its one ddp-amp ({cores} here: set your "
        "nodes' count)",
    ]
    if gpus_per_node:
        header.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if script is not None:
        header.append(f"#SBATCH --chdir={shlex.quote(script.cwd)}    # where the script was launched from")
    header += [
        "#SBATCH --time=01:00:00    # placeholder: your job's time limit",
        f"#SBATCH --signal={requeue_signal}@{SLURM_STOP_WARNING_S}    # ddp-amp stops at one step and checkpoints",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
    ]
    directory = shlex.quote(run_dir) if run_dir else '"runs/slurm-$SLURM_JOB_ID"'
    head = "\n".join(header)
    if script is not None:
        program = [*(["-m", script.target] if script.module else [script.path]), *script.args]
        setup = (f"set -- {args} --run-dir \"$RUN_DIR\"\n{_SCRIPT_RESUME}set -- \"$@\" {shlex.join(program)}\n"
                 "has_checkpoint() { true; }\n")
    else:
        setup = f"set -- {args} --run-dir \"$RUN_DIR\"\n{_RESUME}"
    launch = _srun_lines(command, port)
    return f"""#!/bin/bash
{head}
set -uo pipefail
RUN_DIR={directory}
{setup}{launch}status=$?
# Stopped by the requeue signal, the work checkpointed: continue in a new allocation. Anything else (done,
# failed, cancelled, or stopped with nothing kept) ends the job as it is.
if [ "$status" -eq {stop_code} ] && has_checkpoint; then
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""


def _srun_lines(command: str, port: int) -> str:
    """The job's launch: one ddp-amp per node through srun (multinode, meeting at the first node's endpoint), or
    `ddp-amp run` on a one-node job's node."""
    if command == "run":
        return """# One ddp-amp on the job's one node, its ranks meeting on loopback. srun does not inherit
# --cpus-per-task from the allocation (Slurm 22.05+): it is passed on.
srun --ntasks-per-node=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} ddp-amp run "$@"
"""
    return f"""# The first node of the allocation hosts the c10d rendezvous store.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export DDP_AMP_ENDPOINT="$head_node:{port}"
# One ddp-amp per node; SLURM_NODEID and SLURM_NNODES are read on each node, hence the single quotes. srun
# does not inherit --cpus-per-task from the allocation (Slurm 22.05+): it is passed on.
srun --ntasks-per-node=1 ${{SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"}} \\
    bash -c 'exec ddp-amp multinode --endpoint "$DDP_AMP_ENDPOINT" \\
    --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --rdzv-id "ddp-amp-$SLURM_JOB_ID" "$@"' ddp-amp "$@"
"""


def sbatch_script(shared_args: list[str], *, port: int, nodes: Nnodes, nproc_per_node: str, device: str,
                  run_dir: str | None, log_format: str, rdzv_timeout: float, rdzv_last_call: int,
                  monitor_interval: float, max_restarts: int, ifname: str | None, requeue_signal: str,
                  script=None, command: str = "multinode") -> str:
    """--emit-slurm's text for this multinode command: `shared_args` (the training options that differ from their
    defaults) and the launch options every node shares; per-node values (--local-addr, --is-host, --node-rank) are
    found on each node. Its options checked first (UsageError)."""
    if requeue_signal not in REQUEUE_SIGNALS:
        raise UsageError(f"--requeue-signal must be one of {', '.join(REQUEUE_SIGNALS)}, got {requeue_signal!r}")
    nproc_before_torch(nproc_per_node)  # a count is checked here; gpu/cpu/auto resolve on each node
    rendezvous = [] if command == "run" else [
        "--rdzv-timeout", f"{rdzv_timeout:g}", *(["--rdzv-last-call", str(rdzv_last_call)] if nodes.min != nodes.max
                                                 else [])]
    args = ["--nproc-per-node", nproc_per_node, *shared_args, *rendezvous, "--monitor-interval",
            f"{monitor_interval:g}", "--log-format", log_format]
    if max_restarts:
        args += ["--max-restarts", str(max_restarts)]
    if ifname:
        args += ["--ifname", ifname]
    gpus = int(nproc_per_node) if nproc_per_node.isdigit() and device != "cpu" else None
    return slurm_script(args, port, nodes=nodes, gpus_per_node=gpus, run_dir=run_dir, requeue_signal=requeue_signal,
                        script=script, command=command)


def emit_sbatch(path, shared_args: list[str], *, port: int, nodes: Nnodes, device: str, run_dir: str | None,
                log_format: str, script=None, **launch_options) -> None:
    """--emit-slurm: the sbatch script that runs this multinode command on every node of an allocation (or, with
    command="run", this run command on the one node of a job)."""
    from ddp_amp.files import write_new_file

    text = sbatch_script(shared_args, port=port, nodes=nodes, device=device, run_dir=run_dir, log_format=log_format,
                         script=script, **launch_options)
    write_new_file(path, text, "--emit-slurm")
    print(f"ddp-amp: wrote {path}; submit it with sbatch {path}")
    if script is not None:
        where_from = script.path if not script.module else f"module {script.target} from {script.cwd}"
        print(f"ddp-amp: every node runs {where_from} in {script.cwd}: both must be there on the nodes (a shared "
              "file system)", file=sys.stderr)


def emit_one_node_sbatch(path, train: dict, shared_args: list[str], output: dict, *, nproc_per_node: str,
                         max_restarts: int, monitor_interval: float, requeue_signal: str, script=None) -> None:
    """`run --emit-slurm`: a one-node job running this run command (`shared_args`: its training options that
    differ from their defaults), requeued on preemption as multinode's is."""
    from ddp_amp.config import TrainConfig
    from ddp_amp.launch.torchrun import check_restart_options

    check_restart_options(max_restarts, monitor_interval)
    TrainConfig(**train)  # the options checked as for a launch
    emit_sbatch(path, shared_args, port=0, nodes=Nnodes(1, 1), device=train["device"],
                run_dir=output["run_dir"], log_format=output["log_format"], script=script,
                nproc_per_node=nproc_per_node, rdzv_timeout=0, rdzv_last_call=0, monitor_interval=monitor_interval,
                max_restarts=max_restarts, ifname=None, requeue_signal=requeue_signal, command="run")
