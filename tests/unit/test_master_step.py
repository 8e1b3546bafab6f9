"""--optimizer-impl compiled (parallel.master_step): bf16-true's AdamW in one compiled pass is torch's AdamW over
the fp32 masters, its state_dict is torch's, clipping happens inside the pass, and the run's choices reach it."""

import copy

import pytest
import torch

from ddp_amp.config import TrainConfig
from ddp_amp.parallel.master_step import MasterAdamW
from ddp_amp.precision import Precision
from ddp_amp.train.optim import optimizer_impl

SHAPES = [(64, 32), (64,), (1, 64), (1,), (2, 3, 4), (2, 2, 2, 2, 2), (8, 4, 3, 3)]


def bf16_model_and_masters(seed: int = 0):
    """(bf16 weights, their fp32 masters, plain fp32 copies for torch's AdamW), one of them channels-last."""
    torch.manual_seed(seed)
    masters = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    masters[-1] = torch.nn.Parameter(masters[-1].detach().to(memory_format=torch.channels_last))
    weights = [torch.nn.Parameter(m.detach().bfloat16()) for m in masters]
    plain = [torch.nn.Parameter(m.detach().clone()) for m in masters]
    return weights, masters, plain


def new_gradients(weights, scale: float = 1.0) -> list[torch.Tensor]:
    """bf16 gradients laid out as their weights (DDP's bucket views take each parameter's strides)."""
    return [torch.empty_like(w).copy_(torch.randn(w.shape) * scale) for w in weights]


def hand_out(gradients, weights, plain) -> None:
    """The same bf16 gradients to the model's weights (as DDP leaves them) and, widened, to the plain copies."""
    for weight, widened, grad in zip(weights, plain, gradients):
        weight.grad, widened.grad = grad.clone(), grad.float()  # both keep the weight's layout


def groups(params):
    """Two groups with their own rate and decay, as a user's factory may build."""
    return [{"params": params[:2], "lr": 3e-3, "weight_decay": 0.1}, {"params": params[2:], "lr": 1e-3}]


