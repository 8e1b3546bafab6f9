"""--dtype bf16-true under DDP (--shard none and optimizer): the model holds and computes with bf16 weights, and
the optimizer updates fp32 master copies of them (DeepSpeed's bf16, Intel's CPU training recipes).

Autocast over fp32 weights casts every weight to bf16 in each forward and the bf16 gradients back in each
backward; here the weights are bf16 already, the backward makes bf16 gradients (DDP all-reduces half the
bytes), and once a step the gradients are copied into the masters' (fp32), the optimizer steps the masters and
they are copied back, rounded, into the model. An update far below a bf16 ulp of a weight still moves its
master, and so, once the moves add up, the weight.

Checkpoints and model.pt hold the masters in place of the model's bf16 weights: a run resumes bit-exactly and
can continue in another precision, and a checkpoint of any precision resumes here from its fp32 weights. (Under
--shard full, FSDP2 keeps the sharded parameters in fp32 and all-gathers them in bf16: parallel.fsdp.)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


class MasterWeights:
    """fp32 copies of a module's floating-point parameters, taken before the module is cast to bf16: the trainable
    ones are what the optimizer updates; the frozen ones are kept so that checkpoints and model.pt hold them as
    they were (a frozen backbone is not rounded to bf16 for good). The module's floating-point buffers (running
    statistics) are bf16 from here on, as the model's own."""

    def __init__(self, module: nn.Module) -> None:
        floating = [p for p in module.parameters() if p.is_floating_point()]
        self.master_of: dict[int, nn.Parameter] = {
            id(p): nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in floating}
        self.pairs = [(p, self.master_of[id(p)]) for p in floating if p.requires_grad]
        # Every name a parameter has (a tied one has several): the keys of state_dict that hold it.
        self.names = {name: self.master_of[id(p)] for name, p in module.named_parameters(remove_duplicate=False)
                      if id(p) in self.master_of}
        module.to(torch.bfloat16)  # parameters and floating-point buffers, in place: the same Parameter objects
        self.moved_by_optimizer = False
        """The optimizer itself reads the bf16 gradients and writes the bf16 weights (parallel.master_step): no
        gradients taken, nothing written back here."""

    @torch.no_grad()
    def agree(self) -> None:
        """Every rank's masters made rank 0's, as DDP made the module's weights when it wrapped it (a model whose
        initialisation drew from numpy or `random`, seeded per rank, differs between ranks until then)."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            for work in [dist.broadcast(master, src=0, async_op=True) for master in self.master_of.values()]:
                work.wait()

    def for_optimizer(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The masters of `params`, in their order: what the optimizer updates (its state keyed by index, as a
        plain run's is, so checkpoints pass between precisions)."""
        return [self.master_of.get(id(p), p) for p in params]

    @torch.no_grad()
    def take_gradients(self) -> None:
        """The model's bf16 gradients (all-reduced) into the masters', as fp32; the model's are dropped. A second
        call before the next backward finds none and leaves the masters' as they are."""
        for param, master in self.pairs:
            if param.grad is not None:
                master.grad = param.grad.float()
                param.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """The updated masters into the model's weights, rounded to bf16."""
        torch._foreach_copy_([param for param, _ in self.pairs], [master for _, master in self.pairs])

    def state_with_masters(self, state: dict[str, Any]) -> dict[str, Any]:
        """A state_dict of the module with the masters in place of its bf16 weights."""
        return {key: self.names[key].detach() if key in self.names else value for key, value in state.items()}

    @torch.no_grad()
    def load(self, state: dict[str, Any]) -> None:
        """The masters from a whole state_dict (its fp32 weights, of any precision's checkpoint), after the module
        itself loaded it (rounded)."""
        for key, master in self.names.items():
            if key in state:
                master.copy_(state[key])

    def fp32_copy(self, module: nn.Module) -> nn.Module:
        """The module in fp32 with the masters' values (its buffers as they are, widened)."""
        plain = copy.deepcopy(module).float()
        plain.load_state_dict(self.state_with_masters(module.state_dict()))
        return plain
