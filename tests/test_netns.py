"""Multinode across three network namespaces, each a "host" with its own 10.x address on a bridged veth pair.

This is the case where plain torchrun failed here: the endpoint's node did not recognise the address as its own,
and workers advertised an unreachable hostname. Traffic stays inside the namespaces this test makes.
"""

import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import read_summary

pytestmark = pytest.mark.slow
SUBNET = "10.77.{}.{}"


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def three_hosts():
    """Three "hosts": a network namespace each with its own 10.x address, joined by a bridge that lives in a
    fourth namespace of this test's own (so no traffic ever touches the machine's own interfaces)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = os.getpid() % 200 + 20
    switch = f"ddpa{tag}s"
    names = [f"ddpa{tag}{letter}" for letter in "abc"]
    if ip("netns", "add", switch).returncode != 0:
        pytest.skip("cannot create network namespaces here")
    try:
        def in_ns(ns: str, *command: str) -> None:
            result = ip("netns", "exec", ns, "ip", *command)
            assert result.returncode == 0, result.stderr

        in_ns(switch, "link", "add", "br0", "type", "bridge")
        in_ns(switch, "link", "set", "br0", "up")
        hosts = []
        for index, name in enumerate(names):
            assert ip("netns", "add", name).returncode == 0
            veth, peer = f"vddpa{tag}{'abc'[index]}", f"pddpa{tag}{'abc'[index]}"
            assert ip("link", "add", veth, "type", "veth", "peer", "name", peer).returncode == 0
            assert ip("link", "set", veth, "netns", name).returncode == 0
            assert ip("link", "set", peer, "netns", switch).returncode == 0
            in_ns(switch, "link", "set", peer, "master", "br0")
            in_ns(switch, "link", "set", peer, "up")
            address = SUBNET.format(tag, index + 1)
            for command in (["addr", "add", f"{address}/24", "dev", veth], ["link", "set", veth, "up"],
                            ["link", "set", "lo", "up"]):
                in_ns(name, *command)
            hosts.append((name, address))
        yield hosts
    finally:
        for name in [*names, switch]:
            ip("netns", "del", name)  # removes the veth ends inside it too


def test_three_namespaces_train_together(three_hosts, tmp_path):
    (host_ns, host_addr), *_ = three_hosts
    port = 29400
    jobs = []
    started = time.monotonic()
    for index, (ns, _) in enumerate(three_hosts):
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "3",
                   "--nproc-per-node", "1", "--endpoint", f"{host_addr}:{port}", "--device", "cpu",
                   "--steps", "20", "--rdzv-timeout", "60", "--run-dir", str(tmp_path / f"node{index}")]
        jobs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [job.communicate(timeout=240) for job in jobs]
    elapsed = time.monotonic() - started
    for job, (out, err) in zip(jobs, outputs):
        assert job.returncode == 0, out + err
    host_command = outputs[0][1]  # the torchrun command line is shown on stderr
    assert "is_host=1" in host_command and "--local-addr 10.77." in host_command
    assert "GLOO_SOCKET_IFNAME=vddpa" in host_command
    assert all("is_host=0" in err for _, err in outputs[1:])
    weights = [(tmp_path / f"node{index}" / "model.pt").read_bytes() for index in range(3)]
    assert [read_summary(tmp_path / f"node{index}")["world_size"] for index in range(3)] == [3, 3, 3]
    assert weights[0] == weights[1] == weights[2]
    print(f"3-namespace multinode wall time: {elapsed:.1f}s")
