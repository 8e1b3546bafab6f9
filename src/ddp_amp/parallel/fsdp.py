"""--shard full: FSDP2 (torch.distributed.fsdp.fully_shard) in place of DDP, and the whole-model views the rest
of ddp-amp needs of a sharded model: the plain state_dict checkpoints and model.pt hold, and a plain module for
rank 0's evaluation and the model's own save format (FSDPStrategy).

Each rank keeps 1/N of every parameter, gradient and optimizer state (as DTensors on a one-dimensional mesh
over all ranks); a unit's parameters are all-gathered for its forward and its backward and freed after, and
its gradients are reduce-scattered. The units: every module whose class `Task.shard_units` names, else the
class names of a Hugging Face model's `_no_split_modules` (its repeated decoder layer), else the repeated
blocks (the children of each ModuleList or Sequential whose children share one class and hold parameters),
else each child of the model that holds parameters; the outermost of them, never one inside another; and the
root module always, for what is left (embeddings, final norm, head).

Checkpoints keep the plain format (what --shard none writes: a state_dict and the optimizer's own state_dict
keyed by parameter index): a sharded run resumes from an unsharded checkpoint and the other way round, at any
world size, and export reads them as it reads any.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ddp_amp.errors import RankUsageError
from ddp_amp.parallel.base import Strategy, on_meta_device
from ddp_amp.precision import Precision


class FSDPStrategy(Strategy):
    mode = "full"
    replicated_parts = ()  # every tensor of the model and the optimizer is a DTensor shard
    lockstep_evaluation = True

    def __init__(self, config, device: torch.device, precision: Precision | None = None) -> None:
        super().__init__(config, device, precision)
        self.shell: nn.Module | None = None
        """A meta-device copy of the model taken before sharding: the plain model at the end (plain_model)."""
        self.units: dict[str, int] = {}
        """The FSDP units by class."""

    def setup_module(self, module: nn.Module, units: Sequence[type | str] | None = None) -> nn.Module:
        sharded, self.shell, self.units = shard_task_model(module, units, self.device, compile=self.config.compile,
                                                           bf16_weights=self.precision.bf16_weights)
        return sharded

    def grad_scaler(self, precision: Precision) -> torch.amp.GradScaler:
        """FSDP's ShardedGradScaler: each rank sees only its shard's inf/NaN, and it all-reduces the finding, so
        every rank skips the same steps."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.device.type, enabled=precision.uses_scaler)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return gradient_sync_off(model)

    def full_state(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                   writers: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
        return full_state(module, optimizer, writers)

    def load_model_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(module, state, options=_options())

    def load_optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(module, optimizer, _by_name(module, state), options=_options())

    def plain_model(self, module: nn.Module, writers: list[int]) -> nn.Module | None:
        """Its weights gathered into the skeleton kept from before sharding, on the writers."""
        state = self.model_state(module, writers)
        return plain_model(self.shell, state, self.device, module) if state is not None else None

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "shard_units": self.units}


def unit_rule(model: nn.Module, named: Sequence[type | str] | None) -> list[nn.Module]:
    """The modules that become FSDP units (each all-gathered on its own), outermost first, never nested.
    `named` (Task.shard_units) that matches no module of the model is a RankUsageError."""
    # A task's wrapper of a Hugging Face model: the declaration is on the model inside.
    declared = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    names = _class_names(named) if named else declared
    if names:
        found = [m for m in model.modules() if m is not model and type(m).__name__ in names]
        if named and not found:
            raise RankUsageError(f"Task.shard_units names {', '.join(sorted(names))}, and the model has no module "
                                 "of that class (below its root) for --shard full to shard")
    else:
        found = [child for container in model.modules() if isinstance(container, (nn.ModuleList, nn.Sequential))
                 for child in _repeated_blocks(container)]
        if not found:  # no repeated block (an MLP's layers of several kinds): each top-level child with weights
            found = [child for child in model.children() if any(True for _ in child.parameters())]
    chosen: list[nn.Module] = []
    for module in found:  # a unit inside a unit already chosen would only split it further: the outer one wins
        if not any(_contains(outer, module) for outer in chosen):
            chosen.append(module)
    return chosen


def _class_names(named: Sequence[type | str]) -> set[str]:
    return {item if isinstance(item, str) else item.__name__ for item in named}


def _repeated_blocks(container: nn.Module) -> list[nn.Module]:
    children = list(container.children())
    if len(children) < 2 or len({type(c) for c in children}) != 1:
        return []
    return [c for c in children if any(True for _ in c.parameters())]


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial threshold, kept fixed


def return_freed_memory() -> None:
    """On a CPU rank, allocations from 128 KiB on are mapped on their own and unmapped when freed.

    glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB), so after the first
    all-gather buffer FSDP frees, the next ones come from the heap, whose freed blocks the process keeps: the
    wide MLP's training-state RSS under --shard full was 512 MB against DDP's 223 MB, and 156 MB with the
    threshold fixed (benchmarks/shard_cost.py). Fixing it is what M_MMAP_THRESHOLD (or MALLOC_MMAP_THRESHOLD_)
    does; it does nothing on another C library. It costs speed (each buffer is a fresh mapping, its pages
    faulted in: 345 -> 207 samples/s there): a MALLOC_MMAP_THRESHOLD_ the user set is left to rule."""
    import ctypes
    import ctypes.util
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc: nothing to fix
        pass


