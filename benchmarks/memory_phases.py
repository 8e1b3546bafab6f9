"""Where a step's memory goes: tasks.py's wide MLP with hooks that write rank 0's resident set (VmRSS) and its
peak so far (VmHWM) at each Linear's forward and backward and at each loss, from the second step on, to its
log (RUN_DIR/logs/rank0.log). A probe for reading, not a benchmark of ratios:

    .venv/bin/ddp-amp spawn -n 2 --device cpu --amp off --optimizer adamw --steps 4 --shard full \\
        --task benchmarks/memory_phases.py:wide --run-dir /tmp/phases --overwrite --quiet
    grep '^\\[3\\]' /tmp/phases/logs/rank0.log        # step 3; summary.json has baseline_memory_mb

Linear i is the model's module i: 0 is 1024->4096, 2 is 4096->1024, 4 is 1024->1024. A forward hook runs before
FSDP's own (registered later, by fully_shard), so "fwd pre i" is read before unit i's all-gather; "bwd post i"
when its input's gradient is computed, before its gradients are reduce-scattered.
"""

import os
import sys

import torch
from tasks import wide_regression

from ddp_amp.tasks import Task


def _memory() -> str:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return " ".join(f"{name} {int(fields[name].split()[0]) // 1024} MB" for name in ("VmRSS", "VmHWM"))


def wide(samples: int = 512) -> Task:
    task = wide_regression(samples)
    losses = [0]

    def log(where: str) -> None:
        if os.environ.get("RANK") == "0" and losses[0] >= 2:
            print(f"[{losses[0]}] {where}: {_memory()}", file=sys.stderr, flush=True)

    for i, module in enumerate(task.model):
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda *_, i=i: log(f"fwd pre {i}"))
            module.register_forward_hook(lambda *_, i=i: log(f"fwd post {i}"))
            module.register_full_backward_pre_hook(lambda *_, i=i: log(f"bwd pre {i}"))
            module.register_full_backward_hook(lambda *_, i=i: log(f"bwd post {i}"))
    mse = task.loss_fn

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        losses[0] += 1
        log("loss")
        return mse(output, target)

    task.loss_fn = loss_fn
    return task
