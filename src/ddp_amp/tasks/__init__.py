"""Tasks: what a run trains. Built-in ones by name, or the user's own as `module:factory` / `file.py:factory`.

A factory is any callable that returns a `Task`; its arguments come from `--task-arg KEY=VALUE`, converted by
its annotations (int, float, bool, str, Path). It is called on every rank after the global torch seed is set, so
the model's initial weights are reproducible; the data set must come out the same on every rank (generate it
from a fixed seed, or read it from disk), since each rank takes its own share of it.
"""

from ddp_amp.tasks.contract import Task
from ddp_amp.tasks.loading import (
    BUILTIN,
    build_task,
    check_task_file,
    import_failure,
    precheck_task,
    resolve_factory,
    task_arguments,
    with_built_model,
)

__all__ = ["BUILTIN", "Task", "build_task", "check_task_file", "import_failure", "precheck_task", "resolve_factory",
           "task_arguments", "with_built_model"]
