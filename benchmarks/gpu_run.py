"""The prepared GPU run: the GPU tests first, then the figures docs/benchmarks.md quotes, on one GPU, in about
8 minutes (each step has a time limit; what did not finish is reported as such).

    make gpu-run                      # or: PYTHONPATH=src python3 benchmarks/gpu_run.py [--out DIR]

1. `pytest -m gpu` (bf16-true and fp8 included), its last lines kept;
2. the `gpt` task's ~350 M size, batch 16, --compile: bf16, then fp8 (torchao's tensorwise recipe): tokens/s,
   MFU against the GPU's data sheet, fp8 / bf16;
3. ddp-amp against a hand-written nanoGPT-style loop (benchmarks/gpt_side_by_side.py) on the ~124 M size, bf16,
   --compile, fused AdamW, one round of each (the time limit): tokens/s each, their ratio, ddp-amp's MFU there;
4. bench on the ~124 M size, eager, fp32 against bf16 autocast with TF32 off (named), interleaved.
Everything lands in OUT (default $OUT, else gpu-run-out): gpu-figures.json, gpu-figures.md (the lines for
docs/benchmarks.md), the run dirs and a log. torchao, for fp8: installed, or unpacked into .gpu-deps/ (`make
gpu-deps`, on a machine that reaches an index), which this script puts on the path.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMITS_S = {"pytest": 150, "350m": 100, "side-by-side": 130, "bench": 70}
"""Seconds per step: 550 in all, under the 600 a lent GPU's command may take (a GPU gives 15 minutes in all)."""


def environment() -> dict[str, str]:
    paths = [str(ROOT / "src"), *([str(ROOT / ".gpu-deps")] if (ROOT / ".gpu-deps").is_dir() else []),
             *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def step(name: str, command: list[str], log, limit_s: float) -> tuple[int | None, str]:
    """One command under its time limit, in a process group of its own (a step that runs out is stopped with
    every process it started: no rank left on the GPU for the next step); its output to the log. (exit code or
    None when it ran out, output)."""
    print(f"== {name}: {' '.join(command)}", file=log, flush=True)
    started = time.perf_counter()
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=environment(), cwd=ROOT, start_new_session=True)
    except OSError as exc:  # nvidia-smi missing, say
        print(f"== {name}: {exc}", file=log, flush=True)
        return None, str(exc)
    try:
        output, _ = process.communicate(timeout=limit_s)
        code = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        code, output = None, f"{output}\n(ran out of its {limit_s} s)"
    print(output[-6000:], f"\n== {name}: exit {code} after {time.perf_counter() - started:.0f} s", file=log,
          flush=True)
    return code, output


def spawn_gpt(size: str, dtype: str, run_dir: Path, log) -> dict | None:
    command = [sys.executable, "-m", "ddp_amp", "spawn", "-n", "1", "--device", "cuda", "--task", "gpt",
               "--task-arg", f"size={size}", "--batch-size", "16", "--steps", "60", "--log-every", "20",
               "--dtype", dtype, "--compile", "--optimizer-impl", "fused", "--log-format", "plain", "--run-dir",
               str(run_dir)]
    code, _ = step(f"{size} {dtype}", command, log, LIMITS_S["350m"])
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()) if code == 0 and summary.exists() else None


