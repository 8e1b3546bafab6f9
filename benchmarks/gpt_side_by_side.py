"""ddp-amp against a hand-written nanoGPT-style DDP loop of the same GPT, interleaved: tokens/s each.

    .venv/bin/python benchmarks/gpt_side_by_side.py [--size 124m] [--batch-size 8] [--steps 60] [--repeats 2]
        [--dtype bf16] [--no-compile] [--device cuda] [--json OUT.json]

Both train the built-in `gpt` task's model (ddp_amp.tasks.gpt.GPT, the size given) on its generated tokens,
one rank (world size 1: nccl on a GPU, gloo on a CPU), the same batch, autocast dtype, torch.compile and fused
AdamW (lr 3e-3, cosine to a tenth). The hand-written loop is nanoGPT's: the batch drawn from a tensor, pinned and
copied without blocking, `model(x)`, the loss, `backward()`, `step()`, `zero_grad(set_to_none=True)`. Each
measures its steady state as ddp-amp does (from step min(20, steps // 10) to the end, the device synchronised
at both ends: the compiling first steps left out). Rounds alternate hand-written, ddp-amp; printed: each one's
tokens/s per round and ddp-amp / hand-written per round (median [min-max]).
"""

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import spread

HERE = Path(__file__).parent


def handwritten(args) -> float:
    """One run of the hand-written loop in this process; its steady-state tokens/s."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_amp.tasks.gpt import GPT, SEQUENCES, SIZES, cross_entropy, token_walks

    device = torch.device(args.device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    config = SIZES[args.size]
    (walks,), _ = token_walks(config, SEQUENCES)
    model = GPT(config).to(device)
    if args.compile:
        model = torch.compile(model)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, fused=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps, eta_min=3e-4)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    generator = torch.Generator().manual_seed(0)
    measure_from = min(20, max(1, args.steps // 10))
    started = None
    for step in range(args.steps):
        rows = torch.randint(0, len(walks), (args.batch_size,), generator=generator)
        batch = walks[rows]
        x, y = batch[:, :-1], batch[:, 1:]
        if device.type == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step + 1 == measure_from:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    # DDP sits in a reference cycle: freed by the collector only, it would take the gloo group's last reference
    # after destroy_process_group, and the group's destructor can hang or abort the rank at exit (docs/scripts.md).
    del model, optimizer, scheduler
    gc.collect()
    dist.destroy_process_group()
    return (args.steps - measure_from) * args.batch_size * config.context / seconds


def ddp_amp(args, run_dir: Path) -> dict:
    """One ddp-amp launch of the same training; its summary.json (steady-state tokens/s, MFU)."""
    command = [sys.executable, "-m", "ddp_amp", "spawn", "-n", "1", "--device", args.device,
               "--task", "gpt", "--task-arg", f"size={args.size}", "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--log-every", str(args.steps), "--optimizer-impl", "fused",
               "--no-async-checkpoint", "--quiet", "--run-dir", str(run_dir),
               *(["--amp", "off"] if args.dtype == "fp32" else ["--amp", "on", "--dtype", args.dtype]),
               *(["--compile"] if args.compile else [])]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"ddp-amp failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="124m")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one-handwritten", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_handwritten:  # a child: one run, its figure on stdout
        print(json.dumps({"tokens_per_s": handwritten(args)}))
        return
    rates: dict[str, list[float]] = {"hand-written": [], "ddp-amp": []}
    mfu: list[float] = []
    child = [sys.executable, __file__, "--one-handwritten", *sys.argv[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            rates["hand-written"].append(json.loads(out.strip().splitlines()[-1])["tokens_per_s"])
            summary = ddp_amp(args, Path(tmp) / f"run{repeat}")
            rates["ddp-amp"].append(summary["tokens_per_s"])
            mfu.append(summary.get("mfu") or float("nan"))
    ratio = [a / h for a, h in zip(rates["ddp-amp"], rates["hand-written"])]
    print(f"gpt {args.size}, batch {args.batch_size}, {args.dtype}, compile {'on' if args.compile else 'off'}, "
          f"{args.device}, {args.steps} steps, {args.repeats} interleaved rounds")
    for name, values in rates.items():
        print(f"{name:<13} {spread(values, '.0f')} tokens/s")
    print(f"ddp-amp / hand-written per round: {spread(ratio, '.3f')}; ddp-amp's MFU {spread(mfu, '.1%')}")
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "batch_size": args.batch_size, "dtype": args.dtype,
                                         "compile": args.compile, "tokens_per_s": rates,
                                         "ratio": {"median": statistics.median(ratio), "per_round": ratio},
                                         "ddp_amp_mfu": statistics.median(mfu)},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
