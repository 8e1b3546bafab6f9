"""This working tree's ddp-amp against an earlier revision's: the same weights, bit for bit, on the built-in tasks
in every --shard mode and both checkpoint formats, for a run that trains straight through and for one resumed
from its middle checkpoint. For a change that must not change what is trained (a refactor).

    .venv/bin/python benchmarks/same_weights.py --base REV [--tasks linear mlp transformer]

Each side's src/ is put first on PYTHONPATH for its launches, as in against_revision.py. Compared: model.pt of the
straight run, the straight run's last checkpoint (its model and optimizer state), and model.pt of a run that
resumed from the straight run's middle checkpoint (--resume PATH). Exit 1 when anything differs.
"""

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from against_revision import export_src

HERE = Path(__file__).parent
TASKS = {"linear": 16, "mlp": 16, "transformer": 8}
"""--tasks: the batch per rank."""
STEPS = 8


def launch(env: dict[str, str], run_dir: Path, task: str, shard: str, checkpoint_format: str, steps: int,
           *extra: str) -> None:
    subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", "--device", "cpu", "--amp", "off",
                    "--task", task, "--batch-size", str(TASKS[task]), "--steps", str(steps), "--checkpoint-every",
                    str(STEPS // 2), "--checkpoint-format", checkpoint_format, "--shard", shard, "--quiet",
                    "--run-dir", str(run_dir), *extra], check=True, capture_output=True, env=env)


def checkpoint_state(path: Path) -> dict:
    """A checkpoint's model and optimizer, whole: a single file as saved, a sharded one read by DCP here."""
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = path.parent / f"{path.name}.whole.pt"
        dcp_to_torch_save(str(path), str(whole))
        return torch.load(whole, weights_only=False)
    state = torch.load(path, weights_only=False)["trainer"]
    return {"model": state["model"], "optimizer": state["optimizer"]}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def outputs(env: dict[str, str], root: Path, task: str, shard: str, checkpoint_format: str) -> dict:
    straight, resumed = root / "straight", root / "resumed"
    launch(env, straight, task, shard, checkpoint_format, STEPS)
    steps = {int(p.name.split("-")[1].split(".")[0]): p for p in (straight / "checkpoints").glob("step-*")
             if p.suffix == ".pt" or p.is_dir()}  # not the sidecars
    middle, last = steps[STEPS // 2], steps[STEPS]
    launch(env, resumed, task, shard, checkpoint_format, STEPS, "--resume", str(middle))
    return {"model.pt": torch.load(straight / "model.pt", weights_only=True),
            f"checkpoint {last.name}": checkpoint_state(last),
            "model.pt after a resume": torch.load(resumed / "model.pt", weights_only=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=sorted(TASKS))
    args = parser.parse_args()
    differ = 0
    with tempfile.TemporaryDirectory() as tmp:
        base_src = export_src(args.base, Path(tmp))
        sides = {"tree": {**os.environ, "PYTHONPATH": str(HERE.parent / "src")},
                 "base": {**os.environ, "PYTHONPATH": str(base_src)}}
        for task, shard, checkpoint_format in itertools.product(args.tasks, ("none", "optimizer", "full"),
                                                                 ("single", "sharded")):
            name = f"{task}-{shard}-{checkpoint_format}"
            found = {side: outputs(env, Path(tmp) / side / name, task, shard, checkpoint_format)
                     for side, env in sides.items()}
            verdicts = [f"{what} {'same' if same(value, found['base'][what]) else 'DIFFERENT'}"
                        for what, value in found["tree"].items()]
            differ += sum("DIFFERENT" in v for v in verdicts)
            print(f"--task {task} --shard {shard} --checkpoint-format {checkpoint_format}: {', '.join(verdicts)}",
                  flush=True)
    print(f"this tree against {args.base}: {'all the same' if not differ else f'{differ} different'}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
