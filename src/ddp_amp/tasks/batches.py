"""A batch as the Task contract forms it: what the model's forward is given, the loss it yields, and what that
loss averages over (samples, or the label tokens of a Hugging Face model's own loss)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ddp_amp.errors import RankSetupError

if TYPE_CHECKING:
    from ddp_amp.tasks import Task


def forward(model: Any, batch: Any, every_field: bool = False) -> tuple[Any, Any]:
    """(output, what the loss and the metrics compare it with): `model(**fields)` and the whole batch for a
    mapping (the fields the model's forward names, or all with `every_field`), `model(inputs)` and the target
    for a pair."""
    if isinstance(batch, Mapping):
        names = None if every_field else model_fields(model)
        return model(**(batch if names is None else {k: v for k, v in batch.items() if k in names})), batch
    inputs, target = batch
    return model(inputs), target


def batch_loss(model: Any, batch: Any, loss_fn: Callable[[Any, Any], Any] | None, spec: str = "",
               every_field: bool = False) -> Any:
    """The loss of one batch as the Task contract says: a mapping batch is `model(**fields)` and, without a
    loss_fn, the output's own loss; a pair is `model(inputs)` and `loss_fn(output, target)`."""
    return output_loss(*forward(model, batch, every_field), loss_fn, spec)


TOKEN_LOSSES = {"ForCausalLM": 1, "ForMaskedLM": 0, "ForTokenClassification": 0, "ForConditionalGeneration": 0}
"""A Hugging Face model's `loss_type` whose loss is the mean over its label tokens other than -100, and how many
leading positions of each row it shifts away (a causal LM predicts token t + 1 from token t)."""


def loss_items_counter(task: Task, model: Any) -> Callable[[Any], Any] | None:
    """How to count the items the loss of a batch averages over, where they are not its samples: the task's own
    `loss_items`, else, for a Hugging Face model's own loss over token labels, the labels other than -100 (those
    its loss counts); None for a mean over samples."""
    if task.loss_items is not None:
        return task.loss_items
    inner = _unwrapped_model(model)
    shift = TOKEN_LOSSES.get(getattr(inner, "loss_type", None))
    if getattr(inner, "loss_type", None) == "ForConditionalGeneration":  # a decoder-only one (a vision-language
        shift = 0 if getattr(getattr(inner, "config", None), "is_encoder_decoder", False) else 1  # model) shifts
    if task.loss_fn is not None or shift is None:
        return None

    def label_tokens(batch: Any) -> Any:
        labels = batch["labels"] if isinstance(batch, Mapping) and "labels" in batch else None
        if labels is None or labels.dim() < 2:
            raise RankSetupError(f"--task {task!r}: the model's loss is a mean over label tokens, but a batch has "
                                 "no labels of one per token; give Task.loss_items or a loss_fn")
        return (labels[..., shift:] != -100).sum()

    return label_tokens


def _unwrapped_model(model: Any) -> Any:
    """The model DDP, torch.compile or PEFT wraps, as the user built it."""
    from torch.nn.parallel import DistributedDataParallel

    inner = model
    while True:
        if isinstance(inner, DistributedDataParallel):
            inner = inner.module
        elif hasattr(inner, "_orig_mod"):  # torch.compile's OptimizedModule
            inner = inner._orig_mod
        elif callable(getattr(inner, "get_base_model", None)) and inner.get_base_model() is not inner:  # PEFT
            inner = inner.get_base_model()
        else:
            return inner


def model_fields(model: Any) -> frozenset[str] | None:
    """The keys of a mapping batch that `model(**batch)` is given: the parameters its forward names, as Hugging
    Face's Trainer keeps them (remove_unused_columns); None: every key, for a forward that names none (only
    `**kwargs`) or whose signature cannot be read. DDP and torch.compile are looked through to the model."""
    return _forward_names(type(_unwrapped_model(model)))


@functools.lru_cache(maxsize=64)
def _forward_names(model_class: type) -> frozenset[str] | None:
    try:
        params = list(inspect.signature(model_class.forward).parameters.values())[1:]  # after self
    except (AttributeError, TypeError, ValueError):
        return None
    named = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.KEYWORD_ONLY)]
    takes_more = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    # A Hugging Face model's **kwargs (attention options) swallow any field silently: its named ones are its
    # inputs. Anyone else's **kwargs may read fields by name: they get every field.
    hugging_face = any(base.__name__ == "PreTrainedModel" for base in model_class.__mro__)
    return frozenset(named) if named and (hugging_face or not takes_more) else None


def fields_left_out(task: Task) -> list[str]:
    """The fields of the task's first batch (map-style data: its first item, collated) that its model's forward
    does not take: they reach loss_fn alone. Empty where the batch is not a mapping, the task passes every field,
    or the model is not built yet (given as a function) or takes them all."""
    import torch

    dataset = task.dataset
    if task.pass_every_field or not isinstance(task.model, torch.nn.Module) or not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) or len(dataset) == 0:
        return []
    item = dataset[0]
    if not isinstance(item, Mapping):
        return []
    try:  # the collate function may add fields (a language-modelling collator's labels) or drop some
        from torch.utils.data import default_collate

        batch = (task.collate_fn or default_collate)([item])
    except Exception:
        batch = item
    names = model_fields(task.model)
    return [] if names is None or not isinstance(batch, Mapping) else [k for k in batch if k not in names]


def output_loss(output: Any, target: Any, loss_fn: Callable[[Any, Any], Any] | None, spec: str = "") -> Any:
    if loss_fn is not None:
        return loss_fn(output, target)
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise RankSetupError(f"--task {spec}: the model's output ({type(output).__name__}) has no loss (attribute "
                             "or key) and the Task has no loss_fn: give the batch its labels (a Hugging Face model "
                             "then returns its loss) or set Task.loss_fn")
    return loss