def gpt_figures(summary: dict | None) -> dict | None:
    if summary is None:
        return None
    return {key: summary.get(key) for key in ("tokens_per_s", "mfu", "achieved_tflops_per_rank", "peak_source",
                                              "compile_s", "precision", "fp8", "task_description")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-run-out"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    figures: dict = {}
    with open(out / "gpu-run.log", "a", encoding="utf-8") as log:
        _, smi = step("nvidia-smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                     "--format=csv,noheader"], log, 20)
        figures["gpu"] = smi.strip()
        save(out, figures)
        code, output = step("pytest -m gpu", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p",
                                              "no:cacheprovider", "-x", "tests/system/test_gpu.py"], log,
                            LIMITS_S["pytest"])
        figures["pytest_gpu"] = {"exit": code, "tail": output.strip().splitlines()[-3:]}
        save(out, figures)
        figures["350m"] = {}
        for dtype in ("bf16", "fp8"):  # each saved as it comes: a run stopped from outside keeps what it measured
            figures["350m"][dtype] = gpt_figures(spawn_gpt("350m", dtype, out / f"350m-{dtype}", log))
            save(out, figures)
        bf16, fp8 = figures["350m"]["bf16"], figures["350m"]["fp8"]
        if bf16 and fp8:
            figures["350m"]["fp8_over_bf16"] = fp8["tokens_per_s"] / bf16["tokens_per_s"]
        side = out / "side-by-side.json"
        step("side by side", [sys.executable, "benchmarks/gpt_side_by_side.py", "--size", "124m", "--batch-size",
                              "16", "--steps", "60", "--repeats", "1", "--json", str(side)], log,
             LIMITS_S["side-by-side"])
        figures["side_by_side_124m"] = json.loads(side.read_text()) if side.exists() else None
        save(out, figures)
        bench = out / "bench-124m.json"
        step("bench 124m", [sys.executable, "-m", "ddp_amp", "bench", "--device", "cuda", "-n", "1", "--task", "gpt",
                            "--task-arg", "size=124m", "--batch-size", "16", "--amp", "both", "--tf32", "off",
                            "--steps", "20", "--warmup", "5", "--repeats", "1", "--json", str(bench), "--run-dir",
                            str(out / "bench-124m")], log, LIMITS_S["bench"])
        figures["bench_124m"] = json.loads(bench.read_text()) if bench.exists() else None
    print("\n".join(save(out, figures)))


def save(out: Path, figures: dict) -> list[str]:
    """gpu-figures.json and gpu-figures.md as they stand (after every step)."""
    (out / "gpu-figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    lines = markdown(figures)
    (out / "gpu-figures.md").write_text("\n".join(lines) + "\n")
    return lines


def markdown(figures: dict) -> list[str]:
    """The figures as docs/benchmarks.md lines."""
    lines = [f"GPU: {figures.get('gpu')}"]
    if "pytest_gpu" in figures:
        lines.append(f"`pytest -m gpu`: exit {figures['pytest_gpu']['exit']} "
                     f"({' '.join(figures['pytest_gpu']['tail'][-1:])})")
    for dtype, entry in figures.get("350m", {}).items():
        if isinstance(entry, dict):
            lines.append(f"- gpt 350m, batch 16, --compile, {dtype}: {entry['tokens_per_s']:.0f} tokens/s, MFU "
                         f"{entry['mfu']:.1%} ({entry['peak_source']})")
        elif entry is None:
            lines.append(f"- gpt 350m {dtype}: did not finish (gpu-run.log)")
    if "fp8_over_bf16" in figures.get("350m", {}):
        lines.append(f"- fp8 (torchao tensorwise) / bf16 on 350m: {figures['350m']['fp8_over_bf16']:.2f}x")
    side = figures.get("side_by_side_124m")
    if side:
        rates = side["tokens_per_s"]
        lines.append(f"- 124m, bf16, --compile: ddp-amp {max(rates['ddp-amp']):.0f} tokens/s, hand-written "
                     f"{max(rates['hand-written']):.0f}; ddp-amp / hand-written {side['ratio']['median']:.3f} "
                     f"(per round {', '.join(f'{r:.3f}' for r in side['ratio']['per_round'])}); ddp-amp's MFU "
                     f"{side.get('ddp_amp_mfu', float('nan')):.1%}")
    bench = figures.get("bench_124m")
    if bench and "speedups" in bench:
        for amp, speedup in bench["speedups"].items():
            lines.append(f"- bench 124m eager: {amp} over fp32 {speedup['median']:.2f}x with TF32 off")
    return lines


if __name__ == "__main__":
    main()
