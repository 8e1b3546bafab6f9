"""The training core in this process, as a real one-rank gloo group: the fp16 skip path, step by step."""

import warnings
from collections import OrderedDict, namedtuple
from collections.abc import Mapping

import pytest
import torch
from torch.distributed import TCPStore

from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv, process_group
from ddp_amp.launch.spawn import rank_environment
from ddp_amp.precision import Precision
from ddp_amp.train.data import to_device
from ddp_amp.train.trainer import Trainer

import helper_tasks


class Recorder:
    def __init__(self):
        self.records = []

    def on_log(self, record):
        self.records.append(record)



@pytest.fixture
def one_rank_group(monkeypatch):
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    for key, value in rank_environment(0, 1, store.port).items():
        monkeypatch.setenv(key, value)
    env = DistEnv.from_environ()
    with process_group(env, torch.device("cpu")):
        yield env


def test_fp16_inf_gradient_skips_optimizer_and_scheduler(one_rank_group, tmp_path):
    config = TrainConfig(task="inline", steps=6, log_every=1, lr=0.1, schedule="cosine", batch_size=16,
                         dtype="fp16", amp="on", run_dir=str(tmp_path))
    torch.manual_seed(0)
    task = helper_tasks.inf_at_third_step()
    recorder = Recorder()
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp16"), task, recorder)
    weights_before_skip = {}

    original_step = trainer.step.optimizer_step

    def step_and_watch():
        if len(recorder.records) == 2:  # about to take the third (inf) step
            weights_before_skip.update({k: v.clone() for k, v in trainer.model.module.state_dict().items()})
        stepped = original_step()
        if len(recorder.records) == 2:
            for key, value in trainer.model.module.state_dict().items():
                assert torch.equal(value, weights_before_skip[key]), "a skipped step changed the weights"
        return stepped

    trainer.step.optimizer_step = step_and_watch
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
        result = trainer.train()

    assert result.summary["skipped_steps"] == 1
    assert result.summary["precision"] == "fp16"
    assert trainer.scheduler.last_epoch == 5, "the scheduler advanced on the skipped step"
    adam_state = trainer.optimizer.state[next(trainer.model.module.parameters())]
    assert int(adam_state["step"]) == 5, "the optimizer stepped on inf gradients"
    lrs = [r["lr"] for r in recorder.records]
    assert lrs[2] == lrs[3], "the LR moved on after a skipped step"
    assert len(set(lrs)) == 5
    assert recorder.records[2]["loss_scale"] < recorder.records[1]["loss_scale"]
    assert [r["skipped_steps"] for r in recorder.records] == [0, 0, 1, 1, 1, 1]
    trainer.close()


def test_bf16_autocast_runs_the_forward_in_bf16(one_rank_group, tmp_path):
    config = TrainConfig(task="inline", steps=2, log_every=1, amp="on", dtype="bf16", run_dir=str(tmp_path))
    seen = []
    task = helper_tasks.inf_at_third_step()
    task.model.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("bf16"), task, Recorder())
    assert not trainer.scaler.is_enabled(), "bf16 needs no GradScaler"
    trainer.train()
    trainer.close()
    assert seen and all(dtype == torch.bfloat16 for dtype in seen)


def test_fp16_counts_skips_without_reading_the_scale_every_step(one_rank_group, tmp_path, monkeypatch):
    # get_scale() waits for the device; the only reads allowed are one per log interval and one for the summary.
    reads = []
    original = torch.amp.GradScaler.get_scale
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", lambda self: reads.append(1) or original(self))
    config = TrainConfig(task="inline", steps=12, log_every=4, lr=0.1, schedule="constant", batch_size=16,
                         dtype="fp16", amp="on", run_dir=str(tmp_path))
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp16"),
                      helper_tasks.inf_at_third_step(), Recorder())
    result = trainer.train()
    trainer.close()
    assert result.summary["skipped_steps"] == 1
    assert len(reads) == 12 // 4 + 1


def test_dict_and_namedtuple_batches_train(one_rank_group, tmp_path):
    task = helper_tasks.structured_batches()
    config = TrainConfig(task="inline", steps=3, log_every=1, amp="off", run_dir=str(tmp_path), batch_size=8)
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp32"), task, Recorder())
    result = trainer.train()
    trainer.close()
    assert result.summary["steps"] == 3 and result.summary["final_loss"] > 0


