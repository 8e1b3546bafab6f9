"""--optimizer-impl compiled: bf16-true's AdamW step over the fp32 masters in one pass over memory.

torch's optimizers take one dtype per parameter, so the master-weight step (parallel.master) is three passes: the
bf16 gradients widened into fp32 tensors, torch's fused AdamW over the masters, the masters written back rounded
into the bf16 weights. On a CPU whose bf16 GEMMs run 4-5x fp32 those passes are a third of the step
(docs/benchmarks.md). Here torch.compile writes the one pass: it reads each bf16 gradient, updates the master and
AdamW's moments in fp32 and writes the bf16 weight, by torch's own AdamW formula (single tensor, not capturable).

The optimizer stays a torch.optim.AdamW for everything else: its param_groups (the LR schedule writes "lr"), its
state ("step", "exp_avg", "exp_avg_sq" per master) and so its state_dict, which checkpoints of every other
precision and implementation read and write. Every dense parameter (contiguous or channels-last, of any shape)
is handed over flattened, so the compiles are few (dynamic sizes; torch.compile specialises one-element tensors;
tests/unit/test_master_step.py counts them), and the step's scalars are a tensor, so neither the LR schedule nor
the bias corrections recompile it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import increment_version


def _adamw_one_pass(weight: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, grad_factor: torch.Tensor, scalars: torch.Tensor, beta1: float,
                    beta2: float, eps: float) -> None:
    """torch.optim.AdamW's update of one master (torch.optim.adam._single_tensor_adam with decoupled weight
    decay), its gradient read from bf16 and multiplied by `grad_factor` (gradient clipping's coefficient), its
    bf16 weight written from the result. `scalars`: this step's (1 - lr * weight_decay, the step size, the square
    root of the second bias correction), computed as torch computes them, in Python: a tensor, so that a new
    value is not a new compile, and ready, or inductor would compute the bias corrections' powers per vector."""
    decay, step_size, bias_correction2_sqrt = scalars[0], scalars[1], scalars[2]
    grad = grad.float() * grad_factor
    master.mul_(decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.sub_(exp_avg / denom * step_size)
    weight.copy_(master)


_compiled_pass = None


def adamw_one_pass(*args) -> None:
    """The compiled pass, compiled at its first call (dynamic shapes: one kernel for every flattened size).

    Outside any dispatch mode: the first step runs under the run's FLOP counter (torch's FlopCounterMode, a
    TorchDispatchMode, train.metrics), and torch.compile does not compile under one: it marks the function as
    not to compile, for good, and every later step would run it op by op. The update holds no FLOP that the
    counter counts (matmuls, convolutions, attention)."""
    from torch.utils._python_dispatch import _disable_current_modes

    global _compiled_pass
    if _compiled_pass is None:
        _compiled_pass = torch.compile(_adamw_one_pass, dynamic=True)
    with _disable_current_modes():
        _compiled_pass(*args)


def _flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as 1-D where each covers its memory densely in one and the same layout (contiguous,
    channels-last, any order of dimensions: element i of one is element i of the others), else as they are; each
    a new tensor over the same memory, not a view: torch.compile guards on a view's base (its shape, number of
    dimensions, strides: DDP's gradients are views into its buckets), and on each layout's strides, a compile
    for each kind of parameter, up to dynamo's limit (8), past which the update would run op by op."""
    layout = _layout(tensors[0])
    flat = layout is not None and all(_layout(t) == layout for t in tensors[1:])
    return tuple(_alias(t, (t.numel(),) if flat else t.shape, (1,) if flat else t.stride()) for t in tensors)


def _layout(tensor: torch.Tensor) -> tuple[tuple[int, int], ...] | None:
    """The (size, stride) of each dimension longer than one, in the dimensions' order (two tensors of one shape
    whose dimensions lie in memory in another order hold element i in different places: a contiguous moment of a
    channels-last master, as a checkpoint of --shard full brings it), where they cover numel() elements without a
    gap or an overlap (what a size-one dimension's stride is does not matter), else None."""
    dims = tuple((size, stride) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1)
    expected = 1
    for size, stride in sorted(dims, key=lambda dim: dim[1]):
        if stride != expected:
            return None
        expected *= size
    return dims


def _alias(tensor: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    """`tensor`'s memory in `shape` and `strides`, a tensor of its own (set_: no view, no base)."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), shape, strides)


class MasterAdamW(torch.optim.AdamW):
    """AdamW over the fp32 masters whose step reads the model's bf16 gradients and writes its bf16 weights.

    `pairs`: (the model's bf16 parameter, its master), the masters being what the optimizer was given. The
    gradients stay on the model's parameters (DDP's all-reduced bf16) until the step, which drops them; clipping
    scales them through `grad_factor`, inside the pass, not by rounding them in place."""

    def __init__(self, params: list[nn.Parameter], pairs: list[tuple[nn.Parameter, nn.Parameter]], *,
                 lr: float, weight_decay: float, **options) -> None:
        super().__init__(params, lr=lr, weight_decay=weight_decay, **options)
        self.weight_of = {id(master): weight for weight, master in pairs}
        self.grad_factor: torch.Tensor | None = None
        """The factor of the next step's gradients (clipping's), None for 1."""

    def gradients(self) -> list[torch.Tensor]:
        """The gradients the next step takes (bf16, on the model's parameters)."""
        return [grad for group in self.param_groups for master in group["params"]
                if (grad := self.weight_of[id(master)].grad) is not None]

    @torch.no_grad()
    def norm_and_clip(self, limit: float | None) -> torch.Tensor:
        """The gradients' global 2-norm, summed in fp32 (what the masters' fp32 gradients would give); with a
        `limit`, the next step scales them as torch's clip_grad_norm_ would (limit / (norm + 1e-6), at most 1)."""
        grads = self.gradients()
        if not grads:
            self.grad_factor = None
            return torch.zeros(())
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
        self.grad_factor = None if limit is None else torch.clamp(limit / (norm + 1e-6), max=1.0)
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("--optimizer-impl compiled: the step takes no closure")
        try:
            # Before any group steps (a checkpoint's groups can bring these): no step half taken.
            if any(group["amsgrad"] or group["maximize"] for group in self.param_groups):
                raise ValueError("--optimizer-impl compiled runs plain AdamW (no amsgrad, no maximize)")
            for group in self.param_groups:
                self._step_group(group)
        finally:
            self.grad_factor = None  # one step's clipping, never the next one's

    def _step_group(self, group: dict) -> None:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        factors: dict[torch.device, torch.Tensor] = {}
        for master in group["params"]:
            weight = self.weight_of[id(master)]
            if weight.grad is None:
                continue
            if master.device not in factors:
                factor = self.grad_factor if self.grad_factor is not None else torch.ones(())
                factors[master.device] = factor.to(master.device, torch.float32)
            state = self._state_of(master)
            step = state["step"].item() + 1  # on the CPU, as in torch's AdamW (not fused, not capturable)
            if master.numel():  # (an empty one only counts the step, as torch's)
                scalars = torch.tensor([1 - lr * group["weight_decay"], lr / (1 - beta1 ** step),
                                        (1 - beta2 ** step) ** 0.5], device=master.device)
                written = (weight, master, state["exp_avg"], state["exp_avg_sq"])
                adamw_one_pass(*_flat(weight, weight.grad, *written[1:]), factors[master.device], scalars, beta1,
                               beta2, group["eps"])
                increment_version(written)  # written through aliases: autograd's in-place record, as torch's
            state["step"] += 1
            weight.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The masters' gradients (none: the step reads the model's) and the model's bf16 ones, which the next
        step would take, with any clipping asked for them."""
        super().zero_grad(set_to_none)
        self.grad_factor = None
        for weight in self.weight_of.values():
            if weight.grad is not None:
                if set_to_none:
                    weight.grad = None
                else:
                    weight.grad.zero_()

    def _state_of(self, master: nn.Parameter) -> dict[str, torch.Tensor]:
        """AdamW's state of `master`, begun as torch's (step 0, moments zero); the step on the CPU, where a
        checkpoint of torch's fused AdamW left it on the master's device."""
        state = self.state[master]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        if state["step"].device.type != "cpu":
            state["step"] = state["step"].cpu()
        return state
