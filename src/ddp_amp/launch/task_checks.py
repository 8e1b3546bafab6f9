"""The launcher's checks of the options that depend on the task's model and data (--batch-size against the data
set, --epochs, --init-from, --eval-every and --keep-best, the batch fields the model's forward does not take),
before any rank starts: the task built on the meta device where its factory allows, in a child of the fork
server (it has torch._dynamo imported already). Part of launch.preflight.
"""

from __future__ import annotations

import sys

from ddp_amp.config import TrainConfig
from ddp_amp.errors import UsageError


def check_init_from(config: TrainConfig, task) -> dict[str, int]:
    """--init-from against the task's model, before anything starts: its keys and shapes (a model given as the
    function that builds it is built here, on the meta device)."""
    import torch

    from ddp_amp.checkpoint.weights import WeightsError, fit, read_weights
    from ddp_amp.tasks import with_built_model

    try:
        state = read_weights(config.init_from)
    except WeightsError as exc:
        raise UsageError(f"--init-from {exc}") from None
    try:
        model_state = with_built_model(task, config.task, model_on_meta=True).model.state_dict()
    except Exception:  # a model function that computes with its tensors: built as the ranks will
        torch.manual_seed(config.seed)
        model_state = with_built_model(task, config.task).model.state_dict()
    result = fit(state, model_state)
    if problems := result.problems(config.init_strict):
        raise UsageError(f"--init-from {config.init_from} does not fit the model of --task {config.task}: "
                         + "; ".join(problems) + ("" if result.mismatched or not config.init_strict else
                                                  " (--no-init-strict loads the tensors that match)"))
    return result.counts()


def task_for_checks(config: TrainConfig, factory):
    """The task as the ranks will build it, for the launcher's checks: on the meta device (no memory, no
    initialisation) where the factory allows, else for real; None when it cannot be built at all (the ranks
    build it and say what is wrong, with their traceback). A model given as a function stays unbuilt."""
    import torch

    from ddp_amp.tasks import Task
    from ddp_amp.tasks.loading import call_factory

    try:
        with torch.device("meta"):
            task = call_factory(factory, config.task)
    except UsageError:
        raise
    except Exception:  # a factory that computes with its tensors (data made from .item()), or reads files
        try:
            torch.manual_seed(config.seed)
            task = call_factory(factory, config.task)
        except UsageError:
            raise
        except Exception:
            return None
    if not isinstance(task, Task):
        raise UsageError(f"--task {config.task!r}: the factory returned {type(task).__name__}, not "
                         "ddp_amp.tasks.Task")
    return task


def check_task_options(config: TrainConfig, factory, world_size: int | None
                       ) -> tuple[dict[str, int] | None, tuple[str, ...]]:
    """The options that depend on the task's model and data, against them, before any rank starts: the data set
    (the Task contract, and --batch-size against its length), --init-from (what it loads), --eval-every and
    --keep-best. Returns what --init-from loads and the batch fields the model's forward does not take."""
    from ddp_amp.errors import RankSetupError
    from ddp_amp.rank.setup import check_something_to_train, check_task_contract
    from ddp_amp.tasks.batches import fields_left_out

    task = task_for_checks(config, factory)
    if task is None:
        return None, ()
    try:
        check_task_contract(task, config, world_size)
        check_epochs_length(task, config, world_size)
    except RankSetupError as exc:
        raise UsageError(str(exc)) from None
    except Exception:  # an item the meta-built data set cannot give (an .item() on its tensors): the ranks check
        pass
    try:
        check_something_to_train(task, config.task)
    except RankSetupError as exc:
        raise UsageError(str(exc)) from None
    if config.eval_every or config.keep_best:
        check_validation(config, task)
    try:
        left_out = tuple(fields_left_out(task))
    except Exception:  # a data set or collate_fn the meta device breaks: the ranks run it for real
        left_out = ()
    return (check_init_from(config, task) if config.init_from is not None else None), left_out


def check_epochs_length(task, config: TrainConfig, world_size: int | None) -> None:
    """An --epochs run over a map-style data set: its length in optimizer steps, as the ranks will count it
    (train.data.RankBatches: each rank ceil(len / world) samples, in batches the last of them short), and what
    must fit in it; world_size None (an elastic job): the ranks check it."""
    import math

    from ddp_amp.train.data import is_iterable
    from ddp_amp.train.schedule import run_length

    if config.epochs is None or world_size is None or is_iterable(task.dataset):
        return
    run_length(config, math.ceil(math.ceil(len(task.dataset) / world_size) / config.batch_size))


def checks_of_task(config: TrainConfig, world_size: int | None
                   ) -> tuple[dict[str, int] | None, tuple[str, ...]]:
    """check_task_options in a child of the fork server where one runs (launch.forkserver.call_warm): it has
    torch._dynamo imported already, which building the task on the meta device would import here again."""
    from ddp_amp.launch.forkserver import WarmChildDied, call_warm

    try:  # a bad --task or --task-arg too, said here from the child's UsageError
        return call_warm(check_task_of, config, world_size)
    except WarmChildDied as exc:  # the ranks build the task again and say what ends them
        print(f"ddp-amp: warning: the checks of --task {config.task} ended without an answer ({exc}); the ranks "
              "check it", file=sys.stderr, flush=True)
        return None, ()


def check_task_of(config: TrainConfig, world_size: int | None) -> tuple[dict[str, int] | None, tuple[str, ...]]:
    """check_task_options of --task with its --task-arg: what the launcher runs in a child of the fork server."""
    from ddp_amp.tasks import resolve_factory

    return check_task_options(config, resolve_factory(config.task, config.task_arg), world_size)


def check_validation(config: TrainConfig, task) -> None:
    """--eval-every and --keep-best against the task (the ranks would find it only after their start-up, or
    after training): a validation set, and a --keep-best metric the evaluation logs where the task says what it
    logs (without val_metrics: val_loss alone)."""
    from ddp_amp.train.evaluation import parse_keep_best

    flags = " and ".join(flag for flag, given in (("--eval-every", config.eval_every), ("--keep-best",
                                                                                      config.keep_best)) if given)
    if task.val_dataset is None:
        raise UsageError(f"{flags}: --task {config.task} has no validation set (Task.val_dataset); drop "
                         f"{'it' if ' and ' not in flags else 'them'} or give the task one")
    if config.keep_best and task.val_metrics is None:
        metric, _ = parse_keep_best(config.keep_best)
        if metric != "val_loss":
            raise UsageError(f"--keep-best {metric}: the evaluation of --task {config.task} logs val_loss only "
                             "(the task declares no val_metrics)")
