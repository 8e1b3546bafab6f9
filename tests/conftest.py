"""pytest's hooks and the shared fixtures; what tests import by name is in helpers.py."""

import atexit
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from helpers import HELPER_TASKS, TESTS, LongRun

TIERS = {"unit": (), "system": ("slow",), "cluster": ("slow",)}
"""The folder a test sits in is its tier; a system or cluster test starts real ranks and is also `slow`, so
`-m "not slow"` and `tests/unit` select the same tests. A file marks itself `serial` where its tests must run
alone: `make test` runs those first, then the rest on two pytest workers."""


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection, which reads these marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = item.path.resolve().relative_to(TESTS).parts[0]
        assert tier in TIERS, f"{item.nodeid}: a test belongs in one of the tiers' folders: {', '.join(TIERS)}"
        for mark in (tier, *TIERS[tier]):
            item.add_marker(mark)
    # The longest files first, so that two workers taking a file at a time do not end with one of them alone on
    # a long file: the tiers from the slowest (cluster, system) to the fastest (unit), and within a tier the
    # larger files first (more launches). A file's tests keep their order; every worker sorts alike.
    tier_rank = {"cluster": 0, "system": 1, "unit": 2}
    position = {item: index for index, item in enumerate(items)}
    items.sort(key=lambda item: (tier_rank[item.path.resolve().relative_to(TESTS).parts[0]],
                                 -item.path.stat().st_size, str(item.path), position[item]))

# --amp auto's measured answers go to a cache of this test session's own, not the user's ~/.cache: every run of
# one task at one thread count in the session then trains in the same precision.
os.environ["DDP_AMP_CACHE_DIR"] = tempfile.mkdtemp(prefix="ddp-amp-test-cache-")
atexit.register(shutil.rmtree, os.environ["DDP_AMP_CACHE_DIR"], ignore_errors=True)  # each process its own


@pytest.fixture(autouse=True)
def nothing_launches_in_the_unit_tier(request, monkeypatch):
    """The unit tier starts no rank and no fork server: a command run in-process that gets past its checks fails
    its test here, where it would otherwise launch (and a refusal test would pass, slowly, for the wrong reason)."""
    if request.node.get_closest_marker("unit") is None:
        return

    def launched(*args, **kwargs):
        raise AssertionError("a unit test reached a launch: refusals are tested before it, launches in tests/system")

    monkeypatch.setattr("ddp_amp.launch.forkserver.start_forkserver", lambda: None)
    monkeypatch.setattr("ddp_amp.launch.session.run_launch", launched)


@pytest.fixture
def helper_task():
    """`--task` spec of a factory in tests/tasks/helper_tasks.py."""
    return lambda name: f"{HELPER_TASKS}:{name}"


@pytest.fixture
def long_run(tmp_path):
    """Starts LongRuns; whatever they leave running is killed at the end, so a failing test leaks nothing."""
    runs = []

    def start(command: str, run_dir: Path | None = None, **options) -> LongRun:
        runs.append(LongRun(command, run_dir or tmp_path, **options))
        return runs[-1]

    yield start
    for run in runs:
        for pid in run.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def one_rank_group(monkeypatch):
    """A real gloo process group of one rank in this process (the environment contract as spawn sets it): for
    in-process tests of what runs inside a rank. Its DistEnv."""
    import torch
    from torch.distributed import TCPStore

    from ddp_amp.dist import DistEnv, process_group
    from ddp_amp.launch.spawn import rank_environment

    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    for key, value in rank_environment(0, 1, store.port).items():
        monkeypatch.setenv(key, value)
    env = DistEnv.from_environ()
    with process_group(env, torch.device("cpu")):
        yield env

