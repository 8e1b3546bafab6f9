"""The LR schedule equals its closed form, warm-up included, and never climbs after cosine ends."""

import warnings

import pytest
import torch

from ddp_amp.train.schedule import build_scheduler, closed_form_lr

LR, TOTAL = 0.1, 40


def trace(schedule: str, warmup: int, steps: int, min_lr_ratio: float = 0.1) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=LR)
    scheduler = build_scheduler(optimizer, schedule=schedule, total_steps=TOTAL, warmup_steps=warmup,
                                min_lr_ratio=min_lr_ratio)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("warmup", [0, 1, 5])
@pytest.mark.parametrize("schedule", ["constant", "cosine", "exponential", "step"])
def test_schedule_matches_closed_form(schedule, warmup):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler.step() before optimizer.step()" or deprecation warnings
        lrs = trace(schedule, warmup, TOTAL)
    expected = [closed_form_lr(i, lr=LR, schedule=schedule, total_steps=TOTAL, warmup_steps=warmup,
                               min_lr_ratio=0.1) for i in range(TOTAL)]
    assert lrs == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_warmup_rises_linearly_to_peak():
    lrs = trace("cosine", 4, 6)
    assert lrs[:5] == pytest.approx([LR / 5, 2 * LR / 5, 3 * LR / 5, 4 * LR / 5, LR])


@pytest.mark.parametrize("warmup", [0, 5])
def test_cosine_never_rises_again_after_it_ends(warmup):
    lrs = trace("cosine", warmup, TOTAL + 30)
    after_peak = lrs[warmup:]
    assert all(b <= a + 1e-15 for a, b in zip(after_peak, after_peak[1:])), "LR climbed again"
    assert lrs[-1] == pytest.approx(LR * 0.1)


def test_ends_where_min_lr_ratio_says():
    assert trace("exponential", 0, TOTAL + 1)[-1] == pytest.approx(LR * 0.1)
    assert trace("step", 0, TOTAL)[-1] == pytest.approx(LR * 0.01)


def test_onecycle_peaks_at_end_of_warmup():
    lrs = trace("onecycle", 10, TOTAL)
    assert max(range(TOTAL), key=lrs.__getitem__) == 10
    assert lrs[10] == pytest.approx(LR)
    assert lrs[-1] == pytest.approx(LR * 0.1)  # ends at --min-lr-ratio (0.1 in trace)


@pytest.mark.parametrize("min_lr_ratio", [0.1, 0.0])
def test_onecycle_honours_min_lr_ratio_and_leaves_momentum_alone(min_lr_ratio):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizers = [torch.optim.SGD([param], lr=LR, momentum=0.7), torch.optim.AdamW([param], lr=LR, betas=(0.8, 0.9))]
    for optimizer in optimizers:
        scheduler = build_scheduler(optimizer, schedule="onecycle", total_steps=TOTAL, warmup_steps=5,
                                    min_lr_ratio=min_lr_ratio)
        lrs = []
        for _ in range(TOTAL):
            lrs.append(optimizer.param_groups[0]["lr"])
            group = optimizer.param_groups[0]
            assert group.get("momentum", 0.7) == 0.7 and group.get("betas", (0.8, 0.9)) == (0.8, 0.9)
            optimizer.step()
            scheduler.step()
        assert max(lrs) == pytest.approx(LR)
        assert lrs[-1] == pytest.approx(LR * min_lr_ratio, abs=1e-12)
