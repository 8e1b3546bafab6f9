"""The training options checked against this machine before anything starts: what a rank's device can do
(DDP's CUDA-only options, a CPU or CUDA setting on the other kind of rank, a --max-memory above the device's) and
the packages an option needs (--tensorboard, --tracker). Each refusal is one line naming the option."""

from __future__ import annotations

import os
import sys

from ddp_amp.config import TrainConfig
from ddp_amp.errors import UsageError
from ddp_amp.launch.devices import DeviceFacts
from ddp_amp.precision import Precision


def check_max_memory(config: TrainConfig, devices: DeviceFacts) -> None:
    """--max-memory above what a rank's device has caps nothing: refused, as a typo (GB for MB) most likely."""
    if config.max_memory is None:
        return
    if devices.device_type == "cuda":
        total, what = devices.gpu0_memory, "GPU 0 has"
    else:
        total, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine has"
    if config.max_memory * 2**30 > total:
        raise UsageError(f"--max-memory {config.max_memory:g} GB is more than {what} ({total / 2**30:.1f} GB)")


def check_tensorboard(config: TrainConfig) -> None:
    if not config.tensorboard:
        return
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
    except ImportError:
        raise UsageError("--tensorboard needs the tensorboard package: pip install 'ddp-amp[tensorboard]' "
                         "(or pip install tensorboard)") from None


def check_trackers(config: TrainConfig) -> None:
    from ddp_amp.rank.trackers import tracker_packages_missing

    for name in tracker_packages_missing(config.tracker):
        raise UsageError(f"--tracker {name} needs the {name} package: pip install 'ddp-amp[{name}]' (or pip install "
                         f"{name})")


def check_ddp_options(config: TrainConfig, device_type: str, precision: Precision) -> None:
    """Combinations that every rank would otherwise fail on, each with a traceback."""
    if config.sync_batchnorm and device_type != "cuda":
        raise UsageError("--sync-batchnorm needs CUDA ranks (nccl): torch's SyncBatchNorm refuses CPU tensors; "
                         "drop it (each CPU rank then normalises with its own batch's statistics)")
    if config.grad_compression == "bf16" and device_type != "cuda":
        raise UsageError("--grad-compression bf16 needs CUDA ranks (nccl): torch has no bf16 all-reduce hook "
                         "for CPU ranks (gloo); use --grad-compression fp16 or none")
    if config.tf32 is not None and device_type != "cuda":
        raise UsageError(f"--tf32 {config.tf32} sets TF32 on CUDA's tensor cores, and these are CPU ranks: drop it")
    if config.flush_denormal == "on" and device_type == "cuda":
        raise UsageError("--flush-denormal on sets the CPU's flush-to-zero, and these ranks compute on GPUs: drop it "
                         "(auto leaves GPUs as they are)")
    if config.optimizer_impl == "fused" and precision.uses_scaler:
        raise UsageError("--optimizer-impl fused cannot run under fp16's GradScaler here: a fused step skips "
                         "overflowing steps on the device, unseen by the LR schedule; use foreach (what auto "
                         "picks) or --dtype bf16")
    check_compiled_step(config, precision, device_type)
    if config.optimizer_impl == "fused" and config.optimizer == "sgd" and config.shard == "full":
        raise UsageError("--optimizer-impl fused cannot run SGD under --shard full: torch has no fused SGD step for "
                         "sharded (DTensor) parameters; use foreach (what auto picks), loop, or --optimizer adamw")


def check_compiled_step(config: TrainConfig, precision: Precision, device_type: str) -> None:
    """--optimizer-impl compiled: bf16-true's AdamW under DDP (train.optim.compiled_step_applies)."""
    if config.optimizer_impl != "compiled":
        return
    if not precision.bf16_weights:
        raise UsageError(f"--optimizer-impl compiled steps bf16-true's fp32 masters, and this run is {precision.name}: "
                         "pass --dtype bf16-true, or pick fused, foreach or loop")
    if config.optimizer != "adamw":
        raise UsageError(f"--optimizer-impl compiled runs AdamW, not --optimizer {config.optimizer}: pick fused, "
                         "foreach or loop")
    if config.shard != "none":
        raise UsageError(f"--optimizer-impl compiled runs under --shard none, not --shard {config.shard} (which "
                         "steps its own optimizer): pick fused, foreach or loop")
    if device_type != "cpu":
        raise UsageError("--optimizer-impl compiled runs on CPU ranks, and these compute on GPUs (where it is "
                         "untried): pick fused (what auto picks there)")


def check_processes(config: TrainConfig, nproc_per_node: int, flag: str) -> None:
    """The processes a launch starts on this node: at least one rank; and --num-workers refused only where the
    node certainly cannot start the ranks and their DataLoader workers (each worker a forked process). More
    workers than cores are the user's call: workers waiting on I/O (network storage, decoding) may usefully
    outnumber them (warn_of_workers says so)."""
    from ddp_amp.process import process_limit

    if nproc_per_node < 1:
        raise UsageError(f"{flag} must be >= 1, got {nproc_per_node}")
    workers = config.num_workers or 0
    needed = nproc_per_node * (workers + 1)
    limit = process_limit() if workers else None
    if limit is not None and needed > limit[0]:
        raise UsageError(f"--num-workers {workers}: {nproc_per_node} rank(s) with {workers} DataLoader workers each "
                         f"are {needed} processes, more than this node can start ({limit[1]} {limit[0]}); lower it")


def warn_of_workers(config: TrainConfig, nproc_per_node: int) -> None:
    """Above the usable cores per rank, torch's own warning, said where the user sees it (a rank's warnings reach
    only its log); after every refusal, so that a refused launch still says one line."""
    from ddp_amp.process import usable_cores

    workers = config.num_workers or 0
    if workers > (cores := usable_cores()):
        print(f"ddp-amp: warning: --num-workers {workers}: {nproc_per_node * workers} DataLoader worker processes "
              f"on {cores} usable core(s) (torch suggests at most {cores} per rank); each is a forked copy of its "
              "rank, so memory grows with them", file=sys.stderr)
