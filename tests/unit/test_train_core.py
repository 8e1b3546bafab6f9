"""The training core in this process, as a real one-rank gloo group: the fp16 skip path, step by step."""

import warnings
from collections import OrderedDict, namedtuple
from collections.abc import Mapping

import pytest
import torch

from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv
from ddp_amp.precision import Precision
from ddp_amp.train.data import to_device
from ddp_amp.train.trainer import Trainer

import helper_tasks


class Recorder:
    def __init__(self):
        self.records = []

    def on_log(self, record):
        self.records.append(record)


def norms_handed_to_the_optimizer(trainer) -> list[float]:
    """A list that fills, as the trainer runs, with the norm of the gradients each optimizer step is handed."""
    norms = []
    original_step = trainer.step.update.step

    def step_and_measure():
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        return original_step()

    trainer.step.update.step = step_and_measure
    return norms


def test_fp16_inf_gradient_skips_optimizer_and_scheduler(one_rank_group, tmp_path):
    config = TrainConfig(task="inline", steps=6, log_every=1, lr=0.1, schedule="cosine", batch_size=16,
                         dtype="fp16", amp="on", run_dir=str(tmp_path))
    torch.manual_seed(0)
    task = helper_tasks.inf_at_third_step()
    recorder = Recorder()
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp16"), task, recorder)
    weights_before_skip = {}

    original_step = trainer.step.update.step

    def step_and_watch():
        if len(recorder.records) == 2:  # about to take the third (inf) step
            weights_before_skip.update({k: v.clone() for k, v in trainer.model.module.state_dict().items()})
        stepped = original_step()
        if len(recorder.records) == 2:
            for key, value in trainer.model.module.state_dict().items():
                assert torch.equal(value, weights_before_skip[key]), "a skipped step changed the weights"
        return stepped

    trainer.step.update.step = step_and_watch
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
                              "grad_compression": "none", "find_unused_parameters": False,
                              "broadcast_buffers": True, "sync_batchnorm": False}
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
    stepped_with = norms_handed_to_the_optimizer(trainer)
    trainer.train()
    trainer.close()
    norms = [record["grad_norm"] for record in recorder.records]
    assert norms == pytest.approx([stepped_with[2], stepped_with[5]], rel=1e-5)  # steps 3 and 6 are logged
    assert all(0 < norm < 100 for norm in norms), norms
    if fp16:  # between log steps the gradients stay scaled: unscaling happens at log steps only
        assert stepped_with[0] > 1000 * norms[0]


def test_gradients_are_all_reduced_once_per_optimizer_step_under_grad_accum(one_rank_group, tmp_path):
    """no_sync on every micro-step but the last: 3 steps of 4 micro-steps are 3 all-reduces per bucket, not 12."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    config = TrainConfig(task="inline", steps=3, grad_accum=4, log_every=3, amp="off", batch_size=8,
                         run_dir=str(tmp_path))
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp32"), helper_tasks.resumable(),
                      Recorder())
    buckets = []

    def counting_allreduce(state, bucket):
        buckets.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    trainer.model.register_comm_hook(None, counting_allreduce)
    trainer.train()
    trainer.close()
    assert buckets == [0, 0, 0]


def test_each_epoch_is_the_order_distributed_sampler_gives_after_set_epoch():
    """The data of epoch 1 is a new order, exactly the one DistributedSampler gives after set_epoch(1)."""
    from torch.utils.data import DistributedSampler, TensorDataset

    from ddp_amp.train.data import RankData

    dataset = TensorDataset(torch.arange(40))
    env = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=0)
    data = RankData(dataset, env, torch.device("cpu"), batch_size=5, seed=3, workers=0)
    batches = data.batches()
    seen = [[int(i) for _ in range(data.batches_per_epoch) for i in next(batches)[0]] for _epoch in range(2)]
    reference = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    for epoch in (0, 1):
        reference.set_epoch(epoch)
        assert seen[epoch] == list(reference)
    assert seen[0] != seen[1]


def test_a_position_saved_at_an_epochs_last_batch_resumes_in_the_next_epoch():
    """A checkpoint at the last batch of epoch 0 (the loop over it not yet ended): the resumed loader says epoch
    1, as the uninterrupted one does once its loop ended, and gives epoch 1's batches. A script's
    `for epoch in range(data.epoch, E): for batch in data:` trained the finished epoch's number once more."""
    from torch.utils.data import TensorDataset

    from ddp_amp.train.data import RankData

    env = DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=0)
    dataset = TensorDataset(torch.arange(37))

    def loader():
        return RankData(dataset, env, torch.device("cpu"), batch_size=4, seed=3, workers=0)

    running = loader()
    epoch_0 = iter(running)
    for _ in range(running.batches_per_epoch):
        next(epoch_0)  # suspended after the last batch, as a loop body that saves there
    resumed = loader()
    resumed.load_state_dict(running.state_dict(), saved_world_size=2)
    assert list(epoch_0) == [] and running.epoch == 1  # the uninterrupted loop's end of epoch 0
    assert resumed.epoch == 1
    assert [b[0].tolist() for b in resumed] == [b[0].tolist() for b in running]


