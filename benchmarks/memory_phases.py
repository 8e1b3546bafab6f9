"""Where a step's memory goes: tasks.py's wide MLP with hooks that write rank 0's resident set (VmRSS) and its
peak so far (VmHWM) at each Linear's forward and backward and at each loss, from the second step on, to its
log (RUN_DIR/logs/rank0.log). A probe for reading, not a benchmark of ratios:

    R=$(mktemp -d)/run    # a new run dir: rank logs are appended to, even under --overwrite
    .venv/bin/ddp-amp spawn -n 2 --device cpu --amp off --optimizer adamw --steps 4 --shard full \\
        --task benchmarks/memory_phases.py:wide --run-dir $R --quiet
    grep '^\\[3\\]' $R/logs/rank0.log        # step 3; $R/summary.json has baseline_memory_mb

`--task-arg rank=1 --task-arg from_step=1 [--task-arg as_function=true]`: rank 1's memory once its model is
built ("model built on cpu" or "on meta"), given the module or the function that builds it.

Linear i is the model's module i: 0 is 1024->4096, 2 is 4096->1024, 4 is 1024->1024. A forward hook runs before
FSDP's own (registered later, by fully_shard), so "fwd pre i" is read before unit i's all-gather; "bwd post i"
when its input's gradient is computed, before its gradients are reduce-scattered.
"""

import os
import sys

import torch
from tasks import regression_mlp, wide_regression

from ddp_amp.tasks import Task


def _memory() -> str:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return " ".join(f"{name} {int(fields[name].split()[0]) // 1024} MB" for name in ("VmRSS", "VmHWM"))


def wide(samples: int = 512, rank: int = 0, from_step: int = 2, as_function: bool = False) -> Task:
    """`rank`'s memory from step `from_step` on, and from_step=1 also once the model is built; as_function:
    Task.model the function that builds the model, which under --shard full only rank 0 builds in memory."""
    task = wide_regression(samples)
    step = [0]  # counted at the first layer's forward: a step's forward, loss and backward carry one number

    def log(where: str) -> None:
        if os.environ.get("RANK") == str(rank) and max(step[0], 1) >= from_step:
            print(f"[{step[0]}] {where}: {_memory()}", file=sys.stderr, flush=True)

    def count(*_) -> None:
        step[0] += 1

    def hooked(model: torch.nn.Module) -> torch.nn.Module:
        model[0].register_forward_pre_hook(count)
        for i, module in enumerate(model):
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda *_, i=i: log(f"fwd pre {i}"))
                module.register_forward_hook(lambda *_, i=i: log(f"fwd post {i}"))
                module.register_full_backward_pre_hook(lambda *_, i=i: log(f"bwd pre {i}"))
                module.register_full_backward_hook(lambda *_, i=i: log(f"bwd post {i}"))
        log(f"model built on {model[0].weight.device.type}")
        return model

    mse = task.loss_fn

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log("loss")
        return mse(output, target)

    task.loss_fn = loss_fn
    task.model = (lambda: hooked(regression_mlp())) if as_function else hooked(task.model)
    return task
