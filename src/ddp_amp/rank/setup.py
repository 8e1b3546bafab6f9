"""Everything a rank settles before its first step: its output, device and threads, the NCCL environment,
the precision all ranks agree on, the seeds, and checks of the task and of the room for the weights."""

from __future__ import annotations

import importlib
import os
import random
import resource
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddp_amp.checkpoint.formats import FORMATS
from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv, resolve_device, set_cpu_threads
from ddp_amp.errors import RankSetupError, RankUsageError
from ddp_amp.parallel import MODES
from ddp_amp.parallel.base import on_meta_device
from ddp_amp.precision import Precision, cuda_devices_have_fp8, cuda_has_native_bf16, resolve_precision
from ddp_amp.progress.live import LOG_DIR_VAR
from ddp_amp.tasks import Task, build_task
from ddp_amp.train.data import is_iterable

WEIGHTS_OVERHEAD = 1 << 20  # torch.save's framing, summary.json and metrics.jsonl, generously


def redirect_output(rank: int) -> None:
    """Send this rank's own stdout/stderr to RUN_DIR/logs/rank<N>.log while a launcher renders progress:
    a stray print or warning must not garble the live display (failures still arrive as events)."""
    log_dir = os.environ.get(LOG_DIR_VAR)
    if not log_dir:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(Path(log_dir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def prepare_device(config: TrainConfig, local_rank: int,
                   local_world_size: int) -> tuple[torch.device, int, bool]:
    """This rank's device with --tf32 and --flush-denormal applied, its CPU threads (its share of the cores on
    CPU ranks), and whether subnormals are flushed."""
    device = resolve_device(config.device, local_rank)
    # Before any parallel op: the intra-op threads are created later and inherit this thread's flush mode.
    flushing = flush_denormal(config.flush_denormal == "on" or config.flush_denormal == "auto" and device.type == "cpu")
    if device.type == "cuda" and config.tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = config.tf32 == "on"
        torch.backends.cudnn.allow_tf32 = config.tf32 == "on"
    if config.max_memory is not None:
        cap_memory(device, config.max_memory)
    threads = set_cpu_threads(local_world_size) if device.type == "cpu" else torch.get_num_threads()
    if device.type == "cuda":
        nccl_watchdog_environment(Path(config.run_dir))
    return device, threads, flushing


def cap_memory(device: torch.device, gib: float) -> None:
    """--max-memory: on a GPU the caching allocator's share of it (beyond, allocations raise
    torch.OutOfMemoryError); on a CPU rank the process's data limit, RLIMIT_DATA (beyond, the CPU allocator
    raises "can't allocate memory")."""
    limit = int(gib * 2**30)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    else:
        held = data_held()
        if held is not None and limit <= held:  # every allocation after it would fail, a thread's stack first
            raise RankUsageError(f"--max-memory {gib:g}: a CPU rank holds {held / 2**30:.2f} GB already (torch and "
                                 "the task), before training; give more")
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def data_held() -> int | None:
    """This process's data segment in bytes (what RLIMIT_DATA limits: /proc's VmData), None without /proc."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))
    except (OSError, StopIteration, ValueError):
        return None


def flush_denormal(on: bool) -> bool:
    """Whether subnormal floats are flushed to zero on this thread (and the threads it starts) from now on:
    False where asked not to, or where the CPU cannot (torch.set_flush_denormal needs SSE3's DAZ)."""
    return torch.set_flush_denormal(on) and on


def nccl_watchdog_environment(run_dir: Path) -> None:
    """What torch offers for hangs on NCCL, unless the user chose otherwise: fail a timed-out collective
    instead of hanging, and have the flight recorder dump every rank's last collectives into the run dir."""
    for key, value in {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                       "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                       "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(run_dir.resolve() / "nccl_trace_rank_")}.items():
        os.environ.setdefault(key, value)


def agreed_precision(config: TrainConfig, device: torch.device) -> Precision:
    """The precision every rank uses, decided from each rank's own device and agreed on by all of them: with
    --amp auto a job whose GPUs are mixed trains in fp16 everywhere, since ranks in one DDP job must step the
    same way. On CPU ranks --amp auto's answer is still `measured` (provisional): see measured_precision."""
    if device.type != "cuda":
        return resolve_precision(device.type, config.amp, config.dtype)
    flags = torch.tensor([1.0 if gpu_bf16_is_native(device) else 0.0,
                          1.0 if cuda_devices_have_fp8([device.index]) else 0.0], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # once, at start-up
    bf16, fp8 = flags.tolist()
    return resolve_precision(device.type, config.amp, config.dtype, cuda_bf16=bool(bf16), cuda_fp8=bool(fp8))


def gpu_bf16_is_native(device: torch.device) -> bool:
    """This rank's own GPU computes bf16 natively (compute capability 8.0 or newer, not emulated)."""
    return cuda_has_native_bf16(torch.cuda.get_device_capability(device))


def measured_precision(precision: Precision, config: TrainConfig, task: Task, env: DistEnv,
                       device: torch.device) -> tuple[Precision, dict[str, Any] | None]:
    """--amp auto on CPU ranks: rank 0's probe (rank.amp_probe) decides, for every rank; with what it measured,
    for summary.json. Any other precision is returned as it is."""
    if not precision.measured:
        return precision, None
    from ddp_amp.rank.amp_probe import measured_precision as probe

    micro = config.micro_batch if config.micro_batch not in (None, "auto") else config.batch_size
    # A sharded checkpoint under DDP does not hold bf16-true's masters (config.TrainConfig refuses the pair).
    masters_kept = config.checkpoint_format != "sharded" or config.shard == "full"
    return probe(task, env, device, samples=int(micro), spec=config.task, with_bf16_true=masters_kept)


def seed_rank_randomness(seed: int) -> None:
    torch.manual_seed(seed)  # CPU and every CUDA device
    random.seed(seed)
    np.random.seed(seed % 2**32)


def check_task_contract(task: Task, config: TrainConfig, world_size: int | None) -> None:
    """The data set checked against the Task contract on every rank (its first item, where it has one to look
    at without consuming it): a wrong shape would otherwise surface as a misleading error from deep inside the
    model. The launcher checks the same before it starts any rank (launch.task_checks.check_task_options);
    world_size None: not known yet (an elastic job), the batch is not checked against the data set's length."""
    dataset, spec = task.dataset, config.task
    if is_iterable(dataset):
        if config.epochs is not None and not hasattr(dataset, "__len__"):
            raise RankUsageError(f"--task {spec}: --epochs needs a data set with a length, and this iterable "
                                 f"({type(dataset).__name__}) has none; train it for --steps N (it stops earlier "
                                 "if the data runs out)")
        return  # its items are seen as they come (looking at one would consume it)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise RankSetupError(f"--task {spec}: the dataset must be map-style (__len__ and __getitem__) or iterable "
                             f"(a torch IterableDataset), got {type(dataset).__name__}")
    if len(dataset) == 0:
        raise RankUsageError(f"--task {spec}: the dataset is empty")
    item = dataset[0]
    if isinstance(item, (tuple, list)) and len(item) == 2 or isinstance(item, Mapping):
        if world_size is not None and len(dataset) < (wanted := config.batch_size * world_size):
            # Else every step would be a whole epoch of fewer samples than the batch the run reports.
            most = len(dataset) // world_size
            instead = f"give --batch-size {most} or less" if most else f"run {len(dataset)} rank(s) at most"
            raise RankUsageError(f"--batch-size {config.batch_size}: {world_size} rank(s) take {wanted} samples a "
                                 f"step and the data set of --task {spec} has {len(dataset)}; {instead}")
        return
    if isinstance(item, (tuple, list)):
        shape = f"a {type(item).__name__} of {len(item)} elements"
    elif isinstance(item, torch.Tensor):
        shape = f"a single tensor of shape {tuple(item.shape)}"
    else:
        shape = f"a {type(item).__name__}"
    raise RankSetupError(f"--task {spec}: dataset items must be (inputs, target) pairs or mappings (called as "
                         f"model(**batch)), but item 0 is {shape}")


def check_something_to_train(task: Task, spec: str) -> None:
    """A model (built, not a function that builds it) with a parameter that requires a gradient: DDP refuses one
    without ("DistributedDataParallel is not needed ..."), on every rank after the launch."""
    model = task.model
    if isinstance(model, torch.nn.Module) and not any(p.requires_grad for p in model.parameters()):
        raise RankUsageError(f"--task {spec}: its model has no parameter to train (none with requires_grad=True); "
                             "give Task.model one")


def check_room_for_weights(run_dir: Path, model: torch.nn.Module) -> None:
    """Before training: the run dir's file system must hold model.pt, or the trained work would be lost at
    the very end (the write fails, the weights exist nowhere else)."""
    need = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + WEIGHTS_OVERHEAD
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise RankSetupError(f"--run-dir {run_dir}: {free / 2**20:.1f} MiB free, but model.pt needs "
                             f"{need / 2**20:.1f} MiB; free some space or choose another --run-dir")


def import_mode_libraries(config: TrainConfig) -> None:
    """Imports the torch.distributed modules this run's --shard and --checkpoint-format use, before the memory
    baseline is taken: their code is no training state. torch.distributed.tensor (FSDP2's and DCP's DTensor)
    alone is about 41 MB resident on a CPU rank; imported lazily after the baseline, the peak less the baseline
    counted it as if the model held it (docs/benchmarks.md)."""
    for name in (*MODES[config.shard].libraries, *FORMATS[config.checkpoint_format].libraries):
        importlib.import_module(name)


def build_checked_task(config: TrainConfig, env: DistEnv) -> Task:
    """The task, built with identical initial weights on every rank (run after run), checked, and then the
    training randomness seeded per rank."""
    torch.manual_seed(config.seed)
    # A model given as a function is built by rank 0 alone under --shard full; the others take theirs from it.
    model_on_meta = MODES[config.shard].model_from_rank0 and env.rank != 0
    task = build_task(config.task, config.task_arg, model_on_meta=model_on_meta)
    if not model_on_meta and on_meta_device(task.model):
        raise RankUsageError(f"--task {config.task}: Task.model is on the meta device (it has no values); give it "
                             "built with its weights, or give the function that builds it as Task.model")
    # The batch against the data set's length is the launcher's check alone: an elastic job that grows, and
    # bench --max-batch's trials, must not be refused here.
    check_task_contract(task, config, world_size=None)
    check_something_to_train(task, config.task)
    if env.writes_run_dir:
        check_room_for_weights(Path(config.run_dir), task.model)
    # The randomness of training itself (dropout, augmentation) differs between ranks, or every rank would
    # draw the same masks and waste data parallelism; it is still fixed by the seed and the rank.
    seed_rank_randomness(config.seed + env.rank)
    return task


def load_initial_weights(task: Task, config: TrainConfig) -> dict[str, Any] | None:
    """--init-from, on every rank from the same file (DDP then starts every rank from rank 0's weights anyway):
    what was loaded, for summary.json. A --resume checkpoint, loaded after, wins over it."""
    if config.init_from is None or on_meta_device(task.model):  # the latter take rank 0's, loaded, after sharding
        return None
    from ddp_amp.checkpoint.weights import WeightsError, load_into

    try:
        counts = load_into(task.model, config.init_from, strict=config.init_strict)
    except WeightsError as exc:  # the launcher checked it: the file changed since
        raise RankSetupError(str(exc)) from None
    return {"path": config.init_from, **counts}


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model: what a tracker run records this rank trained on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from ddp_amp.precision import cpu_model

    return cpu_model()