def test_a_position_saved_at_the_last_epochs_end_leaves_no_batch_to_train_on_any_world_size():
    """An --epochs 1 run's checkpoint at its final batch, resumed on another world size (an elastic node lost
    after it): nothing is left. Read as the start of the next epoch, it counted a whole epoch more, which the
    trainer then ran with its schedule started over."""
    from torch.utils.data import TensorDataset

    from ddp_amp.train.data import RankData

    def loader(world_size: int):
        env = DistEnv(rank=0, local_rank=0, world_size=world_size, local_world_size=world_size,
                      master_addr="127.0.0.1", master_port=0)
        return RankData(TensorDataset(torch.arange(40)), env, torch.device("cpu"), batch_size=4, seed=3, workers=0)

    running = loader(2)
    epoch_0 = iter(running)
    for _ in range(running.batches_per_epoch):
        next(epoch_0)
    assert running.remaining_batches(1) == 0
    for world_size in (2, 1):
        resumed = loader(world_size)
        resumed.load_state_dict(running.state_dict(), saved_world_size=2)
        assert resumed.remaining_batches(1) == 0 and resumed.remaining_batches(2) == resumed.batches_per_epoch


def test_fp16_clips_after_unscaling(one_rank_group, tmp_path):
    """--clip-grad above the true norm but below the scaled one (x65536) must not clip: the weights equal an fp16
    run without clipping. Clipping before unscale_ would clip the scaled gradients."""
    weights = []
    for clip in (None, 1000.0):
        config = TrainConfig(task="inline", steps=4, log_every=4, lr=0.05, schedule="constant", batch_size=16,
                             dtype="fp16", amp="on", clip_grad=clip, run_dir=str(tmp_path))
        torch.manual_seed(0)
        trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp16"), helper_tasks.resumable(),
                          Recorder())
        result = trainer.train()
        weights.append({k: v.clone() for k, v in result.model.state_dict().items()})
        trainer.close()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_clip_grad_bounds_every_norm_the_optimizer_sees(one_rank_group, tmp_path):
    config = TrainConfig(task="inline", steps=4, log_every=2, lr=0.05, schedule="constant", batch_size=16,
                         amp="off", clip_grad=0.01, run_dir=str(tmp_path))
    torch.manual_seed(0)
    recorder = Recorder()
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp32"), helper_tasks.resumable(),
                      recorder)
    stepped_with = norms_handed_to_the_optimizer(trainer)
    trainer.train()
    trainer.close()
    assert len(stepped_with) == 4 and all(norm <= 0.01 * (1 + 1e-5) for norm in stepped_with), stepped_with
    assert all(record["grad_norm"] > 0.01 for record in recorder.records)  # the norm before clipping


def test_the_nonfinite_limit_counts_consecutive_steps(one_rank_group, tmp_path):
    """Inf every other step, --max-nonfinite 3: never three in a row, so the run finishes (a count of all
    non-finite steps would stop it at the sixth)."""
    config = TrainConfig(task="inline", steps=12, log_every=1, lr=0.01, schedule="constant", batch_size=16,
                         dtype="fp16", amp="on", max_nonfinite=3, run_dir=str(tmp_path))
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp16"),
                      helper_tasks.inf_every_other_call(), Recorder())
    summary = trainer.train().summary
    trainer.close()
    assert "diverged" not in summary
    assert summary["steps"] == 12 and summary["skipped_steps"] == 6


def test_the_precision_the_ranks_agree_on_is_fp16_on_a_pre_ampere_gpu(monkeypatch):
    """The function each rank calls, with a capability of 7.5 (a T4): bf16 there is emulated, so --amp auto
    picks fp16."""
    from ddp_amp.precision import resolve_precision
    from ddp_amp.rank.setup import gpu_bf16_is_native

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    native = gpu_bf16_is_native(torch.device("cuda", 0))
    assert native is False
    assert resolve_precision("cuda", "auto", "auto", cuda_bf16=native).name == "fp16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    native = gpu_bf16_is_native(torch.device("cuda", 0))
    assert resolve_precision("cuda", "auto", "auto", cuda_bf16=native).name == "bf16"