Pair = namedtuple("Pair", ["left", "right"])


class FrozenMapping(Mapping):
    """A read-only Mapping type that cannot be built from a dict."""

    def __init__(self, *items):
        self._data = dict(items)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


def test_every_tensor_of_a_nested_batch_reaches_the_device():
    meta = torch.device("meta")  # a device every build has: where a tensor ends up is visible without a GPU
    t = torch.ones(2)
    batch = ({"image": t, "meta": {"ids": [t, t], "name": "x"}}, Pair(t, (t, 3)),
             OrderedDict(a=t), FrozenMapping(("b", t)), [t, [t]])
    moved = to_device(batch, meta)
    dict_part, pair, ordered, frozen, nested = moved
    assert dict_part["image"].device == meta and dict_part["meta"]["ids"][1].device == meta
    assert dict_part["meta"]["name"] == "x"
    assert isinstance(pair, Pair) and pair.left.device == meta and pair.right[0].device == meta
    assert pair.right[1] == 3
    assert isinstance(ordered, OrderedDict) and ordered["a"].device == meta
    assert frozen["b"].device == meta
    assert nested[0].device == meta and nested[1][0].device == meta


@pytest.mark.parametrize(("precision", "expected"), [("fp32", "fused"), ("bf16", "fused"), ("fp16", "foreach")])
def test_the_default_optimizer_step_is_fused_except_under_a_grad_scaler(one_rank_group, tmp_path, precision,
                                                                         expected):
    config = TrainConfig(task="inline", steps=2, run_dir=str(tmp_path))
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision(precision),
                      helper_tasks.inf_at_third_step(), Recorder())
    group = trainer.optimizer.param_groups[0]
    assert trainer.optimizer_impl == expected
    assert bool(group["fused"]) == (expected == "fused") and bool(group["foreach"]) == (expected == "foreach")
    assert trainer.model.gradient_as_bucket_view  # gradients are views into DDP's buckets: no copies
    trainer.train()
    trainer.close()


def test_the_optimizer_and_ddp_options_reach_torch(one_rank_group, tmp_path):
    config = TrainConfig(task="inline", steps=2, run_dir=str(tmp_path), optimizer="sgd", optimizer_impl="loop",
                         bucket_view=False, bucket_mb=1.5, static_graph=True)
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp32"),
                      helper_tasks.inf_at_third_step(), Recorder())
    group = trainer.optimizer.param_groups[0]
    assert not group["fused"] and group["foreach"] is False
    assert not trainer.model.gradient_as_bucket_view
    assert trainer.model.bucket_bytes_cap == int(1.5 * 1024 * 1024)
    assert trainer.model.static_graph
    summary = trainer.train().summary
    assert summary["optimizer_impl"] == "loop"
    assert summary["ddp"] == {"bucket_mb": 1.5, "bucket_view": False, "static_graph": True,
                              "grad_compression": "none"}
    trainer.close()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_grad_norm_is_the_true_gradient_norm_at_each_log_step(one_rank_group, tmp_path, precision):
    """At a log step the record's grad_norm is the norm of the gradients the optimizer steps with: unscaled
    under fp16 (not 65536 times larger)."""
    fp16 = precision == "fp16"
    config = TrainConfig(task="inline", steps=6, log_every=3, lr=0.1, schedule="constant", batch_size=16,
                         dtype="fp16" if fp16 else "auto", amp="on" if fp16 else "off", run_dir=str(tmp_path))
    torch.manual_seed(0)
    recorder = Recorder()
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision(precision), helper_tasks.resumable(),
                      recorder)
    stepped_with = []  # the norm of the gradients each optimizer step is handed
    original_step = trainer.step.optimizer_step

    def step_and_measure():
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        stepped_with.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        return original_step()

    trainer.step.optimizer_step = step_and_measure
    trainer.train()
    trainer.close()
    norms = [record["grad_norm"] for record in recorder.records]
    assert norms == pytest.approx([stepped_with[2], stepped_with[5]], rel=1e-5)  # steps 3 and 6 are logged
    assert all(0 < norm < 100 for norm in norms), norms
    if fp16:  # between log steps the gradients stay scaled: unscaling happens at log steps only
        assert stepped_with[0] > 1000 * norms[0]