def test_the_compiled_step_is_torchs_adamw_over_the_masters_and_writes_the_bf16_weights():
    weights, masters, plain = bf16_model_and_masters()
    compiled = MasterAdamW(groups(masters), list(zip(weights, masters)), lr=1e-3, weight_decay=0.01)
    reference = torch.optim.AdamW(groups(plain), lr=1e-3, weight_decay=0.01, foreach=False)
    for step in range(6):
        for optimizer in (compiled, reference):  # a schedule: a new rate each step
            for group, base in zip(optimizer.param_groups, (3e-3, 1e-3)):
                group["lr"] = base * (1 - step / 10)
        hand_out(new_gradients(weights), weights, plain)
        compiled.step()
        reference.step()
        assert all(w.grad is None for w in weights)  # taken by the step, as the strategy's take_gradients did
        for weight, master, value in zip(weights, masters, plain):
            torch.testing.assert_close(master, value, rtol=1e-5, atol=1e-6)
            assert torch.equal(weight, master.detach().bfloat16())
    ours, torchs = compiled.state_dict(), reference.state_dict()
    implementation = ("foreach", "fused")  # how torch's runs, the one setting the two may differ in
    assert ([{k: v for k, v in group.items() if k not in implementation} for group in ours["param_groups"]]
            == [{k: v for k, v in group.items() if k not in implementation} for group in torchs["param_groups"]])
    for index, state in torchs["state"].items():
        assert set(ours["state"][index]) == set(state) and torch.equal(ours["state"][index]["step"], state["step"])
        torch.testing.assert_close(ours["state"][index]["exp_avg_sq"], state["exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_a_new_rate_is_not_a_new_compile():
    """The LR schedule writes a new float each step: passed as a tensor, it reuses the compiled pass."""
    from torch._dynamo.utils import counters

    weights, masters, plain = bf16_model_and_masters()
    optimizer = MasterAdamW(masters, list(zip(weights, masters)), lr=1e-3, weight_decay=0.01)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    hand_out(new_gradients(weights), weights, plain)
    optimizer.step()
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > before  # the pass did compile
    for step in range(3):
        optimizer.param_groups[0]["lr"] = 1e-3 / (step + 2)
        hand_out(new_gradients(weights), weights, plain)
        optimizer.step()
    assert counters["stats"]["unique_graphs"] == compiled


def test_every_kind_of_parameter_shares_two_compiles():
    """Shapes of every rank (0-d, 1-element, (1, 1, d), 5-D, empty), gradients at any offset in one bucket (DDP's
    bucket views), channels-last weights of every kind (size-one dimensions among them, whose strides are free):
    one compile for every dense layout, handed over flattened, one for the one-element ones (torch.compile
    specialises size 1), far below dynamo's recompile limit (8), past which the update would run op by op. Views
    handed to it would each be guarded by their base, layouts as they are by their strides: seven compiles and
    more here. And the update is torch's AdamW's, element for element, in every layout; a gradient laid out
    unlike its weight is taken as it is (a compile of its own)."""
    from torch._dynamo.utils import counters

    shapes = [(64, 32), (64,), (1, 64), (1,), (), (1, 1, 16), (1, 5, 16), (2, 3, 4), (2, 2, 2, 2, 2), (0, 4),
              (8, 4, 3, 3), (1, 8, 3, 3), (4, 4, 1, 7), (4, 4, 7, 1), (6, 4, 2, 2)]
    torch.manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    for index in range(10, 15):
        masters[index] = torch.nn.Parameter(masters[index].detach().to(memory_format=torch.channels_last))
    weights = [torch.nn.Parameter(m.detach().bfloat16()) for m in masters]
    plain = [torch.nn.Parameter(m.detach().clone()) for m in masters]
    optimizer = MasterAdamW(masters, list(zip(weights, masters)), lr=1e-3, weight_decay=0.01)
    reference = torch.optim.AdamW(plain, lr=1e-3, weight_decay=0.01, foreach=False)
    bucket = torch.zeros(sum(w.numel() for w in weights), dtype=torch.bfloat16)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for step in range(3):
        offset = 0
        for weight, widened in zip(weights, plain):
            if weight.is_contiguous():
                weight.grad = bucket[offset:offset + weight.numel()].view(weight.shape)
                offset += weight.numel()
            else:
                weight.grad = torch.empty_like(weight)
            weight.grad.copy_(torch.randn(weight.shape))
            widened.grad = weight.grad.float()
        if step == 2:  # the last layout: a contiguous gradient for a channels-last weight
            weights[-1].grad = weights[-1].grad.contiguous()
        optimizer.step()
        reference.step()
        if step == 1:
            assert counters["stats"]["unique_graphs"] - before == 2
    assert counters["stats"]["unique_graphs"] - before == 3
    for weight, master, value in zip(weights, masters, plain):
        torch.testing.assert_close(master, value, rtol=1e-5, atol=1e-6)
        assert torch.equal(weight, master.detach().bfloat16())
    assert optimizer.state[masters[9]]["step"].item() == 3  # the empty one: its steps counted, as torch's


def test_moments_laid_out_unlike_their_master_are_taken_element_for_element():
    """A checkpoint of --shard full holds contiguous moments, and torch's load_state_dict keeps their layout: for
    a channels-last master of (2, 3, 3, 3), whose three equal dimensions lie in memory in another order, the same
    sizes and strides sorted, flattened alike would pair element i of one with another element of the other."""
    torch.manual_seed(0)
    master = torch.nn.Parameter(torch.randn(2, 3, 3, 3).to(memory_format=torch.channels_last))
    weight = torch.nn.Parameter(master.detach().bfloat16())
    plain = torch.nn.Parameter(master.detach().clone())
    optimizer = MasterAdamW([master], [(weight, master)], lr=1e-2, weight_decay=0.01)
    reference = torch.optim.AdamW([plain], lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(3):
        hand_out(new_gradients([weight]), [weight], [plain])
        optimizer.step()
        reference.step()
        if step == 0:  # as a load of that checkpoint leaves them
            state = optimizer.state[master]
            state["exp_avg"], state["exp_avg_sq"] = state["exp_avg"].contiguous(), state["exp_avg_sq"].contiguous()
        torch.testing.assert_close(master, plain, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(optimizer.state[master]["exp_avg"], reference.state[plain]["exp_avg"])


def test_its_checkpoints_and_torchs_adamws_pass_both_ways():
    """The state_dict is torch's AdamW's: each resumes from the other's and goes on as the other would."""
    weights, masters, plain = bf16_model_and_masters()
    compiled = MasterAdamW(masters, list(zip(weights, masters)), lr=1e-3, weight_decay=0.01)
    reference = torch.optim.AdamW(plain, lr=1e-3, weight_decay=0.01, fused=True)
    for _ in range(2):
        hand_out(new_gradients(weights), weights, plain)
        compiled.step()
        reference.step()
    compiled.load_state_dict(copy.deepcopy(reference.state_dict()))  # from torch's fused AdamW's checkpoint
    with torch.no_grad():
        for master, value, weight in zip(masters, plain, weights):
            master.copy_(value)
            weight.copy_(value)
    gradients = new_gradients(weights)
    hand_out(gradients, weights, plain)
    compiled.step()
    reference.step()
    for master, value in zip(masters, plain):
        torch.testing.assert_close(master, value, rtol=1e-5, atol=1e-6)
    back_params = [torch.nn.Parameter(m.detach().clone()) for m in masters]
    back = torch.optim.AdamW(back_params, lr=1e-3, weight_decay=0.01, foreach=False)
    back.load_state_dict(copy.deepcopy(compiled.state_dict()))  # and torch's AdamW from ours
    assert all(back.state[p]["step"].item() == 3 for p in back.param_groups[0]["params"])
    hand_out(new_gradients(weights), weights, back_params)
    compiled.step()
    back.step()  # goes on as ours does: the moments came across
    for master, value in zip(masters, back_params):
        torch.testing.assert_close(master, value, rtol=1e-5, atol=1e-6)


def test_clipping_scales_the_gradients_inside_the_pass_by_torchs_coefficient():
    """norm_and_clip: the global norm summed in fp32 (what the masters' fp32 gradients give), and a step that
    moves the masters as torch's AdamW after clip_grad_norm_ of the fp32 gradients; the bf16 gradients are not
    rounded by a scaling in place."""
    weights, masters, plain = bf16_model_and_masters()
    compiled = MasterAdamW(masters, list(zip(weights, masters)), lr=1e-2, weight_decay=0.0)
    reference = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.0, foreach=False)
    for _ in range(3):
        gradients = new_gradients(weights, 3.0)
        hand_out(gradients, weights, plain)
        norm = compiled.norm_and_clip(1.0)
        expected = torch.nn.utils.clip_grad_norm_(plain, 1.0)
        assert norm.dtype == torch.float32 and norm.item() == pytest.approx(expected.item(), rel=1e-6)
        assert norm > 1.0 and all(torch.equal(w.grad, g) for w, g in zip(weights, gradients))
        compiled.step()
        reference.step()
        for master, value in zip(masters, plain):
            torch.testing.assert_close(master, value, rtol=1e-5, atol=1e-6)
    assert compiled.grad_factor is None  # one step's clipping is not the next one's


def test_zero_grad_drops_the_gradients_and_the_clipping_the_next_step_would_take():
    """What an out-of-memory rerun does (Strategy.drop_gradients): nothing of the failed try reaches the step."""
    weights, masters, plain = bf16_model_and_masters()
    optimizer = MasterAdamW(masters, list(zip(weights, masters)), lr=1e-3, weight_decay=0.0)
    hand_out(new_gradients(weights, 3.0), weights, plain)
    optimizer.norm_and_clip(0.1)
    assert optimizer.grad_factor is not None
    optimizer.zero_grad()
    assert optimizer.grad_factor is None and all(w.grad is None for w in weights)
    before = [m.detach().clone() for m in masters]
    optimizer.step()  # no gradient: nothing moves
    assert all(torch.equal(m, b) for m, b in zip(masters, before))
    hand_out(new_gradients(weights, 3.0), weights, plain)
    optimizer.norm_and_clip(0.1)
    optimizer.norm_and_clip(None)  # a norm asked for without clipping: no earlier call's factor left
    assert optimizer.grad_factor is None


def test_amsgrad_from_a_checkpoints_groups_is_refused_before_any_group_steps():
    """torch's load_state_dict takes every group setting, amsgrad and maximize too: refused before the first
    group moves, and no step counted."""
    weights, masters, plain = bf16_model_and_masters()
    optimizer = MasterAdamW(groups(masters), list(zip(weights, masters)), lr=1e-3, weight_decay=0.01)
    hand_out(new_gradients(weights), weights, plain)
    optimizer.step()
    optimizer.param_groups[1]["amsgrad"] = True
    hand_out(new_gradients(weights), weights, plain)
    before = [m.detach().clone() for m in masters]
    with pytest.raises(ValueError, match="no amsgrad, no maximize"):
        optimizer.step()
    assert all(torch.equal(m, b) for m, b in zip(masters, before))
    assert all(state["step"].item() == 1 for state in optimizer.state.values())
    assert all(w.grad is not None for w in weights)


def test_zero_1_never_builds_the_compiled_step():
    """ZeroStrategy is a DDPStrategy: without its own refusal it would build an unsharded MasterAdamW, which
    its full_state (consolidate_state_dict) then fails on."""
    from ddp_amp.parallel import strategy_for

    strategy = strategy_for(TrainConfig(task="mlp", amp="on", dtype="bf16-true", shard="optimizer"),
                            torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="--shard optimizer"):
        strategy.compiled_adamw([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, weight_decay=0.0)


LARGE = [torch.empty(4096, 1024), torch.empty(1024, 4096), torch.empty(1024)]  # 2.8 M elements on average
SMALL = [torch.empty(1024, 1024), *[torch.empty(1024)] * 3]  # 0.26 M on average, though one is 1 M


@pytest.mark.parametrize(("dtype", "shard", "compile", "device", "params", "expected"), [
    ("bf16-true", "none", True, "cpu", LARGE, "compiled"), ("bf16-true", "none", False, "cpu", LARGE, "fused"),
    ("bf16-true", "optimizer", True, "cpu", LARGE, "fused"), ("bf16", "none", True, "cpu", LARGE, "fused"),
    ("bf16-true", "none", True, "cuda", LARGE, "fused"), ("bf16-true", "none", True, "cpu", SMALL, "fused"),
    ("bf16-true", "none", True, "cpu", [], "fused")])
def test_auto_picks_the_compiled_step_where_the_run_compiles_and_it_applies(dtype, shard, compile, device, params,
                                                                           expected):
    """Where the tensors are small on average the compiled step's per-tensor host work outweighs what it saves
    (benchmarks/master_step.py --shapes transformer: 1.41-1.53x the three passes' time): auto keeps fused there."""
    config = TrainConfig(task="mlp", amp="on", dtype=dtype, shard=shard, compile=compile)
    assert optimizer_impl(config, Precision(dtype), device, params) == expected


def test_the_compiled_step_asked_for_on_gpus_is_refused_in_one_line():
    """Untried on a GPU: asked for there, refused before launch (the CPU cases: tests/unit/test_launch_refusals)."""
    from ddp_amp.errors import UsageError
    from ddp_amp.launch.option_checks import check_compiled_step

    config = TrainConfig(task="mlp", amp="on", dtype="bf16-true", optimizer_impl="compiled")
    check_compiled_step(config, Precision("bf16-true"), "cpu")
    with pytest.raises(UsageError, match="^--optimizer-impl compiled runs on CPU ranks, and these compute on GPUs"):
        check_compiled_step(config, Precision("bf16-true"), "cuda")


class Recorder:
    def __init__(self):
        self.records = []

    def on_log(self, record):
        self.records.append(record)


def test_a_run_with_the_compiled_step_moves_the_masters_as_the_three_passes_do(one_rank_group, tmp_path):
    """The trainer in bf16-true, --optimizer-impl compiled against fused (the masters' three passes), clipped, at
    a rate whose updates are far below a bf16 ulp of the weights: the bf16 weights cannot move, the masters move
    alike in both, the logged norms agree, no master ever holds a gradient (none was widened), and the update ran
    compiled from the first step (which runs under the FLOP counter, a dispatch mode torch.compile skips)."""
    from ddp_amp.train.trainer import Trainer

    import helper_tasks

    def run(impl):
        config = TrainConfig(task="inline", steps=4, log_every=2, batch_size=16, seed=5, schedule="constant",
                             lr=1e-5, clip_grad=0.05, amp="on", dtype="bf16-true", optimizer_impl=impl,
                             run_dir=str(tmp_path / impl))
        torch.manual_seed(5)
        task = helper_tasks.plain_regression()
        initial = {k: v.clone() for k, v in task.model.state_dict().items()}
        recorder = Recorder()
        trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("bf16-true"), task, recorder)
        masters = trainer.optimizer.param_groups[0]["params"]
        widened = []
        trainer.optimizer.register_step_pre_hook(lambda *_: widened.append(any(m.grad is not None for m in masters)))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            trainer.train()
        ops[impl] = {event.key: event.count for event in profiler.key_averages()}
        held, saved = dict(trainer.module.state_dict()), trainer.model_state()
        trainer.close()
        return initial, held, saved, [r["grad_norm"] for r in recorder.records], widened, trainer.optimizer_impl

    ops = {}
    initial, _, fused, fused_norms, fused_widened, _ = run("fused")
    _, held, saved, norms, widened, impl = run("compiled")
    assert impl == "compiled" and widened == [False] * 4 and fused_widened == [True] * 4
    # The update compiled at every step, the first too (under the run's FLOP counter): one call of inductor's
    # kernel per parameter per step (the weight and the bias, 4 steps), none of torch's fused AdamW.
    kernel_calls = sum(count for key, count in ops["compiled"].items() if key.startswith("## Call CompiledFxGraph"))
    assert kernel_calls == 8 and "aten::_fused_adamw_" not in ops["compiled"]
    assert "aten::_fused_adamw_" in ops["fused"]
    assert torch.equal(held["weight"], initial["weight"].bfloat16())
    assert (saved["weight"] - initial["weight"]).abs().min() > 0
    torch.testing.assert_close(saved["weight"], fused["weight"], rtol=1e-6, atol=1e-9)
    assert len(norms) == 2 and norms == pytest.approx(fused_norms, rel=1e-6) and min(norms) > 0.05  # clipped
