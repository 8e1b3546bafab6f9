"""The training core in this process, as a real one-rank gloo group: the fp16 skip path, step by step."""

import warnings

import pytest
import torch
from torch.distributed import TCPStore

from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv, process_group
from ddp_amp.launch.spawn import rank_environment
from ddp_amp.precision import Precision
from ddp_amp.train import Trainer

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

    original_step = trainer._optimizer_step

    def step_and_watch():
        if len(recorder.records) == 2:  # about to take the third (inf) step
            weights_before_skip.update({k: v.clone() for k, v in trainer.model.module.state_dict().items()})
        stepped = original_step()
        if len(recorder.records) == 2:
            for key, value in trainer.model.module.state_dict().items():
                assert torch.equal(value, weights_before_skip[key]), "a skipped step changed the weights"
        return stepped

    trainer._optimizer_step = step_and_watch
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
