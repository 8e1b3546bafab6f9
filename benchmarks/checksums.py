"""What the checkpoint checksums cost, on this machine, in one process: interleaved rounds, medians.

    .venv/bin/python benchmarks/checksums.py [--mib 400] [--repeats 5]

1. The candidates' speed on one thread over one buffer (GB/s), beside the speed of writing and fsyncing the same
   bytes to the run directory's disk: what the algorithm was chosen by.
2. A synchronous save of a checkpoint of --mib MiB (checkpoint.storage.save_checkpoint), with its checksum and
   without (checksum=False: the code before checksums), and a resume's load of it (load_checkpoint, verified and
   not): the ratios, which should be at most 1.10.
3. The asynchronous checkpoint's blocking time (what the training thread waits: the gather, the copy to host
   memory) with the write's checksum and without, on a real one-rank gloo group: the ratio should sit at 1.00.
"""

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddp_amp.checkpoint import storage  # noqa: E402


def gbps(seconds: float, size: int) -> float:
    return size / seconds / 1e9


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def write_and_fsync(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def algorithms(data: bytes, scratch: Path, repeats: int) -> None:
    candidates = {"zlib.crc32": lambda: zlib.crc32(data), "zlib.adler32": lambda: zlib.adler32(data),
                  "hashlib.md5": lambda: hashlib.md5(data).digest(),
                  "hashlib.sha256": lambda: hashlib.sha256(data).digest(),
                  "hashlib.blake2b": lambda: hashlib.blake2b(data).digest(),
                  "write + fsync": lambda: write_and_fsync(scratch / "written", data)}
    seconds: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, action in candidates.items():  # interleaved: drift hits each alike
            seconds[name].append(timed(action))
    print(f"1. one thread over {len(data) >> 20} MiB, GB/s (median of {repeats}):")
    for name, values in seconds.items():
        print(f"   {name:<16} {gbps(statistics.median(values), len(data)):6.2f}")


def state_of(mib: int) -> dict:
    weights = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(mib // 4)}  # 4 MiB each
    return {"step": 1, "trainer": {"model": weights, "optimizer": {}}, "rng": [], "world_size": 1,
            "config": {"launch_time": 1.0}, "saved_at": 1.0}


def save_and_load(mib: int, scratch: Path, repeats: int) -> None:
    state = state_of(mib)
    saves = {True: [], False: []}
    loads = {True: [], False: []}
    for _ in range(repeats):
        for checksum in (True, False):
            run_dir = scratch / f"run-{checksum}"
            started = time.perf_counter()
            path = storage.save_checkpoint(run_dir, state, keep=1, checksum=checksum)
            saves[checksum].append(time.perf_counter() - started)
            started = time.perf_counter()
            storage.load_checkpoint(path, verify=checksum)
            loads[checksum].append(time.perf_counter() - started)
    print(f"2. a {mib} MiB checkpoint, seconds (median of {repeats}):")
    for name, figures in (("synchronous save", saves), ("resume's load", loads)):
        with_sum, without = statistics.median(figures[True]), statistics.median(figures[False])
        ratios = [a / b for a, b in zip(figures[True], figures[False])]
        print(f"   {name:<17} with checksum {with_sum:.3f}  without {without:.3f}  ratio "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")


def async_blocking(mib: int, scratch: Path, repeats: int) -> None:
    import functools

    import torch.distributed as dist

    from ddp_amp.checkpoint.manager import CheckpointManager
    from ddp_amp.config import TrainConfig
    from ddp_amp.dist import DistEnv
    from ddp_amp.parallel import strategy_for
    from ddp_amp.train.data import RankData
    from ddp_amp.train.parts import NamedParts

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    env = DistEnv(0, 0, 1, 1, "127.0.0.1", 0)
    cpu = torch.device("cpu")
    module = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(mib // 4)))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    data = RankData(torch.arange(64), env, cpu, batch_size=4, seed=0, workers=0)
    parts = NamedParts(strategy_for(TrainConfig(), cpu), torch.amp.GradScaler("cpu", enabled=False),
                       {"model": module}, {"optimizer": (module, optimizer)}, {"data": data})
    original = storage.save_checkpoint
    blocked = {True: [], False: []}
    for round_ in range(repeats):
        for checksum in (True, False):
            storage.save_checkpoint = functools.partial(original, checksum=checksum)
            manager = CheckpointManager(TrainConfig(launch_time=1.0, keep=1), env, scratch / f"async-{checksum}", cpu)
            manager.save(parts, round_ + 1)
            manager.close()  # the write done before the next: the blocked time alone, no wait for a previous write
            blocked[checksum].append(manager.blocked_s[-1])
    storage.save_checkpoint = original
    ratios = [a / b for a, b in zip(blocked[True], blocked[False])]
    print(f"3. asynchronous save of a {mib} MiB model, seconds the loop was blocked (median of {repeats}): with "
          f"checksum {statistics.median(blocked[True]):.3f}  without {statistics.median(blocked[False]):.3f}  "
          f"ratio {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        scratch = Path(tmp)
        algorithms(os.urandom(256 << 20), scratch, args.repeats)
        save_and_load(args.mib, scratch, args.repeats)
        async_blocking(args.mib, scratch, args.repeats)


if __name__ == "__main__":
    main()
