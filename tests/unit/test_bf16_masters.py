"""--dtype bf16-true's fp32 masters (parallel.master.MasterWeights), in-process: after a step the model's bf16
weights are the masters rounded, and an update far below a bf16 ulp moves the master alone."""

import torch
from torch import nn

from ddp_amp.parallel.master import MasterWeights


def _step(module: nn.Module, masters: MasterWeights, optimizer: torch.optim.Optimizer) -> None:
    module.zero_grad(set_to_none=True)
    module(torch.ones(4, 8, dtype=torch.bfloat16)).square().mean().backward()
    masters.take_gradients()
    optimizer.step()
    masters.write_back()


def test_after_a_step_the_bf16_weights_are_the_updated_masters_rounded():
    torch.manual_seed(0)
    module = nn.Linear(8, 3)
    masters = MasterWeights(module)
    optimizer = torch.optim.SGD(masters.for_optimizer(list(module.parameters())), lr=0.1)
    before = [master.detach().clone() for _, master in masters.pairs]
    _step(module, masters, optimizer)
    for (param, master), old in zip(masters.pairs, before):
        assert param.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert not torch.equal(master, old)  # the optimizer stepped the masters
        assert torch.equal(param, master.detach().to(torch.bfloat16))  # and the model holds them, rounded


def test_an_update_below_a_bf16_ulp_moves_the_master_and_only_later_the_weight():
    module = nn.Linear(8, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(1.0)
    masters = MasterWeights(module)
    optimizer = torch.optim.SGD(masters.for_optimizer(list(module.parameters())), lr=1e-4)
    _step(module, masters, optimizer)
    (param, master), = masters.pairs
    assert (master < 1.0).all() and (master > 1.0 - 2 ** -8).all()  # moved by less than bf16's ulp at 1
    assert torch.equal(param, torch.ones_like(param))  # the rounded weight has not moved yet
    for _ in range(40):
        _step(module, masters, optimizer)
    assert (param < 1.0).all() and torch.equal(param, master.detach().to(torch.bfloat16))