def shard_fully(model: nn.Module, units: list[nn.Module], device: torch.device, compile: bool = False,
                bf16_weights: bool = False) -> nn.Module:
    """fully_shard each unit, then the root, on a mesh of every rank; the model itself, sharded in place (its
    parameters are DTensors from here on, its names unchanged). compile (--compile): each unit is compiled in
    place first (Module.compile, torchtitan's order: per block, then sharded), so that FSDP's all-gathers and
    reduce-scatters stay outside the compiled graphs (dynamo skips FSDP's hooks); the root's own layers
    (embeddings, head) stay eager. bf16_weights (bf16-true): the sharded parameters stay fp32, the masters the
    optimizer updates; FSDP2 all-gathers them in bf16 (half the bytes) for a bf16 forward and backward, and
    reduce-scatters the gradients in fp32 (torchtitan's mixed_precision_param and mixed_precision_reduce)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_weights else \
        MixedPrecisionPolicy()

    if device.type == "cpu":
        return_freed_memory()

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for unit in units:
        if compile:
            unit.compile()
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def shard_task_model(module: nn.Module, shard_units, device: torch.device, compile: bool = False,
                     bf16_weights: bool = False) -> tuple[nn.Module, nn.Module, dict[str, int]]:
    """--shard full: (the module itself sharded, a meta-device skeleton of it taken before, its FSDP units by
    class). Where any rank built its model on the meta device, rank 0's weights are handed out after sharding."""
    shell, units = skeleton(module), unit_rule(module, shard_units)
    by_class = dict(Counter(type(unit).__name__ for unit in units))  # before fully_shard renames the classes
    from_rank0 = built_on_meta_anywhere(module, device)
    # Rank 0's whole tensors, kept alive past sharding until they are handed out; {} elsewhere.
    rank0_state = module.state_dict() if from_rank0 and torch.distributed.get_rank() == 0 else {}
    sharded = shard_fully(module, units, device, compile=compile, bf16_weights=bf16_weights)
    if from_rank0:
        take_rank0_weights(sharded, rank0_state, device)
    return sharded, shell, by_class


def built_on_meta_anywhere(model: nn.Module, device: torch.device) -> bool:
    """Whether any rank built its model on the meta device (a Task.model function under --shard full): then
    every rank takes part in handing rank 0's weights out (a collective; rank 0 itself must hold them)."""
    flags = torch.tensor([float(on_meta_device(model))], device=device)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    if flags.item() and torch.distributed.get_rank() == 0 and on_meta_device(model):
        raise RankUsageError("Task.model built on the meta device on rank 0 too: rank 0 must build it with its "
                             "weights, which --shard full hands to the other ranks")
    return bool(flags.item())


def take_rank0_weights(model: nn.Module, rank0_state: dict[str, torch.Tensor], device: torch.device) -> None:
    """After shard_fully, on every rank: a rank whose model has no storage gets it (to_empty), then each rank's
    shards are filled from rank 0's whole state_dict, tensor by tensor (set_model_state_dict's
    broadcast_from_rank0; the other ranks pass {}), and every buffer, persistent or not, is rank 0's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if on_meta_device(model):
        model.to_empty(device=device)
    set_model_state_dict(model, rank0_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():
        torch.distributed.broadcast(buffer, src=0)


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """DDP's no_sync for FSDP2: the backward passes inside accumulate gradients locally (unsharded until then),
    and the one after reduce-scatters them."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _options(**changes: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **changes)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, writers: list[int]) -> tuple[dict, dict]:
    """Every rank, collectively: the whole model's state_dict and the optimizer's (in the plain optimizer's
    format: state keyed by parameter index), both whole on the ranks in `writers` (CPU tensors when rank 0 is
    the only one: gathered one tensor at a time straight to host memory) and empty on the others."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _options(cpu_offload=writers == [0])
    model_state = get_model_state_dict(model, options=options)
    optimizer_state = {} if optimizer is None else get_optimizer_state_dict(model, optimizer, options=options)
    if torch.distributed.get_rank() not in writers:
        return {}, {}
    return model_state, optimizer_state and _by_index(model, optimizer_state)


def _trained_names(model: nn.Module) -> list[str]:
    """The optimizer's parameters by name, in its order (train.optim.build_optimizer: the trainable ones)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _by_index(model: nn.Module, state: dict) -> dict:
    index = {name: i for i, name in enumerate(_trained_names(model))}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def _by_name(model: nn.Module, state: dict) -> dict:
    names = _trained_names(model)
    return {"state": {names[int(i)]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                             for group in state["param_groups"]]}


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of the unsharded model on the meta device, taken before sharding, at no memory: its weights are
    loaded from the gathered state at the end (plain_model), for what needs the model whole on one rank."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


CONFIG_ATTRIBUTES = ("config", "generation_config")
"""What a Hugging Face model keeps beside its tensors and may change while it trains (its first forward sets
config.problem_type): the plain model takes the trained model's, so that save_pretrained writes the same."""


def plain_model(shell: nn.Module, state: dict, device: torch.device, trained: nn.Module) -> nn.Module:
    """The skeleton given the gathered weights, on `device`, and the trained model's configuration objects:
    the trained model as a plain module."""
    shell = shell.to_empty(device=device)
    shell.load_state_dict(state)
    for mine, theirs in zip(shell.modules(), trained.modules()):  # the same modules, in the same order
        for name in CONFIG_ATTRIBUTES:
            if hasattr(theirs, name):
                setattr(mine, name, getattr(theirs, name))
    return shell