def test_a_checkpoint_is_saved_after_its_steps_log_line(one_rank_group, tmp_path):
    """A kill between the two would otherwise lose step N's line for good: a resume from step N cuts the
    metrics back to N and never logs N again."""
    config = TrainConfig(task="inline", steps=6, log_every=2, amp="off", batch_size=16, run_dir=str(tmp_path))
    recorder = Recorder()

    class Watching:
        logged_at_save: dict[int, list[int]] = {}

        def due(self, step):
            return step % 2 == 0

        def save(self, parts, step):
            self.logged_at_save[step] = [record["step"] for record in recorder.records]

        def take_unlogged(self):
            return {}

    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp32"), helper_tasks.resumable(),
                      recorder, checkpoints=Watching())
    trainer.train()
    trainer.close()
    assert Watching.logged_at_save == {2: [2], 4: [2, 4], 6: [2, 4, 6]}


def test_an_epoch_split_by_a_resize_repeats_no_sample_and_gives_every_rank_as_many_batches():
    """25 samples left for 3 ranks in batches of 8: shares of 9, 8 and 8 would make 2, 1 and 1 batches (a rank
    waiting alone in an all-reduce); the short ranks halve their batch instead, and nothing is padded."""
    from ddp_amp.train.data import EpochSampler, RankBatches

    shares = []
    for rank in range(3):
        sampler = EpochSampler(49, rank, 3, seed=1)
        sampler.cursor, sampler.resized_epoch = 24, 0  # 24 consumed before the resize
        batches = list(RankBatches(sampler, 8))
        assert len(batches) == 2 and all(batches), batches
        shares.append([index for batch in batches for index in batch])
    order = torch.randperm(49, generator=torch.Generator().manual_seed(1)).tolist()
    assert sorted(index for share in shares for index in share) == sorted(order[24:])


