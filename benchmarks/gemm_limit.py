"""How close a training step comes to the machine's one-core GEMM rate for the model's own layer shapes.

    .venv/bin/python benchmarks/gemm_limit.py [--repeats 3] [--steps 60] [--batch-size 128] [--nproc 2]
        [--variant NAME=FLAGS ...] [--profile]

Model: the 1024-4096-1024-1024 regression MLP of benchmarks/tasks.py, fp32, AdamW, `--nproc` ranks of one
thread each (one core per rank). Each round, interleaved:
  - the GEMM limit: the step's nine matmuls (per Linear: forward, gradient of the input, gradient of the
    weight) at batch `--batch-size`, timed in a process of one thread, alone and with `--nproc` copies at once
    (the cores are as busy as during training);
  - ddp-amp spawn on the same model, once per variant (the defaults, plus any `--variant "name=--flag value"`).
A rank's training rate in GFLOP/s is 6 x (weights of the Linears) x its samples/s; the figure is that over the
GEMM rate with every core busy, median per round. `--profile` adds one profiled run and a breakdown of rank 0's
step: GEMMs, the optimizer, elementwise kernels, the data loader, and the remainder (the all-reduce's wait and
the framework), in ms per step.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import run_ddp_amp, spread

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from tasks import WIDE  # noqa: E402

GEMM_PROCESS = """
import json, sys, time, torch
torch.set_num_threads(1)
batch, widths = int(sys.argv[1]), json.loads(sys.argv[2])
shapes = []
for width_in, width_out in zip(widths, widths[1:]):
    shapes += [(batch, width_in, width_out), (batch, width_out, width_in), (width_in, batch, width_out)]
dtype = getattr(torch, sys.argv[4]) if len(sys.argv) > 4 else torch.float32
pairs = [(torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)) for m, k, n in shapes]
for _ in range(3):
    for a, b in pairs:
        a @ b
times = []
for _ in range(int(sys.argv[3])):
    started = time.perf_counter()
    for a, b in pairs:
        a @ b
    times.append(time.perf_counter() - started)
flops = sum(2 * m * k * n for m, k, n in shapes)
print(json.dumps({"gflops": flops / statistics.median(times) / 1e9, "step_ms": statistics.median(times) * 1e3}))
""".replace("import json, sys, time, torch", "import json, statistics, sys, time, torch")

CATEGORIES = {"GEMM": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
              "optimizer": ("aten::_fused_adamw_", "Optimizer.step", "aten::_foreach"),
              "data": ("enumerate(DataLoader)",),
              "all-reduce call": ("c10d::allreduce_", "gloo:all_reduce")}


def gemm_rate(batch: int, copies: int, repeats: int = 20, dtype: str = "float32") -> float:
    """GFLOP/s of one one-thread process over the step's matmuls in `dtype`, `copies` processes running at
    once."""
    command = [sys.executable, "-c", GEMM_PROCESS, str(batch), json.dumps(list(WIDE)), str(repeats), dtype]
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(copies)]
    rates = [json.loads(p.communicate()[0])["gflops"] for p in processes]
    return statistics.median(rates)


def training_gflops(summary: dict) -> float:
    weights = sum(a * b for a, b in zip(WIDE, WIDE[1:]))
    return 6 * weights * summary["rank_samples_per_s"] / 1e9


def breakdown(summary: dict, steps: int) -> dict[str, float]:
    """ms per step of rank 0's profiled window by category; "other": the step time the operators' own CPU time
    does not cover (waiting for the all-reduce, Python and framework)."""
    ops = summary["profile"]["top_ops"]
    parts = {name: 0.0 for name in (*CATEGORIES, "elementwise and other operators")}
    for op in ops:
        category = next((c for c, names in CATEGORIES.items() if op["name"].startswith(names)),
                        "elementwise and other operators")
        parts[category] += op["self_cpu_ms"] / steps
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--variant", action="append", default=[], help='"name=--flag value ..." (repeatable)')
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    base = ["spawn", "-n", str(args.nproc), "--device", "cpu", "--task", f"{HERE / 'tasks.py'}:wide_regression",
            "--amp", "off", "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--log-every", str(args.steps), "--quiet", "--overwrite"]
    variants = {"default": []} | {spec.split("=", 1)[0]: spec.split("=", 1)[1].split() for spec in args.variant}
    alone, busy = [], []
    rates: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            alone.append(gemm_rate(args.batch_size, 1))
            busy.append(gemm_rate(args.batch_size, args.nproc))
            for name, extra in variants.items():
                summary = run_ddp_amp(base + extra, Path(tmp) / f"{name}{repeat}")
                rates[name].append(training_gflops(summary))
        print(f"GEMM limit, one thread, alone: {spread(alone, '.1f')} GFLOP/s; with {args.nproc} at once: "
              f"{spread(busy, '.1f')} GFLOP/s")
        for name, values in rates.items():
            share = [value / limit for value, limit in zip(values, busy)]
            print(f"{name}: {spread(values, '.1f')} GFLOP/s per rank = {spread(share, '.3f')} of the GEMM limit "
                  f"with every core busy (per round)")
        if args.profile:
            window = (args.steps // 2 + 1, args.steps // 2 + 10)
            summary = run_ddp_amp(base + ["--profile", f"{window[0]}:{window[1]}"], Path(tmp) / "profiled")
            steps = window[1] - window[0] + 1
            step_ms = 1e3 * summary["profile"]["window_s"] / steps  # profiled steps run slower than the others
            parts = breakdown(summary, steps)
            print(f"rank 0's step, profiled steps {window[0]}-{window[1]}: {step_ms:.1f} ms (unprofiled: "
                  f"{1e3 * args.batch_size / summary['rank_samples_per_s']:.1f} ms)")
            for name, ms in parts.items():
                print(f"  {name:<34} {ms:7.1f} ms")
            print(f"  {'rest (all-reduce wait, framework)':<34} {step_ms - sum(parts.values()):7.1f} ms")


if __name__ == "__main__":
    main()
