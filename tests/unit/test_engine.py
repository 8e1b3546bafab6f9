"""The one engine under both loops, in-process on a real one-rank gloo group: the optimizer's update
(train.update, the only place that steps an optimizer through the scaler), the strategy's no-sync choice, and
the checkpoint manager over a script loop's named parts (train.parts.NamedParts) in both formats."""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddp_amp.checkpoint.manager import CheckpointManager
from ddp_amp.config import TrainConfig
from ddp_amp.errors import RankSetupError
from ddp_amp.parallel import strategy_for
from ddp_amp.train.data import RankData
from ddp_amp.train.parts import NamedParts
from ddp_amp.train.update import OptimizerUpdate

CPU = torch.device("cpu")


def test_an_overflowing_update_skips_the_step_and_its_schedulers_and_zeroes_the_gradients(one_rank_group):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    update = OptimizerUpdate(optimizer, scaler, strategy_for(TrainConfig(), CPU), clip_grad=None,
                             schedulers=[scheduler])
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(2, 3)).sum() * float("inf")).backward()
    stepped, norm = update()
    assert (stepped, norm, update.steps_taken, scheduler.last_epoch) == (False, None, 0, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert scaler.get_scale() == 2.0 ** 15  # halved from 65536
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    stepped, _ = update()
    assert (stepped, update.steps_taken, scheduler.get_last_lr()) == (True, 1, [0.05])
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_clipping_reads_the_unscaled_norm_and_steps_with_the_clipped_gradients(one_rank_group):
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=True, init_scale=1024.0)
    update = OptimizerUpdate(optimizer, scaler, strategy_for(TrainConfig(), CPU), clip_grad=1.0)
    scaler.scale((model(torch.tensor([[3.0, 4.0]]))).sum()).backward()  # gradient (3, 4), norm 5, scaled by 1024
    stepped, norm = update(want_norm=True)
    assert stepped and norm.item() == pytest.approx(5.0)
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[-0.6, -0.8]]))  # clipped to norm 1


def test_the_strategys_no_backward_sync_skips_the_all_reduce_of_a_backward_whose_forward_ran_inside_it(one_rank_group):
    strategy = strategy_for(TrainConfig(), CPU)
    model = strategy.setup_module(nn.Linear(3, 1))
    reduced = []

    def counted(state, bucket):
        reduced.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, counted)
    with strategy.no_backward_sync(model, enabled=True):  # a micro-step that is not the step's last
        model(torch.ones(2, 3)).sum().backward()
    assert reduced == []
    with strategy.no_backward_sync(model, enabled=False):  # the last: its backward reduces what accumulated
        model(torch.ones(2, 3)).sum().backward()
    assert reduced == [1]


def _named_parts(seed: int, dataset_size: int = 32, **implementation: bool) -> NamedParts:
    torch.manual_seed(seed)
    strategy = strategy_for(TrainConfig(), CPU)
    module = nn.Linear(4, 2)
    wrapped = strategy.setup_module(module)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=0.01, **implementation)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    data = RankData(torch.arange(dataset_size), _env(), CPU, batch_size=4, seed=5, workers=0)  # the run's --seed
    return NamedParts(strategy, torch.amp.GradScaler("cpu", enabled=False), {"net": module},
                      {"opt": (module, optimizer)}, {"sched": scheduler, "data": data})


def _env():
    from ddp_amp.dist import DistEnv

    return DistEnv.from_environ()