def test_micro_batches_are_all_reduced_once_per_optimizer_step(one_rank_group, tmp_path):
    """--micro-batch 3 of a batch of 8 (pieces 3, 3, 2) under --grad-accum 2: six pieces a step, one
    all-reduce per bucket a step; and every sample weighs as in the whole batch."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def run(micro_batch):
        config = TrainConfig(task="inline", steps=3, grad_accum=2, log_every=3, amp="off", batch_size=8, seed=5,
                             optimizer="sgd", schedule="constant", micro_batch=micro_batch, run_dir=str(tmp_path))
        torch.manual_seed(5)  # the model's initial weights, as a rank seeds before it builds the task
        task = helper_tasks.plain_regression()
        trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp32"), task, Recorder())
        buckets = []

        def counting_allreduce(state, bucket):
            buckets.append(bucket.index())
            return default_hooks.allreduce_hook(None, bucket)

        trainer.model.register_comm_hook(None, counting_allreduce)
        result = trainer.train()
        weights = {k: v.clone() for k, v in trainer.module.state_dict().items()}
        trainer.close()
        return buckets, weights, result.summary

    whole_buckets, whole, _ = run(None)
    piece_buckets, pieces, summary = run("3")
    assert whole_buckets == piece_buckets == [0, 0, 0]
    assert summary["micro_batch_size"] == 3 and summary["micro_batch_changes"] == []
    for key in whole:
        torch.testing.assert_close(pieces[key], whole[key], rtol=1e-6, atol=1e-7)


def _train_in_pieces(group, tmp_path, micro_batch, fail_above=None, once_stepped=False):
    """plain_regression, 3 steps of 16 samples in pieces of `micro_batch`, whose backward runs out of memory (the
    CPU allocator's words) on a piece of more than `fail_above` samples (only once the optimizer has taken a step,
    with `once_stepped`: its state then takes memory). (weights, summary, optimizer steps)."""
    config = TrainConfig(task="inline", steps=3, log_every=3, amp="off", batch_size=16, seed=5,
                         optimizer="sgd", schedule="constant", micro_batch=micro_batch, run_dir=str(tmp_path))
    torch.manual_seed(5)  # the model's initial weights, as a rank seeds before it builds the task
    task = helper_tasks.plain_regression()
    steps = []
    if fail_above is not None:
        original = task.loss_fn

        def loss_fn(output, target):
            loss = original(output, target)
            if output.shape[0] > fail_above and (steps or not once_stepped):
                def fail(grad):
                    raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't "
                                       "allocate memory: you tried to allocate 4294967296 bytes.")

                loss.register_hook(fail)
            return loss

        task.loss_fn = loss_fn
    trainer = Trainer(config, group, torch.device("cpu"), Precision("fp32"), task, Recorder())
    original_step = trainer.step.update.step
    trainer.step.update.step = lambda: steps.append(1) or original_step()
    result = trainer.train()
    weights = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    trainer.close()
    return weights, result.summary, len(steps)


def test_a_piece_that_does_not_fit_is_halved_and_the_same_batch_rerun(one_rank_group, tmp_path):
    """Under auto, an out-of-memory error in backward (the CPU allocator's) halves the piece, reruns the same
    batch, and steps the optimizer once on the whole batch's gradient: the weights of --micro-batch 4."""
    fixed, _, _ = _train_in_pieces(one_rank_group, tmp_path, "4")
    auto, summary, optimizer_steps = _train_in_pieces(one_rank_group, tmp_path, "auto", fail_above=4)
    assert summary["micro_batch_size"] == 4
    assert summary["micro_batch_changes"] == [{"step": 1, "micro_batch_size": 8}, {"step": 1, "micro_batch_size": 4}]
    assert optimizer_steps == 3  # never on a partial gradient
    assert summary["steps"] == 3 and summary["final_lr"] == pytest.approx(3e-3)
    for key in fixed:
        torch.testing.assert_close(auto[key], fixed[key], rtol=1e-5, atol=1e-7)


def test_auto_keeps_probing_until_a_step_has_run_beside_the_optimizers_state(one_rank_group, tmp_path):
    """The first optimizer step allocates the optimizer's state; a piece that fit before it may not fit after
    (a GPU run settled on 2048 samples in step 1 and ran out of memory in step 2). Step 2 still probes: its
    pieces of 16 fail, it halves to 8 and 4 and reruns, and the run ends with --micro-batch 4's weights."""
    fixed, _, _ = _train_in_pieces(one_rank_group, tmp_path, "4")
    auto, summary, optimizer_steps = _train_in_pieces(one_rank_group, tmp_path, "auto", fail_above=4,
                                                      once_stepped=True)
    assert summary["micro_batch_changes"] == [{"step": 2, "micro_batch_size": 8}, {"step": 2, "micro_batch_size": 4}]
    assert optimizer_steps == 3 and summary["micro_batch_size"] == 4
    for key in fixed:
        torch.testing.assert_close(auto[key], fixed[key], rtol=1e-5, atol=1e-7)


def test_the_buffer_broadcast_switch_takes_the_name_this_torchs_ddp_knows():
    """torch 2.13 renamed broadcast_buffers to forward_sync_buffers; torch 2.11 (a GPU machine's) refuses the new
    name, and every GPU run failed on it."""
    from torch.nn.parallel import DistributedDataParallel

    from ddp_amp.parallel.ddp import buffer_sync_option

    class Older:
        def __init__(self, module, device_ids=None, broadcast_buffers=True, bucket_cap_mb=None):
            pass

    assert buffer_sync_option(Older, False) == {"broadcast_buffers": False}
    import inspect

    known = inspect.signature(DistributedDataParallel.__init__).parameters
    expected = "forward_sync_buffers" if "forward_sync_buffers" in known else "broadcast_buffers"
    assert buffer_sync_option(DistributedDataParallel, True) == {expected: True}


def test_bf16_true_keeps_an_update_far_below_a_bf16_ulp_of_the_weight(one_rank_group, tmp_path):
    """lr x gradient ~1e-6, far below a bf16 ulp of the weights (2^-9 at 0.3): the model's bf16 weights do not
    move, the fp32 masters do, by what an fp32 run's weights move (within the bf16 gradients' own error), and
    model.pt's weights (model_state) are the masters. Without masters (the optimizer over the bf16 weights) the
    update would be lost."""
    def run(precision):
        config = TrainConfig(task="inline", steps=4, log_every=4, batch_size=16, seed=5, optimizer="sgd",
                             schedule="constant", lr=1e-5, momentum=0.0, run_dir=str(tmp_path),
                             **({"amp": "off"} if precision == "fp32" else {"amp": "on", "dtype": precision}))
        torch.manual_seed(5)
        task = helper_tasks.plain_regression()
        initial = {k: v.clone() for k, v in task.model.state_dict().items()}
        trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision(precision), task, Recorder())
        trainer.train()
        held = {k: v.clone() for k, v in trainer.module.state_dict().items()}
        saved = trainer.model_state()
        trainer.close()
        return initial, held, saved

    initial, fp32, _ = run("fp32")
    _, held, saved = run("bf16-true")
    assert held["weight"].dtype == torch.bfloat16 and saved["weight"].dtype == torch.float32
    assert torch.equal(held["weight"], initial["weight"].bfloat16())  # the compute weights could not move
    moved, expected = saved["weight"] - initial["weight"], fp32["weight"] - initial["weight"]
    assert expected.abs().min() > 0
    torch.testing.assert_close(moved, expected, rtol=0.05, atol=0)
    assert torch.equal(saved["weight"].bfloat16(), held["weight"])


