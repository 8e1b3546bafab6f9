"""The task's evaluation of the trained model, on rank 0 after the weights are safe."""

from __future__ import annotations

import inspect
import traceback
from typing import Any

import torch

from ddp_amp.tasks import Task


def evaluate_into(summary: dict[str, Any], task: Task, task_name: str, model: torch.nn.Module,
                  device: torch.device) -> None:
    """Run the task's evaluation on the trained model (on its device) and record its result, or its error
    under `eval_error` (the launcher then exits 1 with that one line; the traceback goes to this rank's log)."""
    model.eval()
    try:
        if _takes_device(task.evaluate):
            summary["eval"] = task.evaluate(model, device)
        else:
            summary["eval"] = task.evaluate(model)  # the one-argument contract of earlier versions
    except Exception as exc:  # a user's evaluate: whatever it raises, the trained weights are kept
        traceback.print_exc()
        summary["eval_error"] = f"task {task_name}: evaluate failed: {type(exc).__name__}: {exc}"


def _takes_device(evaluate: Any) -> bool:
    try:
        parameters = inspect.signature(evaluate).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)
