"""The Task contract: what a task factory returns (the model, the data, the loss and the optional parts). Its
loading from `--task` is in tasks.loading."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Task:
    """What a factory returns.

    Each item of `dataset` is either
    - an `(inputs, target)` pair: `output = model(inputs)`, the loss `loss_fn(output, target)`; or
    - a mapping (a Hugging Face item `{input_ids, attention_mask, labels}`): its batch is a dict, `output =
      model(**fields)` with the fields its forward names (a Hugging Face model names its labels too; a forward
      that names none, only `**kwargs`, gets them all), the loss `loss_fn(output, batch)` with every field.
    Without a loss_fn the loss is the output's own `loss` (attribute or key), as Hugging Face models return it
    when the batch holds labels. Any side may be a tensor or any nesting of mappings, namedtuples, lists and
    tuples of tensors, as `collate_fn` (default: torch's default collation) batches them; every tensor of a
    batch is moved to the rank's device. The forward runs under autocast; the loss is a scalar tensor, the
    mean over the batch.
    """

    model: Any
    """A torch.nn.Module, on the CPU; ddp-amp moves it to the device and wraps it in DDP. Parameters with
    requires_grad=False (a frozen part) are left out of the optimizer. Or a function of no arguments that builds
    it (the class, a functools.partial, a lambda): every rank calls it, except that under --shard full only rank 0
    builds it in memory and every other rank on the meta device (no storage), and after sharding each of them
    receives its shards and every buffer from rank 0 (torch.distributed.checkpoint's broadcast_from_rank0). So one
    rank, not every rank, holds the whole model in host memory. Its state must then be its parameters and
    buffers (a plain tensor attribute would stay on the meta device)."""
    dataset: Any
    """A map-style torch Dataset (`__len__` and `__getitem__`), identical on every rank, of which each rank
    trains its share; or an iterable one (a torch IterableDataset, a Hugging Face datasets.IterableDataset), of
    which rank r takes items r, r + W, ... (split again across DataLoader workers), unless it is already split
    per rank (`data_sharded`, or Hugging Face's split_dataset_by_node). When any rank's data runs out, every
    rank stops at the same optimizer step."""
    loss_fn: Callable[[Any, Any], Any] | None = None
    """`loss_fn(output, target)` for pairs, `loss_fn(output, batch)` for mappings -> scalar tensor; None: the
    output's `loss`."""
    evaluate: Callable[..., dict[str, float]] | None = None
    """Optional: `evaluate(model, device) -> {name: value}` on rank 0 after training and after model.pt is
    saved. The model is the plain trained module, in eval mode, without autocast, still on `device` (the rank's
    GPU under CUDA): move the evaluation data there. The values land in summary.json under "eval"; an
    exception lands under "eval_error" and fails the command, the weights kept. A one-argument
    `evaluate(model)` is still called, with the model as it is."""
    items_per_sample: int = 1
    """How many counted items a sample holds (tokens per sequence for language models)."""
    item_name: str = "samples"
    """What the throughput counts: summary.json reports `<item_name>_per_s` next to samples_per_s."""
    flops_per_item: float | None = None
    """Optional: training FLOPs (forward + backward) per item, for the model FLOPs utilisation (MFU) that runs,
    `bench` and `show` report. None: counted on the first batch by torch's FlopCounterMode."""
    description: str | None = None
    """Optional: one line saying what is trained (a built-in task's size), in summary.json and bench's table."""
    collate_fn: Callable[[list], Any] | None = None
    """Makes a batch of a list of items (padding variable-length sequences, for example); None: torch's default
    collation."""
    data_sharded: bool = False
    """An iterable dataset that already yields each rank only its own share: ddp-amp leaves it as it is (the
    validation set too)."""
    val_dataset: Any = None
    """Optional: the validation set (map-style or iterable, batched by collate_fn), evaluated with --eval-every N
    and at the end of training: each rank a disjoint share, each sample counted once."""
    val_metrics: Callable[[Any, Any], dict[str, Any]] | None = None
    """Optional: `val_metrics(output, target_or_batch) -> {name: scalar tensor}`, means over the batch; logged as
    val_<name> beside val_loss."""
    loss_items: Callable[[Any], Any] | None = None
    """Optional, for a loss that is a mean over items other than samples (tokens, pixels, label positions):
    `loss_items(batch)` -> how many items the loss of `batch` averages over (an int or a tensor). Every micro-batch,
    accumulated batch and rank is then weighted by its items, so that each optimizer step follows the mean over all
    the items of the global batch, whatever --micro-batch, --grad-accum and the world size. None: a Hugging Face
    model's own loss over token labels (causal LM, masked LM, token classification, seq2seq) is recognised without
    it; any other loss is taken as a mean over samples."""
    pass_every_field: bool = False
    """A mapping batch: True passes every field to `model(**batch)`, also those its forward does not name (a
    forward that reads them from `**kwargs`); by default they reach only loss_fn and val_metrics, and the
    launcher names them at the start."""
    shard_units: Sequence[type | str] | None = None
    """Optional, for --shard full: the module classes (or class names) whose instances FSDP shards as one unit
    each, all-gathered for their own forward and backward. None: a Hugging Face model's `_no_split_modules`
    (its decoder layer), else the repeated blocks of the model (parallel.fsdp.unit_rule)."""