def test_bf16_true_keeps_frozen_weights_in_fp32_in_what_it_saves(one_rank_group, tmp_path):
    """A frozen layer computes in bf16 like the rest, but the state that checkpoints and model.pt hold keeps its
    fp32 values exactly: a frozen backbone is not rounded to bf16 for good."""
    config = TrainConfig(task="inline", steps=2, log_every=2, batch_size=16, seed=5, optimizer="sgd",
                         schedule="constant", amp="on", dtype="bf16-true", run_dir=str(tmp_path))
    torch.manual_seed(5)
    task = helper_tasks.plain_regression()
    task.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    task.model[0].requires_grad_(False)
    frozen = task.model[0].weight.detach().clone()
    assert not torch.equal(frozen.bfloat16().float(), frozen)  # rounding would show
    trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("bf16-true"), task, Recorder())
    trainer.train()
    saved = trainer.model_state()
    assert trainer.module[0].weight.dtype == torch.bfloat16
    assert saved["0.weight"].dtype == torch.float32 and torch.equal(saved["0.weight"], frozen)
    trainer.close()


def test_a_scripts_loop_refuses_bf16_true_as_the_command_line_does():
    from ddp_amp.loop.settings import LoopError, LoopSettings

    with pytest.raises(LoopError, match="dtype='bf16-true' is for ddp-amp's own loop"):
        LoopSettings(amp="on", dtype="bf16-true").precision(torch.device("cpu"))


def test_a_batch_with_a_scalar_field_is_counted_and_split_by_its_samples():
    """A custom task's batch {'scale': tensor(0.5), 'x': (4, 3)}: the step's sample count (throughput) read the
    scalar's first dimension and failed every step (IndexError); --micro-batch slicing it failed too. The scalar
    belongs to the whole batch: each piece gets it."""
    from ddp_amp.train.microbatch import split_batch
    from ddp_amp.train.step import CountingBatches

    batch = {"scale": torch.tensor(0.5), "x": torch.zeros(4, 3)}
    counted = CountingBatches(iter([batch, batch]))
    assert len(list(counted)) == 2 and counted.samples == 8
    pieces = split_batch(batch, 3)
    assert [(piece["x"].shape[0], share) for piece, share in pieces] == [(3, 0.75), (1, 0.25)]
    assert all(piece["scale"].item() == 0.5 for piece, _ in pieces)


@pytest.mark.parametrize("shard", ["none", "optimizer"])
@pytest.mark.parametrize("path", ["single file", "sharded"])
def test_a_resume_keeps_the_runs_own_optimizer_implementation(one_rank_group, tmp_path, path, shard):
    """torch's load_state_dict takes every group setting from the checkpoint: a fused run resumed from a loop
    run's checkpoint stepped in torch's per-parameter loop while its summary said fused. Both load paths (a
    single file's whole state, a sharded checkpoint's after_sharded_load) give the run its own back, with the
    checkpoint's state; under --shard optimizer in ZeroRedundancyOptimizer's local optimizer too."""
    def trainer(impl, run_dir):
        config = TrainConfig(task="inline", steps=2, log_every=2, amp="off", batch_size=16, optimizer_impl=impl,
                             shard=shard, run_dir=str(tmp_path / run_dir))
        return Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp32"), helper_tasks.resumable(),
                       Recorder())

    saved = trainer("loop", "loop")
    saved.train()
    state = saved.parts.whole_state([0])
    saved.close()
    assert state["optimizer"]["param_groups"][0]["foreach"] is False
    resumed = trainer("fused", "fused")
    if path == "single file":
        resumed.parts.load_whole(state)
    else:  # what checkpoint.sharded does: the optimizer's state loaded, then after_sharded_load
        resumed.optimizer.load_state_dict(state["optimizer"])
        resumed.parts.after_sharded_load()
    local = getattr(resumed.optimizer, "optim", resumed.optimizer)  # what steps: ZeRO's local optimizer
    for group in (resumed.optimizer.param_groups[0], local.param_groups[0]):
        assert group["fused"] is True and not group["foreach"]
    assert all(local.state[p]["step"].item() == 2 for p in local.param_groups[0]["params"])
    resumed.close()
