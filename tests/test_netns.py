"""Multinode across two network namespaces, each a "host" with its own 10.x address on a veth pair.

This is the case where plain torchrun failed here: the endpoint's node did not recognise the address as its own,
and workers advertised an unreachable hostname. Traffic stays inside the two namespaces this test makes.
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
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = os.getpid() % 200 + 20
    names = [f"ddpa{tag}a", f"ddpa{tag}b"]
    veths = [f"vddpa{tag}a", f"vddpa{tag}b"]
    if ip("netns", "add", names[0]).returncode != 0:
        pytest.skip("cannot create network namespaces here")
    try:
        ip("netns", "add", names[1])
        assert ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1]).returncode == 0
        addresses = []
        for index, (name, veth) in enumerate(zip(names, veths)):
            address = SUBNET.format(tag, index + 1)
            addresses.append(address)
            assert ip("link", "set", veth, "netns", name).returncode == 0
            for command in (["addr", "add", f"{address}/24", "dev", veth], ["link", "set", veth, "up"],
                            ["link", "set", "lo", "up"]):
                result = ip("netns", "exec", name, "ip", *command)
                assert result.returncode == 0, result.stderr
        yield list(zip(names, addresses))
    finally:
        for name in names:
            ip("netns", "del", name)  # removes the veth ends inside it too


def test_two_namespaces_train_together(two_hosts, tmp_path):
    (host_ns, host_addr), (other_ns, _) = two_hosts
    port = 29400
    jobs = []
    started = time.monotonic()
    for name, ns in (("host", host_ns), ("other", other_ns)):
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "2",
                   "--nproc-per-node", "1", "--endpoint", f"{host_addr}:{port}", "--device", "cpu",
                   "--steps", "20", "--rdzv-timeout", "60", "--run-dir", str(tmp_path / name)]
        jobs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [job.communicate(timeout=240) for job in jobs]
    elapsed = time.monotonic() - started
    for job, (out, err) in zip(jobs, outputs):
        assert job.returncode == 0, out + err
    host_command = outputs[0][1]  # the torchrun command line is shown on stderr
    assert "is_host=1" in host_command and "--local-addr 10.77." in host_command
    assert "GLOO_SOCKET_IFNAME=vddpa" in host_command
    assert "is_host=0" in outputs[1][1]
    assert read_summary(tmp_path / "host")["world_size"] == read_summary(tmp_path / "other")["world_size"] == 2
    assert (tmp_path / "host" / "model.pt").read_bytes() == (tmp_path / "other" / "model.pt").read_bytes()
    print(f"2-namespace multinode wall time: {elapsed:.1f}s")