def _train(parts: NamedParts, steps: int) -> None:
    (_, optimizer), = parts.optimizers.values()
    module, batches = parts.models["net"], parts.others["data"].batches()
    for _ in range(steps):
        module(next(batches).float().unsqueeze(1).expand(-1, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        parts.others["sched"].step()


@pytest.mark.parametrize("checkpoint_format", ["single", "sharded"])
def test_a_script_loops_named_parts_come_back_whole_from_the_core_manager(one_rank_group, tmp_path,
                                                                        checkpoint_format):
    """Saved in the background after 3 steps, loaded into parts built from another seed: the model, the
    optimizer's moments, the schedule and the data position are the saved ones; the next batch is the one the
    saved run would have taken."""
    config = TrainConfig(checkpoint_format=checkpoint_format, launch_time=1.0)
    saved = _named_parts(seed=0)
    _train(saved, 3)
    manager = CheckpointManager(config, one_rank_group, tmp_path, CPU)
    manager.save(saved, 3)
    manager.close()
    fresh = _named_parts(seed=1)
    restored = CheckpointManager(config, one_rank_group, tmp_path, CPU).load(fresh, writers=[0])
    assert (restored.step, restored.world_size) == (3, 1)
    assert all(torch.equal(a, b) for a, b in zip(saved.models["net"].state_dict().values(),
                                                  fresh.models["net"].state_dict().values()))
    saved_moments = saved.optimizers["opt"][1].state_dict()["state"]
    fresh_moments = fresh.optimizers["opt"][1].state_dict()["state"]
    assert all(torch.equal(saved_moments[i]["exp_avg"], fresh_moments[i]["exp_avg"]) for i in saved_moments)
    assert fresh.others["sched"].last_epoch == 3 and fresh.others["data"].state_dict() == \
        saved.others["data"].state_dict()
    assert torch.equal(next(fresh.others["data"].batches()), next(saved.others["data"].batches()))


@pytest.mark.parametrize("checkpoint_format", ["single", "sharded"])
def test_a_script_loops_optimizer_keeps_the_implementation_the_script_gave_it(one_rank_group, tmp_path,
                                                                             checkpoint_format):
    """torch's load_state_dict takes every group setting from the checkpoint: a script that builds its AdamW
    fused, resumed from a checkpoint of its per-parameter-loop version, stepped in the loop. It keeps fused, with
    the checkpoint's moments and step counts."""
    config = TrainConfig(checkpoint_format=checkpoint_format, launch_time=1.0, async_checkpoint=False)
    saved = _named_parts(seed=0, foreach=False)
    _train(saved, 2)
    CheckpointManager(config, one_rank_group, tmp_path, CPU).save(saved, 2)
    fresh = _named_parts(seed=1, fused=True)
    assert CheckpointManager(config, one_rank_group, tmp_path, CPU).load(fresh, writers=[0]).step == 2
    optimizer = fresh.optimizers["opt"][1]
    assert optimizer.param_groups[0]["fused"] is True and not optimizer.param_groups[0]["foreach"]
    assert [state["step"].item() for state in optimizer.state.values()] == [2.0, 2.0]
    saved_moments = saved.optimizers["opt"][1].state_dict()["state"]
    assert all(torch.equal(saved_moments[i]["exp_avg"], optimizer.state_dict()["state"][i]["exp_avg"])
               for i in saved_moments)
    _train(fresh, 1)  # and it steps fused from the loaded state
    assert [state["step"].item() for state in optimizer.state.values()] == [3.0, 3.0]


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before_and_said(one_rank_group, tmp_path, capsys):
    config = TrainConfig(launch_time=1.0, async_checkpoint=False)
    parts = _named_parts(seed=0)
    manager = CheckpointManager(config, one_rank_group, tmp_path, CPU)
    for step in (1, 2):
        _train(parts, 1)
        manager.save(parts, step)
    newest = tmp_path / "checkpoints" / "step-2.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # a write cut short
    loader = CheckpointManager(config, one_rank_group, tmp_path, CPU)
    assert loader.load(_named_parts(seed=1), writers=[0]).step == 1
    assert len(loader.skipped) == 1 and loader.skipped[0].startswith(str(newest))
    assert f"warning: skipping checkpoint {newest}" in capsys.readouterr().out


def test_a_checkpoint_without_a_part_the_loop_registered_is_refused_naming_it(one_rank_group, tmp_path):
    config = TrainConfig(launch_time=1.0, async_checkpoint=False)
    parts = _named_parts(seed=0)
    CheckpointManager(config, one_rank_group, tmp_path, CPU).save(parts, 1)
    more = _named_parts(seed=0)
    more.others["ema"] = torch.optim.lr_scheduler.StepLR(more.optimizers["opt"][1], step_size=1)
    with pytest.raises(RankSetupError) as refused:
        CheckpointManager(config, one_rank_group, tmp_path, CPU).load(more, writers=[0])
    assert str(refused.value) == (f"--resume {tmp_path / 'checkpoints' / 'step-1.pt'}: no ema in it (it holds data, "
                                  "net, opt, sched)")


def test_a_checkpoint_of_the_loop_before_it_ran_on_the_core_manager_still_resumes(one_rank_group, tmp_path):
    """What ddp_amp.loop wrote before: its names' states, the scaler under "_scaler", the loader's position as
    batches taken, a config of the loop's five settings. The core manager continues it: the weights, and the
    data position as a cursor (2 batches of 4 on 1 rank: sample 8 of the epoch's order next)."""
    from ddp_amp.checkpoint import storage

    saved = _named_parts(seed=0)
    _train(saved, 2)
    old = {"step": 2, "saved_at": 1.0, "world_size": 1, "rng": [storage.rng_state(CPU)],
           "config": {"amp": "auto", "dtype": "auto", "grad_accum": 1, "shard": "none", "seed": 0,
                      "launch_time": 0.5, "launch": "process:0.5", "loop": True},
           "trainer": {"net": saved.models["net"].state_dict(), "opt": saved.optimizers["opt"][1].state_dict(),
                       "sched": saved.others["sched"].state_dict(), "data": {"epoch": 0, "taken": 2},
                       "_scaler": {}}}
    path = storage.save_checkpoint(tmp_path, old, keep=2, checksum=False)
    config = TrainConfig(launch_time=1.0, resume=str(path))
    fresh = _named_parts(seed=1)
    assert CheckpointManager(config, one_rank_group, tmp_path, CPU).load(fresh, writers=[0]).step == 2
    assert all(torch.equal(a, b) for a, b in zip(saved.models["net"].state_dict().values(),
                                                  fresh.models["net"].state_dict().values()))
    assert fresh.others["data"].state_dict()["cursor"] == 8
