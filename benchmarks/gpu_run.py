"""The prepared GPU run: the GPU tests never run on a GPU yet, then the figures docs/benchmarks.md quotes, then
the rest of the GPU tests, on one GPU, within one device command (a deadline: what does not fit is named, with
the command that runs it).

    make gpu-run                      # or: PYTHONPATH=src python3 benchmarks/gpu_run.py [--parts ...]

Parts, in this order (`--parts` picks some, for a second call):
1. tests-new: `pytest -m gpu -k "bf16_true or fp8 or gpt_task or amp_all"`, 4 workers (the tests written since
   the last GPU run);
2. 350m: the `gpt` task's ~350 M size, batch 16, --compile: bf16, then fp8 (torchao's tensorwise recipe):
   tokens/s, MFU against the GPU's data sheet, fp8 / bf16;
3. side-by-side: ddp-amp against a hand-written nanoGPT-style loop (benchmarks/gpt_side_by_side.py) on the
   ~124 M size, bf16, --compile, fused AdamW, one round of each: tokens/s each, their ratio, ddp-amp's MFU;
4. bench: the ~124 M size, eager, fp32 against bf16 autocast with TF32 off (named), interleaved;
5. tests-rest: the other GPU tests, 4 workers.
OUT (default $OUT, else gpu-run-out) gets a few small files only (a lent GPU's command brings back 8): the log,
gpu-figures.json, gpu-figures.md (the lines for docs/benchmarks.md), the side-by-side's and bench's JSON and the
two 350m summaries; the run dirs (a 350m model.pt is 1.4 GB) go to a scratch dir. torchao, for fp8: installed,
or unpacked into .gpu-deps/ (`make gpu-deps`, on a machine that reaches an index), put on the path here.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("tests-new", "350m", "side-by-side", "bench", "tests-rest")
NEW_TESTS = "bf16_true or fp8 or gpt_task or amp_all"
"""The GPU tests not yet run on a GPU (test_gpu.py's names): first, before the figures."""
LIMITS_S = {"nvidia-smi": 20, "tests-new": 120, "350m": 140, "side-by-side": 140, "bench": 70, "tests-rest": 240}
"""Seconds per step (350m: each of bf16 and fp8); every step also ends by the deadline."""
DEADLINE_S = 570
"""The whole run's seconds: under the 600 a lent GPU's command may take (a GPU gives 15 minutes in all)."""
SHORTEST_S = 45
"""A step with less time left than this is not started: reported as not run, with its command."""
GRACE_S = 5
"""After its time is up a step's processes get SIGTERM, then SIGKILL: ddp-amp's stop checkpoint of a 350m
model is not wanted here."""


def environment() -> dict[str, str]:
    paths = [str(ROOT / "src"), *([str(ROOT / ".gpu-deps")] if (ROOT / ".gpu-deps").is_dir() else []),
             *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


class Steps:
    """The steps of one run, their output to one log, each under its limit and the run's deadline."""

    def __init__(self, log, deadline_s: float) -> None:
        self.log, self.ends_at = log, time.monotonic() + deadline_s
        self.not_run: list[str] = []

    def left_s(self) -> float:
        return self.ends_at - time.monotonic()

    def run(self, name: str, command: list[str], limit_s: float) -> tuple[int | None, str]:
        """One command in a process group of its own (one that runs out is stopped with every process it
        started: no rank left on the GPU for the next step). (exit code, or None when it ran out or did not
        run; its output)."""
        if self.left_s() - GRACE_S < min(limit_s, SHORTEST_S):
            self.not_run.append(name)
            print(f"== {name}: not run, {self.left_s():.0f} s left", file=self.log, flush=True)
            return None, "not run: out of time"
        limit_s = min(limit_s, self.left_s() - GRACE_S)
        print(f"== {name}: {' '.join(command)}", file=self.log, flush=True)
        started = time.monotonic()
        try:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=environment(), cwd=ROOT, start_new_session=True)
        except OSError as exc:  # nvidia-smi missing, say
            print(f"== {name}: {exc}", file=self.log, flush=True)
            return None, str(exc)
        try:
            output, _ = process.communicate(timeout=limit_s)
            code = process.returncode
        except subprocess.TimeoutExpired:
            output, code = f"{stop(process)}\n(ran out of its {limit_s:.0f} s)", None
        print(output[-6000:], f"\n== {name}: exit {code} after {time.monotonic() - started:.0f} s", file=self.log,
              flush=True)
        return code, output


def stop(process: subprocess.Popen) -> str:
    """SIGTERM to the step's process group, SIGKILL after GRACE_S; what it printed."""
    for signum, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:  # the group is gone already
            pass
        try:
            return process.communicate(timeout=wait_s)[0]
        except subprocess.TimeoutExpired:
            continue
    return ""


def pytest_gpu(steps: Steps, name: str, selection: str) -> dict:
    """`pytest -m gpu` on 4 workers (pytest-xdist, which the GPU machine has), every test run (no -x)."""
    code, output = steps.run(name, [sys.executable, "-m", "pytest", "-m", "gpu", "-k", selection, "-q", "-n", "4",
                                    "-p", "no:cacheprovider", "tests/system/test_gpu.py"], LIMITS_S[name])
    return {"exit": code, "tail": output.strip().splitlines()[-3:]}


def gpt_350m(steps: Steps, plan: argparse.Namespace, work: Path, out: Path) -> dict:
    figures: dict = {}
    for dtype in ("bf16", "fp8"):
        run_dir = work / f"350m-{dtype}"
        command = [sys.executable, "-m", "ddp_amp", "spawn", "-n", "1", "--device", plan.device, "--task", "gpt",
                   "--task-arg", f"size={plan.large}", "--batch-size", "16", "--steps", "60", "--log-every", "20",
                   "--dtype", dtype, *plan.compile, "--optimizer-impl", "fused", "--log-format", "plain",
                   "--run-dir", str(run_dir)]
        code, _ = steps.run(f"350m {dtype}", command, LIMITS_S["350m"])
        summary = run_dir / "summary.json"
        figures[dtype] = None
        if code == 0 and summary.exists():
            shutil.copy(summary, out / f"350m-{dtype}.summary.json")
            figures[dtype] = {key: json.loads(summary.read_text()).get(key) for key in (
                "tokens_per_s", "mfu", "achieved_tflops_per_rank", "peak_source", "compile_s", "precision", "fp8",
                "task_description")}
    if figures["bf16"] and figures["fp8"]:
        figures["fp8_over_bf16"] = figures["fp8"]["tokens_per_s"] / figures["bf16"]["tokens_per_s"]
    return figures


def side_by_side(steps: Steps, plan: argparse.Namespace, out: Path) -> dict | None:
    side = out / "side-by-side.json"
    steps.run("side-by-side", [sys.executable, "benchmarks/gpt_side_by_side.py", "--device", plan.device, "--size",
                               plan.small, "--batch-size", "16", "--steps", "60", "--repeats", "1", "--json",
                               str(side), *([] if plan.compile else ["--no-compile"])], LIMITS_S["side-by-side"])
    return json.loads(side.read_text()) if side.exists() else None


def bench_124m(steps: Steps, plan: argparse.Namespace, work: Path, out: Path) -> dict | None:
    bench = out / "bench-124m.json"
    steps.run("bench", [sys.executable, "-m", "ddp_amp", "bench", "--device", plan.device, "-n", "1", "--task",
                        "gpt", "--task-arg", f"size={plan.small}", "--batch-size", "16", "--amp", "both",
                        *plan.tf32_off, "--steps", "20", "--warmup", "5", "--repeats", "1", "--json", str(bench),
                        "--run-dir", str(work / "bench-124m")], LIMITS_S["bench"])
    return json.loads(bench.read_text()) if bench.exists() else None


FP8_ON_CPU = Path(__file__).resolve().parent.parent / "tests" / "fp8_on_cpu"


def lift_fp8_refusal() -> None:
    """A rehearsal's fp8 runs: torch's CPU kernels emulate fp8, so with ddp-amp's refusal of it on CPU ranks
    lifted in every process of the steps (tests/fp8_on_cpu's sitecustomize on their path, as
    tests/system/test_fp8_on_cpu.py puts it; it also turns oneDNN off, whose fp8 kernel on a CPU with AMX is a
    reference one, ~1 s a matmul), the 350m part's fp8 half and its figures are rehearsed too."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FP8_ON_CPU), os.environ.get("PYTHONPATH")]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-run-out"))
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole run")
    parser.add_argument("--rehearse", action="store_true",
                        help="on this CPU: the tiny size, eager, fp8 emulated, the same steps and files (checks "
                             "this script)")
    args = parser.parse_args()
    plan = argparse.Namespace(device="cuda", large="350m", small="124m", compile=["--compile"],
                              tf32_off=["--tf32", "off"])
    if args.rehearse:
        plan = argparse.Namespace(device="cpu", large="tiny", small="tiny", compile=[], tf32_off=[])
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-run-"))  # run dirs: model.pt files too large to bring back
    if args.rehearse:
        lift_fp8_refusal()
    figures: dict = json.loads((out / "gpu-figures.json").read_text()) if (out / "gpu-figures.json").exists() else {}
    with open(out / "gpu-run.log", "a", encoding="utf-8") as log:
        steps = Steps(log, args.deadline)
        _, smi = steps.run("nvidia-smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                          "--format=csv,noheader"], LIMITS_S["nvidia-smi"])
        figures["gpu"] = "rehearsal on the CPU" if args.rehearse else smi.strip()
        figures["plan"] = {"large": plan.large, "small": plan.small, "compile": bool(plan.compile)}
        parts = {"tests-new": lambda: pytest_gpu(steps, "tests-new", NEW_TESTS),
                 "350m": lambda: gpt_350m(steps, plan, work, out),
                 "side-by-side": lambda: side_by_side(steps, plan, out),
                 "bench": lambda: bench_124m(steps, plan, work, out),
                 "tests-rest": lambda: pytest_gpu(steps, "tests-rest", f"not ({NEW_TESTS})")}
        for part in PARTS:  # in this order, whatever order --parts named them in
            if part in args.parts:
                figures[part] = parts[part]()
                save(out, figures)  # after each part: a run stopped from outside keeps what it measured
        figures["not_run"] = list(dict.fromkeys(name.split()[0] for name in steps.not_run))  # parts
    shutil.rmtree(work, ignore_errors=True)
    print("\n".join(save(out, figures)))


def save(out: Path, figures: dict) -> list[str]:
    """gpu-figures.json and gpu-figures.md as they stand (after every step)."""
    (out / "gpu-figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    lines = markdown(figures)
    (out / "gpu-figures.md").write_text("\n".join(lines) + "\n")
    return lines


def number(value, spec: str) -> str:
    """`value` formatted, or n/a where a run did not report it (a figure missing must not lose the others)."""
    return "n/a" if value is None else format(value, spec)


def markdown(figures: dict) -> list[str]:
    """The figures as docs/benchmarks.md lines."""
    lines = [f"GPU: {figures.get('gpu')}"]
    plan = figures.get("plan") or {"large": "350m", "small": "124m", "compile": True}
    compiled = "--compile" if plan["compile"] else "eager"
    for part in ("tests-new", "tests-rest"):
        if part in figures:
            tail = " ".join(figures[part]["tail"][-1:])
            lines.append(f"- `pytest -m gpu` ({part}): exit {figures[part]['exit']} ({tail})")
    gpt = figures.get("350m") or {}
    for dtype in ("bf16", "fp8"):
        entry = gpt.get(dtype)
        if isinstance(entry, dict):
            rate, mfu, compile_s = (number(entry[key], spec) for key, spec in (
                ("tokens_per_s", ".0f"), ("mfu", ".1%"), ("compile_s", ".0f")))
            lines.append(f"- gpt {plan['large']}, batch 16, {compiled}, {dtype}: {rate} tokens/s, MFU {mfu} "
                         f"({entry['peak_source']}), compile {compile_s} s")
        elif dtype in gpt:
            lines.append(f"- gpt {plan['large']} {dtype}: did not finish (gpu-run.log)")
    if "fp8_over_bf16" in gpt:
        kept = ", ".join((gpt["fp8"].get("fp8") or {}).get("output_layers_kept") or []) or "no layer"
        lines.append(f"- fp8 (torchao tensorwise; {kept} kept in bf16) / bf16 on {plan['large']}: "
                     f"{gpt['fp8_over_bf16']:.2f}x")
    side = figures.get("side-by-side")
    if side:
        ours, theirs = max(side["tokens_per_s"]["ddp-amp"]), max(side["tokens_per_s"]["hand-written"])
        rounds = ", ".join(f"{ratio:.3f}" for ratio in side["ratio"]["per_round"])
        lines.append(f"- gpt {plan['small']}, batch 16, bf16, {compiled}: ddp-amp {ours:.0f} tokens/s, "
                     f"hand-written {theirs:.0f}; ddp-amp / hand-written {side['ratio']['median']:.3f} (per round "
                     f"{rounds}); ddp-amp's MFU {number(side.get('ddp_amp_mfu'), '.1%')}")
    bench = figures.get("bench")
    if bench and "speedups" in bench:
        for amp, speedup in bench["speedups"].items():
            lines.append(f"- bench gpt {plan['small']}, eager: {amp} over fp32 {speedup['median']:.2f}x with TF32 off")
    if figures.get("not_run"):
        lines.append(f"- not run, out of time: `PYTHONPATH=src python3 benchmarks/gpu_run.py --parts "
                     f"{' '.join(figures['not_run'])}` runs them in a second call")
    return lines


if __name__ == "__main__":
    main()
