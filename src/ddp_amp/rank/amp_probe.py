"""--amp auto on CPU ranks: bf16 or fp32, decided by measuring both at the task's own layer shapes.

No CPU flag predicts the answer: avx512_bf16 without AMX trained at 0.81x fp32 on one Xeon and at 1.10x on an
EPYC Zen 4. So rank 0 times the GEMMs the task's training step runs (each nn.Linear's forward, input-gradient
and weight-gradient products, at the rows one micro-batch gives it), in fp32 and in bf16 (with autocast's casts
of weights and inputs), interleaved, on its own thread, whose subnormal handling (--flush-denormal) is already
the run's. bf16 wins only when it is more than 5% faster; every rank takes rank 0's answer (ranks of one DDP
job must step alike); the answer is cached (precision.amp_cache_path) so that a second run starts without
probing.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from ddp_amp.dist import DistEnv
from ddp_amp.precision import Precision, amp_cache_key, cached_amp_choices, remember_amp_choice
from ddp_amp.tasks import Task, forward

BF16_MARGIN = 0.05
"""bf16 must beat fp32 by more than this (a ratio within +-5% keeps fp32: full precision for no loss of speed)."""
PROBE_BUDGET_S = 0.6
"""The timing's share of the probe (both precisions together): the probe stays under a second."""
MAX_ROWS = 4096
"""Rows per GEMM at most: a larger micro-batch's GEMMs are timed at this many rows (the ratio barely moves)."""
MAX_SHAPES = 16


def layer_shapes(task: Task, samples: int, device: torch.device) -> list[tuple[int, int, int]]:
    """(rows, in_features, out_features) of every nn.Linear call in one forward of a micro-batch of the task's
    own data, the largest MAX_SHAPES by work. The forward runs in eval mode, without gradients, with the
    random state forked and on samples taken apart from the training data's order: nothing of the run's own
    state (weights, buffers, randomness, data cursor) changes."""
    seen: list[tuple[int, int, int]] = []

    def record(module: torch.nn.Linear, inputs: tuple[Any, ...], _output: Any) -> None:
        seen.append((max(1, inputs[0].numel() // module.in_features), module.in_features, module.out_features))

    model = task.model
    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not hooks:
        return []
    was_training = model.training
    try:
        batch = _first_samples(task, samples)
        from ddp_amp.train.data import to_device

        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            forward(model, to_device(batch, device))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    shapes = sorted({(min(rows, MAX_ROWS), n_in, n_out) for rows, n_in, n_out in seen},
                    key=lambda s: s[0] * s[1] * s[2], reverse=True)
    return shapes[:MAX_SHAPES]


def _first_samples(task: Task, count: int) -> Any:
    dataset = task.dataset
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        samples = [dataset[i] for i in range(min(count, len(dataset)))]
    else:  # an iterable: a fresh iterator of its own, apart from the training loop's
        samples = list(itertools.islice(iter(dataset), count))
    return (task.collate_fn or default_collate)(samples)


def _one_pass(operands: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> float:
    """Seconds for the training step's three GEMMs of every shape: y = x w^T, dx = dy w, dw = dy^T x."""
    start = time.perf_counter()
    for x, w, dy in operands:
        if dtype != torch.float32:  # autocast casts the fp32 weights and inputs at every forward
            x, w, dy = x.to(dtype), w.to(dtype), dy.to(dtype)
        x @ w.t()
        dy @ w
        dy.t() @ x
    return time.perf_counter() - start


def time_gemms(shapes: list[tuple[int, int, int]], budget_s: float = PROBE_BUDGET_S) -> dict[str, float]:
    """Median seconds of one pass of the GEMMs in fp32 and in bf16, interleaved pass by pass (a load that comes
    and goes falls on both), after one warm-up pass each."""
    generator = torch.Generator().manual_seed(0)  # the run's own random state untouched
    operands = [(torch.randn(rows, n_in, generator=generator), torch.randn(n_out, n_in, generator=generator),
                 torch.randn(rows, n_out, generator=generator)) for rows, n_in, n_out in shapes]
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for dtype in dtypes.values():
        _one_pass(operands, dtype)  # warm-up: oneDNN builds its kernels on first use
    deadline = time.perf_counter() + budget_s
    while len(times["fp32"]) < 3 or (time.perf_counter() < deadline and len(times["fp32"]) < 200):
        for name, dtype in dtypes.items():
            times[name].append(_one_pass(operands, dtype))
    return {name: statistics.median(values) for name, values in times.items()}


def decide(fp32_s: float, bf16_s: float) -> str:
    """bf16 only when it is more than BF16_MARGIN faster than fp32."""
    return "bf16" if fp32_s / bf16_s > 1 + BF16_MARGIN else "fp32"


def measured_precision(task: Task, env: DistEnv, device: torch.device,
                       samples: int) -> tuple[Precision, dict[str, Any]]:
    """Rank 0's answer (cached or measured now), shared with every rank: the precision, and what summary.json
    and the progress line report of it."""
    answer: list[dict[str, Any] | None] = [None]
    if env.rank == 0:
        answer[0] = _rank0_answer(task, device, samples)
    dist.broadcast_object_list(answer, src=0)
    found = answer[0]
    assert found is not None
    ratio = found.get("bf16_speedup")
    if ratio is None:
        reason = f"fp32: {found['why']}"
    else:
        verdict = "more than 5% faster" if found["choice"] == "bf16" else "not more than 5% faster"
        reason = (f"bf16 GEMMs at the task's layer shapes ran {ratio:.2f}x fp32 on rank 0, {verdict}"
                  f"{' (cached)' if found.get('cached') else ''}")
    return Precision(found["choice"], reason=reason), found


def _rank0_answer(task: Task, device: torch.device, samples: int) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        shapes = layer_shapes(task, samples, device)
    except Exception as exc:  # the probe is an optimisation: a task it cannot look into trains in fp32
        return {"choice": "fp32", "why": f"the probe could not run the task's forward ({type(exc).__name__})"}
    if not shapes:
        return {"choice": "fp32", "why": "the model has no nn.Linear layers to measure"}
    key = amp_cache_key(torch.__version__, torch.get_num_threads(), shapes)
    cached = cached_amp_choices().get(key)
    if cached is not None and cached.get("choice") in ("fp32", "bf16"):
        return {**cached, "cached": True, "key": key}
    seconds = time_gemms(shapes)
    entry = {"choice": decide(seconds["fp32"], seconds["bf16"]), "bf16_speedup": seconds["fp32"] / seconds["bf16"],
             "fp32_pass_s": seconds["fp32"], "bf16_pass_s": seconds["bf16"], "shapes": [list(s) for s in shapes],
             "probe_s": time.perf_counter() - started, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    remember_amp_choice(key, entry)
    return {**entry, "cached": False, "key": key}
