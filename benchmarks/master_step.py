"""What a fused master-weight step would save bf16-true on this CPU: the per-step work that does not shrink with
the bf16 GEMMs, timed alone on the peer model's parameters (1024-4096-1024-1024 MLP, 9.4 M), one thread.

    .venv/bin/python benchmarks/master_step.py [--repeats 5] [--steps 30] [--shapes mlp|transformer]

Two ways of the same update, interleaved, per round the median of `--steps` timed steps:
- ddp-amp's (parallel.master): the bf16 gradients widened into the fp32 masters' (`.float()`), torch's fused
  AdamW over the masters, the masters written back rounded into the bf16 weights (`_foreach_copy_`): three
  passes over memory, each timed on its own too;
- one pass: --optimizer-impl compiled (parallel.master_step.MasterAdamW), the same AdamW compiled by
  torch.compile (inductor's C++), reading the bf16 gradient and writing the bf16 weight inside the update.
Printed: each in ms a step, the one-pass step over the three passes', and the compile time. `--shapes
transformer`: a GPT-2-style model's 150 tensors instead of the MLP's 8 (12 blocks of width 256, a vocabulary of
8192: 11.6 M parameters), where the one pass's per-tensor host work (a step count read, the step's scalars, a
call of the compiled pass) adds up.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import spread  # noqa: E402

from ddp_amp.parallel.master_step import MasterAdamW  # noqa: E402
from ddp_amp.precision import cpu_model  # noqa: E402

SHAPES = {"mlp": [(4096, 1024), (4096,), (1024, 4096), (1024,), (1024, 1024), (1024,), (1, 1024), (1,)],
          "transformer": [(8192, 256), (256, 256), *[shape for _ in range(12) for shape in (
              (256,), (256,), (768, 256), (768,), (256, 256), (256,), (256,), (256,), (1024, 256), (1024,),
              (256, 1024), (256,))], (256,), (256,)]}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


def median_ms(step, steps: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="mlp")
    args = parser.parse_args()
    shapes = SHAPES[args.shapes]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    weights = [master.detach().bfloat16() for master in masters]
    grads = [torch.randn(shape).bfloat16() for shape in shapes]
    optimizer = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)

    @torch.no_grad()
    def widen():
        for master, grad in zip(masters, grads):
            master.grad = grad.float()

    @torch.no_grad()
    def write_back():
        torch._foreach_copy_(weights, masters)

    def three_passes():
        widen()
        optimizer.step()
        write_back()

    own = [torch.nn.Parameter(master.detach().clone()) for master in masters]
    own_weights = [torch.nn.Parameter(weight.clone()) for weight in weights]
    one_pass = MasterAdamW(own, list(zip(own_weights, own)), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

    def fused():
        for weight, grad in zip(own_weights, grads):
            weight.grad = grad  # DDP's all-reduced bf16 gradient, taken (and dropped) by the step
        one_pass.step()

    started = time.perf_counter()
    fused()
    compile_s = time.perf_counter() - started
    figures: dict[str, list[float]] = {"widen": [], "AdamW (fused)": [], "write back": [], "three passes": [],
                                       "one pass (compiled)": []}
    for _ in range(args.repeats):
        for name, step in (("widen", widen), ("AdamW (fused)", optimizer.step), ("write back", write_back),
                           ("three passes", three_passes), ("one pass (compiled)", fused)):
            figures[name].append(median_ms(step, args.steps))
    print(f"CPU: {cpu_model()}; one thread; {sum(m.numel() for m in masters) / 1e6:.1f} M parameters in "
          f"{len(masters)} tensors ({args.shapes})")
    for name, values in figures.items():
        print(f"{name:<20} {spread(values)} ms a step")
    ratio = [fused_ms / plain for fused_ms, plain in zip(figures["one pass (compiled)"], figures["three passes"])]
    print(f"one pass / three passes, per round: {spread(ratio)}; compiled in {compile_s:.1f} s")


if __name__ == "__main__":
    main()
