"""What bf16 weights (--dtype bf16-true) buy on this CPU, against fp32 and bf16 autocast, beside the machine's
own bf16/fp32 GEMM ratio.

    .venv/bin/python benchmarks/bf16_true.py [--repeats 3] [--steps 60] [--batch-size 128] [--nproc 2] [--profile]

Model: the 1024-4096-1024-1024 regression MLP of benchmarks/tasks.py (the peer model), AdamW (fused), `--nproc`
ranks of one thread each. Each round, interleaved: the step's nine matmuls timed in fp32 and in bf16 with
`--nproc` one-thread processes at once (benchmarks/gemm_limit.py); then ddp-amp spawn in fp32, under bf16
autocast, in bf16-true, and in bf16-true with --optimizer-impl compiled (the master-weight step in one compiled
pass, parallel.master_step). Printed: the CPU (model, family, bf16 flags), the GEMM ratio bf16/fp32, each
precision's step rate over fp32's per round, and the target of issue #46 (0.5 x the GEMM ratio). `--profile` adds
one profiled run of fp32 and of both bf16-true steps, and rank 0's step in each, in ms: GEMMs, the optimizer, the
copies and casts (bf16-true's masters: gradients in, weights back), other operators, and the rest (the
all-reduce's wait, Python and the framework): where the bf16 GEMMs' gain goes.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import run_ddp_amp, spread

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from gemm_limit import CATEGORIES, gemm_rate  # noqa: E402

from ddp_amp.precision import cpu_flags, cpu_model  # noqa: E402

PRECISIONS = {"fp32": ["--amp", "off"], "bf16 autocast": ["--amp", "on", "--dtype", "bf16"],
              "bf16-true": ["--amp", "on", "--dtype", "bf16-true"],
              "bf16-true, compiled step": ["--amp", "on", "--dtype", "bf16-true", "--optimizer-impl", "compiled"]}
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    base = ["spawn", "-n", str(args.nproc), "--device", "cpu", "--task", f"{HERE / 'tasks.py'}:wide_regression",
            "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--log-every", str(args.steps),
            "--quiet", "--overwrite"]
    gemm: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    rates: dict[str, list[float]] = {name: [] for name in PRECISIONS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for dtype in gemm:
                gemm[dtype].append(gemm_rate(args.batch_size, args.nproc, dtype=dtype))
            for name, flags in PRECISIONS.items():
                summary = run_ddp_amp(base + flags, Path(tmp) / f"{name.replace(' ', '-').replace(',', '')}{repeat}")
                assert summary["precision"] == (flags[3] if name != "fp32" else "fp32")
                rates[name].append(summary["rank_samples_per_s"])
    flags = sorted(cpu_flags() & set(BF16_FLAGS))
    print(f"CPU: {cpu_model()}; bf16 flags: {' '.join(flags) or 'none'}; {args.nproc} ranks of one thread")
    ratio = [b / f for b, f in zip(gemm["bfloat16"], gemm["float32"])]
    print(f"GEMM, the step's matmuls, {args.nproc} one-thread processes at once: fp32 {spread(gemm['float32'], '.1f')}"
          f" GFLOP/s, bf16 {spread(gemm['bfloat16'], '.1f')} GFLOP/s; bf16/fp32 {spread(ratio)}")
    for name, values in rates.items():
        over = [value / fp32 for value, fp32 in zip(values, rates["fp32"])]
        print(f"{name:<24} {spread(values, '.0f')} samples/s per rank; over fp32 per round {spread(over)}")
    if args.profile:
        profile(base, args)
    target = 0.5 * statistics.median(ratio)
    for name in ("bf16-true", "bf16-true, compiled step"):
        reached = statistics.median(v / f for v, f in zip(rates[name], rates["fp32"]))
        print(f"target (0.5 x the GEMM ratio): {target:.2f}x; {name} reached {reached:.2f}x"
              f"{'' if reached >= target else ' (not reached)'}")


# The compiled master step's one pass runs as inductor's kernel inside a compiled region: the optimizer's time.
PROFILED = {**CATEGORIES, "optimizer": (*CATEGORIES["optimizer"], "Torch-Compiled Region", "cpp_fused",
                                        "CompiledFunction", "## Call CompiledFxGraph"),
            "copies and casts": ("aten::copy_", "aten::_to_copy", "aten::to")}


def profile(base: list[str], args) -> None:
    """One profiled run each of fp32 and bf16-true: rank 0's step by category, ms per step."""
    window = (args.steps // 2 + 1, args.steps // 2 + 10)
    steps = window[1] - window[0] + 1
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("fp32", "bf16-true", "bf16-true, compiled step"):
            summary = run_ddp_amp(base + PRECISIONS[name] + ["--profile", f"{window[0]}:{window[1]}"],
                                  Path(tmp) / name.replace(" ", "-").replace(",", ""))
            step_ms = 1e3 * summary["profile"]["window_s"] / steps
            parts = {category: 0.0 for category in (*PROFILED, "other operators")}
            for op in summary["profile"]["top_ops"]:
                category = next((c for c, names in PROFILED.items() if op["name"].startswith(names)),
                                "other operators")
                parts[category] += op["self_cpu_ms"] / steps
            detail = ", ".join(f"{category} {ms:.1f}" for category, ms in parts.items())
            print(f"{name} profiled step {step_ms:.1f} ms: {detail}, rest {step_ms - sum(parts.values()):.1f}")


if __name__ == "__main__":
    main()
