"""--amp auto on CPU: the probe's rule, its timing of the task's own layer shapes (which changes nothing), and
the cache of its answers (rank.amp_probe, precision's cache). Real ranks taking rank 0's answer:
tests/system/test_amp_auto_runs.py."""

import pytest
import torch

from ddp_amp import precision
from ddp_amp.rank import amp_probe


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_AMP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(("fp32_s", "bf16_s", "expected"), [
    (1.0, 1.0, "fp32"), (1.04, 1.0, "fp32"), (1.06, 1.0, "bf16"), (0.5, 1.0, "fp32"), (2.0, 1.0, "bf16")])
def test_bf16_must_be_more_than_five_percent_faster(fp32_s, bf16_s, expected):
    assert amp_probe.decide(fp32_s, bf16_s) == expected


@pytest.mark.parametrize(("fp32_s", "bf16_s", "bf16_true_s", "expected"), [
    (1.0, 1.0, 1.0, "fp32"), (1.04, 1.0, 0.995, "fp32"), (1.2, 1.0, 0.8, "bf16-true"), (1.2, 0.8, 1.0, "bf16"),
    (1.0, 2.0, 0.9, "bf16-true"), (1.0, 0.9, 2.0, "bf16"), (0.5, 1.0, 0.9, "fp32")])
def test_the_faster_bf16_mode_wins_only_more_than_five_percent_faster_than_fp32(fp32_s, bf16_s, bf16_true_s,
                                                                                  expected):
    """An emulated bf16 (a CPU without bf16 units) is slower in both modes: fp32, never bf16-true."""
    assert amp_probe.decide(fp32_s, bf16_s, bf16_true_s) == expected


def test_the_shapes_are_the_tasks_own_and_probing_changes_nothing(cache_dir):
    """The rows each nn.Linear saw in a forward of a micro-batch of the task's own data; and the whole probe
    (that forward, then the timed forward and backward passes on a copy) leaves the model's weights, buffers,
    gradients, train mode and the global random state as they were."""
    from ddp_amp.tasks import build_task

    torch.manual_seed(0)
    task = build_task("mlp")
    task.model.add_module("dropout", torch.nn.Dropout(0.5))  # would draw random numbers in train mode

    class Counting(torch.nn.Module):  # state a module keeps
        def __init__(self, inner):
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, x):
            self.calls += 1
            return self.inner(x)

    task.model = Counting(task.model)
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    rng = torch.get_rng_state()
    shapes = amp_probe.layer_shapes(task.model, amp_probe._first_samples(task, 24))
    linears = [m for m in task.model.modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(shapes) == sorted({(24, m.in_features, m.out_features) for m in linears})
    answer = amp_probe._rank0_answer(task, torch.device("cpu"), 24, "mlp")
    assert answer["choice"] in ("fp32", "bf16", "bf16-true") and answer["fp32_pass_s"] > 0
    assert answer["bf16_pass_s"] > 0 and answer["bf16_true_pass_s"] > 0
    assert task.model.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in task.model.state_dict().items())
    assert all(p.grad is None for p in task.model.parameters())
    assert task.model.calls == 1  # the forward for the shapes above ran on the model itself; the probe's on a copy


def test_a_task_the_probe_cannot_run_keeps_fp32(cache_dir):
    from ddp_amp.tasks import Task

    task = Task(model=torch.nn.Linear(3, 1), dataset=[(torch.zeros(5), torch.zeros(1))] * 4)  # 5 features, not 3
    answer = amp_probe._rank0_answer(task, torch.device("cpu"), 2, "broken")
    assert answer["choice"] == "fp32" and "could not run" in answer["why"]


def test_the_timing_gives_each_precision():
    from ddp_amp.tasks import build_task

    task = build_task("mlp")
    batch = amp_probe._first_samples(task, 8)
    seconds = amp_probe.time_training_passes(task.model, task, batch, torch.device("cpu"), budget_s=0.05)
    assert set(seconds) == {"fp32", "bf16", "bf16-true"} and all(value > 0 for value in seconds.values())
    weights = {k: v.clone() for k, v in task.model.state_dict().items()}
    without = amp_probe.time_training_passes(task.model, task, batch, torch.device("cpu"), budget_s=0.05,
                                             with_bf16_true=False)
    assert set(without) == {"fp32", "bf16"}
    assert all(torch.equal(weights[k], v) for k, v in task.model.state_dict().items())  # the run's model untouched


def test_the_cache_keeps_answers_per_cpu_torch_threads_and_shapes(cache_dir):
    key = precision.amp_cache_key("2.13.0", 4, [(8, 32, 256)])
    assert precision.cpu_model() in key and "torch 2.13.0" in key and "4 threads" in key
    assert key != precision.amp_cache_key("2.13.0", 4, [(8, 256, 1024)])
    assert key != precision.amp_cache_key("2.13.0", 4, [(8, 32, 256)], task="other x8")
    assert key != precision.amp_cache_key("2.13.0", 2, [(8, 32, 256)])
    assert key != precision.amp_cache_key("2.14.0", 4, [(8, 32, 256)])
    assert precision.cached_amp_choices() == {}
    precision.remember_amp_choice(key, {"choice": "bf16", "bf16_speedup": 1.3})
    precision.remember_amp_choice("other", {"choice": "fp32", "bf16_speedup": 0.8})
    assert precision.cached_amp_choices()[key] == {"choice": "bf16", "bf16_speedup": 1.3}
    assert len(precision.cached_amp_choices()) == 2
    (cache_dir / precision.AMP_CACHE_FILE).write_text("{not json")
    assert precision.cached_amp_choices() == {}  # unreadable: probe again, no error




def test_a_model_that_cannot_compute_with_bf16_weights_is_timed_in_fp32_and_autocast():
    """Its bf16-true pass raises: the probe drops that mode alone, and still measures bf16 autocast."""
    from torch.utils.data import TensorDataset

    from ddp_amp.tasks import Task

    class Fp32Weights(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x):
            if self.linear.weight.dtype != torch.float32:
                raise TypeError("this model keeps fp32 weights")
            return self.linear(x)

    task = Task(model=Fp32Weights(), dataset=TensorDataset(torch.randn(8, 4), torch.randn(8, 1)),
                loss_fn=torch.nn.functional.mse_loss)
    batch = amp_probe._first_samples(task, 8)
    seconds = amp_probe.time_training_passes(task.model, task, batch, torch.device("cpu"), budget_s=0.05)
    assert set(seconds) == {"fp32", "bf16"}
