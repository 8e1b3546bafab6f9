"""--amp auto on CPU ranks: fp32, bf16 autocast or bf16-true, decided by timing the task's own training passes.

No CPU flag predicts the answer: avx512_bf16 without AMX trained at 0.81x fp32 on one Xeon and at 1.10x on an
EPYC Zen 4. Nor do the GEMMs alone: on a Xeon with AMX the wide MLP's GEMMs ran 1.31x faster in bf16 while its
whole step ran at 0.95x (autocast's casts and the bf16 element-wise ops ate the gain). So rank 0 times the
task's own forward and backward (from the output's mean, not the task's loss_fn, whose calls may be counted) on
one micro-batch of its first samples, in fp32, under bf16 autocast, and with bf16 weights (bf16-true: its pass
also pays for its gradients' copy into fp32 masters and the masters' copy back), interleaved, on copies of the
model (the run's weights, buffers, gradients and random state stay as they were), on its own thread, whose
subnormal handling (--flush-denormal) is already the run's. A bf16 mode wins only when it is more than 5% faster
than fp32, and the faster of the two wins; every rank takes rank 0's answer (ranks of one DDP job must step
alike); the answer is cached (precision.amp_cache_path), keyed by the task and the shapes its layers saw, so
that a second run starts without probing.
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from ddp_amp.dist import DistEnv
from ddp_amp.precision import (
    BF16_TRUE,
    Precision,
    amp_cache_key,
    autocast,
    cached_amp_choices,
    remember_amp_choice,
)
from ddp_amp.tasks import Task
from ddp_amp.tasks.batches import forward, output_loss
from ddp_amp.train.data import to_device

BF16_MARGIN = 0.05
"""bf16 must beat fp32 by more than this (a ratio within +-5% keeps fp32: full precision for no loss of speed)."""
PROBE_BUDGET_S = 0.6
"""The timing's share of the probe (both precisions together): under a second, unless one pass alone is longer
(at least 3 of each are timed)."""
MAX_SHAPES = 16


def layer_shapes(model: torch.nn.Module, batch: Any, every_field: bool = False) -> list[tuple[int, int, int]]:
    """(rows, in_features, out_features) of every nn.Linear call in one forward of `batch`, the largest
    MAX_SHAPES by work: what the cache keys the answer by. The forward runs in eval mode, without gradients,
    with the random state forked."""
    seen: list[tuple[int, int, int]] = []

    def record(module: torch.nn.Linear, inputs: tuple[Any, ...], _output: Any) -> None:
        seen.append((max(1, inputs[0].numel() // module.in_features), module.in_features, module.out_features))

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            forward(model, batch, every_field)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    shapes = sorted(set(seen), key=lambda s: s[0] * s[1] * s[2], reverse=True)
    return shapes[:MAX_SHAPES]


def _first_samples(task: Task, count: int) -> Any:
    dataset = task.dataset
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        samples = [dataset[i] for i in range(min(count, len(dataset)))]
    else:  # an iterable: a fresh iterator of its own, apart from the training loop's
        samples = list(itertools.islice(iter(dataset), count))
    return (task.collate_fn or default_collate)(samples)


def time_training_passes(model: torch.nn.Module, task: Task, batch: Any, device: torch.device,
                         budget_s: float = PROBE_BUDGET_S, with_bf16_true: bool = True) -> dict[str, float]:
    """Median seconds of one forward and backward of `batch` in fp32, under bf16 autocast and (`with_bf16_true`)
    with bf16 weights, interleaved pass by pass (a load that comes and goes falls on each), after one warm-up
    pass each."""
    model.train()
    bf16_model = copy.deepcopy(model).to(torch.bfloat16) if with_bf16_true else None
    # bf16-true's once-a-step copies: its gradients into fp32 masters and the masters back (the fp32 model's
    # parameters stand in for the masters: the same sizes).
    pairs = [] if bf16_model is None else [(p, m) for p, m in zip(bf16_model.parameters(), model.parameters())
                                           if p.requires_grad and p.is_floating_point()]

    def one_pass(precision: Precision) -> float:
        trained = bf16_model if precision.bf16_weights else model
        start = time.perf_counter()
        with autocast(precision, device.type):
            output, target = forward(trained, batch, task.pass_every_field)
            # Not the task's loss_fn: one that counts its calls (a curriculum, a schedule) would count these. The
            # backward through the model, the cost that matters, is the same from the output's mean.
            loss = output_loss(output, target, None) if task.loss_fn is None else _mean_of(output)
        loss.backward()
        with torch.no_grad():
            for param, master in pairs if precision.bf16_weights else ():
                if param.grad is not None:
                    master.grad = param.grad.float()
                param.copy_(master)
        trained.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    precisions = {"fp32": Precision("fp32"), "bf16": Precision("bf16")}
    if with_bf16_true:
        precisions[BF16_TRUE] = Precision(BF16_TRUE)
    with torch.random.fork_rng(devices=[]):  # dropout draws from a stream of its own
        for name, precision in list(precisions.items()):
            try:
                one_pass(precision)  # warm-up: oneDNN builds its kernels on first use
            except Exception:
                if name != BF16_TRUE:
                    raise
                del precisions[name]  # a model that cannot compute with bf16 weights: fp32 or autocast
                model.zero_grad(set_to_none=True)
        times: dict[str, list[float]] = {name: [] for name in precisions}
        deadline = time.perf_counter() + budget_s
        while len(times["fp32"]) < 3 or (time.perf_counter() < deadline and len(times["fp32"]) < 200):
            for name, precision in precisions.items():
                times[name].append(one_pass(precision))
    return {name: statistics.median(values) for name, values in times.items()}


def _mean_of(output: Any) -> torch.Tensor:
    """A scalar that depends on all of a model's output: a tensor's mean, or that of its logits or first tensor."""
    for candidate in (output, getattr(output, "logits", None), *(output if isinstance(output, (tuple, list)) else ())):
        if isinstance(candidate, torch.Tensor) and candidate.is_floating_point():
            return candidate.float().mean()
    raise TypeError(f"no floating-point tensor in the model's output ({type(output).__name__})")


def decide(fp32_s: float, bf16_s: float, bf16_true_s: float | None = None) -> str:
    """The faster of the bf16 modes, only when it is more than BF16_MARGIN faster than fp32; else fp32."""
    name, seconds = min((("bf16", bf16_s), (BF16_TRUE, bf16_true_s if bf16_true_s is not None else math.inf)),
                        key=lambda entry: entry[1])
    return name if fp32_s / seconds > 1 + BF16_MARGIN else "fp32"


def measured_precision(task: Task, env: DistEnv, device: torch.device, samples: int,
                       spec: str = "", with_bf16_true: bool = True) -> tuple[Precision, dict[str, Any]]:
    """Rank 0's answer (cached or measured now), shared with every rank: the precision, and what summary.json
    and the progress line report of it. `with_bf16_true`: bf16-true is a candidate (not where the run's
    checkpoints could not hold its masters)."""
    answer: list[dict[str, Any] | None] = [None]
    if env.rank == 0:
        answer[0] = _rank0_answer(task, device, samples, spec, with_bf16_true)
    dist.broadcast_object_list(answer, src=0)
    found = answer[0]
    assert found is not None
    ratio = found.get("bf16_speedup")
    if ratio is None:
        reason = f"fp32: {found['why']}"
    else:
        true_ratio = found.get("bf16_true_speedup")
        ran = f"bf16 ran the task's forward and backward at {ratio:.2f}x fp32's speed" + (
            f" and bf16-true at {true_ratio:.2f}x" if true_ratio is not None else "")
        verdict = (f"{found['choice']} more than 5% faster" if found["choice"] != "fp32"
                   else "neither more than 5% faster" if true_ratio is not None else "not more than 5% faster")
        reason = f"{ran} on rank 0, {verdict}{' (cached)' if found.get('cached') else ''}"
    return Precision(found["choice"], reason=reason), found


def _rank0_answer(task: Task, device: torch.device, samples: int, spec: str,
                  with_bf16_true: bool = True) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        batch = to_device(_first_samples(task, samples), device)
        # A copy: the run's model (its weights, buffers, gradients and any state its modules keep) is not touched.
        model = copy.deepcopy(task.model)
        shapes = layer_shapes(model, batch, task.pass_every_field)
    except Exception as exc:  # the probe is an optimisation: a task it cannot look into trains in fp32
        return {"choice": "fp32", "why": f"the probe could not run the task's forward ({type(exc).__name__})"}
    key = amp_cache_key(torch.__version__, torch.get_num_threads(), shapes,
                        task=f"{spec} x{samples}{'' if with_bf16_true else ' without bf16-true'}")
    cached = cached_amp_choices().get(key)
    # An answer cached before bf16-true was measured too is measured again.
    if cached is not None and cached.get("choice") in ("fp32", "bf16", BF16_TRUE) and (
            "bf16_true_pass_s" in cached or not with_bf16_true):
        return {**cached, "cached": True, "key": key}
    try:
        seconds = time_training_passes(model, task, batch, device, with_bf16_true=with_bf16_true)
    except Exception as exc:
        return {"choice": "fp32", "why": f"the probe could not train the task in bf16 ({type(exc).__name__})"}
    true_s = seconds.get(BF16_TRUE)
    entry = {"choice": decide(seconds["fp32"], seconds["bf16"], true_s),
             "bf16_speedup": seconds["fp32"] / seconds["bf16"], "fp32_pass_s": seconds["fp32"],
             "bf16_pass_s": seconds["bf16"], "shapes": [list(s) for s in shapes],
             "probe_s": time.perf_counter() - started, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if with_bf16_true:  # None: the model could not compute with bf16 weights (cached as such)
        entry["bf16_true_pass_s"] = true_s
        if true_s is not None:
            entry["bf16_true_speedup"] = seconds["fp32"] / true_s
    remember_amp_choice(key, entry)
    return {**entry, "cached": False, "key": key}
