"""Multinode across three network namespaces, each a "host" with its own 10.x address on a bridged veth pair.

This is the case where plain torchrun failed here: the endpoint's node did not recognise the address as its own,
and workers advertised an unreachable hostname. Traffic stays inside the namespaces this test makes.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CHECKS_SCRIPT, HELPER_TASKS, read_summary

from helper_tasks import HOLD_AT_CALL

pytestmark = [pytest.mark.slow]
# serial (three tests, run alone): doctor's verdicts compare the namespaces' CPU speeds (one under a CPU quota),
# which another test's load would blur; a node that arrives later joins on rendezvous deadlines, which another
# test's load could decide; a node cut off from the network waits out a collective timeout and then the agent
# watch's bound, both stretched by another test's load (its hang guard dumps the ranks' stacks into their logs,
# which found a failed rank's hang at exit, dist.process_group). The others train across the namespaces with generous
# deadlines, beside other tests (each test's namespaces are its own: their names carry the worker's pid).
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
    # A tag of this test's own: one a killed run left behind (its namespaces still there) is passed over.
    for tag in [os.getpid() % 200 + 20 + step for step in range(0, 200, 37)]:
        switch = f"ddpa{tag % 200 + 20}s"
        if ip("netns", "add", switch).returncode == 0:
            tag = tag % 200 + 20
            break
    else:
        pytest.skip("cannot create network namespaces here")
    names = [f"ddpa{tag}{letter}" for letter in "abc"]
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


@pytest.mark.serial
def test_a_node_that_arrives_later_joins_an_elastic_job_at_a_restart(three_hosts, tmp_path):
    """--nnodes 2:3: two nodes start and train with world size 2 (their task holds at a step until the world has
    three ranks, or its agent's SIGTERM asks it to stop); the third node's arrival makes torchrun restart the
    workers with world size 3. The ranks stop at one step with a checkpoint; they continue from it, which the
    newcomer (its own run dir, no shared file system) receives from the others, and all three finish with the
    same weights."""
    (_, host_addr), *_ = three_hosts
    # Enough steps that the stop agreement's next poll, which the ranks scheduled at their pace before the hold
    # (up to POLL_S of steps ahead), comes before the end.
    checkpoint_every, steps = 10, 400
    last_before_hold = (HOLD_AT_CALL - 1) // checkpoint_every * checkpoint_every
    run_dirs = [tmp_path / f"node{index}" for index in range(3)]

    def start(index: int) -> subprocess.Popen:
        ns = three_hosts[index][0]
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "2:3",
                   "--nproc-per-node", "1", "--endpoint", f"{host_addr}:29400", "--device", "cpu",
                   "--task", f"{HELPER_TASKS}:waits_for_a_third_node", "--steps", str(steps), "--log-every", "5",
                   "--checkpoint-every", str(checkpoint_every), "--rdzv-last-call", "1", "--rdzv-timeout", "120",
                   "--log-format", "plain", "--run-dir", str(run_dirs[index])]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    jobs = [start(0), start(1)]
    try:
        held = run_dirs[0] / "checkpoints" / f"step-{last_before_hold}.pt"
        deadline = time.monotonic() + 180
        while not held.exists():  # the two-node job has trained up to its hold
            assert time.monotonic() < deadline and all(job.poll() is None for job in jobs), "no checkpoint"
            time.sleep(0.2)
        jobs.append(start(2))
        outputs = [job.communicate(timeout=240) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    for job, (out, err) in zip(jobs, outputs):
        assert job.returncode == 0, out + err
    assert "(world size 2)" in outputs[0][0] and "(world size 3)" in outputs[0][0]
    summaries = [read_summary(run_dir) for run_dir in run_dirs]
    assert [s["world_size"] for s in summaries] == [3, 3, 3]
    stopped = {s["resumed_from_step"] for s in summaries}
    assert len(stopped) == 1 and HOLD_AT_CALL <= (stop_step := stopped.pop()) < steps  # the step they stopped at
    assert [s["restarts"] for s in summaries] == [0, 0, 0]  # a membership change is not a failure
    assert not (run_dirs[2] / "checkpoints" / f"step-{stop_step}.pt").exists()  # it was sent, not read
    weights = [(run_dir / "model.pt").read_bytes() for run_dir in run_dirs]
    assert weights[0] == weights[1] == weights[2]
    steps_logged = [json.loads(line)["step"] for line in (run_dirs[0] / "metrics.jsonl").read_text().splitlines()]
    assert steps_logged == list(range(5, steps + 1, 5))  # the steps before the change kept once, none twice


def tc(ns: str, *args: str) -> None:
    result = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def cpu_quota():
    """`prefix(share)`: a command prefix that runs a command under a cgroup (v1 cpu controller) capped at `share`
    of one CPU, as a node whose cores another job uses; the groups are removed after the test."""
    root = "/sys/fs/cgroup/cpu"
    if not os.access(root, os.W_OK):
        pytest.skip("no writable cgroup cpu controller")
    made = []

    def prefix(share: float) -> list[str]:
        group = f"{root}/ddpa{os.getpid()}-{len(made)}"
        os.mkdir(group)
        made.append(group)
        with open(f"{group}/cpu.cfs_period_us", "w") as period:
            period.write("100000")
        with open(f"{group}/cpu.cfs_quota_us", "w") as quota:
            quota.write(str(int(share * 100000)))
        return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"]

    yield prefix
    for group in made:
        deadline = time.monotonic() + 20
        while True:  # its processes have exited, or are about to (the fork server dies with its launcher)
            try:
                os.rmdir(group)
                break
            except OSError:
                assert time.monotonic() < deadline, f"{group} still has processes"
                time.sleep(0.2)


@pytest.mark.serial
def test_doctor_names_the_slow_node_link_and_the_slow_rank(three_hosts, cpu_quota, tmp_path):
    """Three namespaces run `doctor --nnodes 3`. The third one's veth sends at most 400 Mbit/s (a real kernel
    queueing discipline, tbf; the veths carry several Gbit/s otherwise); the second one runs under a CPU quota of
    half a core (a cgroup). Each node's report names the third node, by its address, for its sends and no other
    node's link, and the second node's rank for its compute; --strict makes that exit 1 on every node."""
    if shutil.which("tc") is None:
        pytest.skip("iproute2's `tc` is not installed")
    (_, host_addr), (busy_ns, busy_addr), (slow_ns, slow_addr) = three_hosts
    # Each namespace's end of its veth pair is named after it (see three_hosts).
    tc(slow_ns, "qdisc", "add", "dev", f"v{slow_ns}", "root", "tbf", "rate", "400mbit", "burst", "64kb",
       "latency", "50ms")
    jobs = []
    for index, (ns, _) in enumerate(three_hosts):
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "ddp_amp", "doctor", "--nnodes", "3",
                   "--endpoint", f"{host_addr}:29400", "--device", "cpu", "--rdzv-timeout", "60", "--strict",
                   "--run-dir", str(tmp_path / f"node{index}"), "--json", str(tmp_path / f"node{index}.json")]
        if ns == busy_ns:  # joined outside the namespace: `ip netns exec` mounts a /sys of its own
            command = cpu_quota(0.5) + command
        jobs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [job.communicate(timeout=240) for job in jobs]
    reports = [json.loads((tmp_path / f"node{index}.json").read_text()) for index in range(3)]
    for job, (out, err), report in zip(jobs, outputs, reports):
        assert job.returncode == 1, out + err  # --strict: an outlier fails the check
        judgement = report["judgement"]
        nodes = {figures["address"]: int(node) for node, figures in judgement["nodes"].items()}
        assert sorted(nodes) == sorted(address for _, address in three_hosts)
        assert judgement["slow_nodes"] == [nodes[slow_addr]], out
        warning = next(w for w in judgement["warnings"] if w.startswith("slow link"))
        # Its sends are slow; its round trip may be too (tbf queues what exceeds the rate, up to 50 ms): one node.
        assert f"node {nodes[slow_addr]} ({slow_addr}): " in warning and warning.count("node ") == 1
        assert "sends at" in warning.split(f"({slow_addr}): ")[1]
        assert judgement["slow_ranks"] == [r["rank"] for r in report["ranks"] if r["address"] == busy_addr], out
        assert "doctor --strict: " in err and "slow link" in err and "slow compute" in err
    print(outputs[0][0])


POD_TRAINING = ["--device", "cpu", "--task", f"{HELPER_TASKS}:resumable", "--steps", "120", "--batch-size", "8",
                "--checkpoint-every", "1000", "--log-every", "10", "--log-format", "plain"]


def _pod_commands(kind: str, manifest: dict, claim: Path, nodes: int) -> tuple[list, list[str]]:
    """Each pod's (command, environment) as its kind's controller and the kubelet would give them, and each pod's
    hostname (what its service resolves). The container's command runs as `python -m ddp_amp`, with the claim's
    mount point replaced by a directory every "pod" shares."""
    name = manifest["metadata"]["name"]
    if kind == "pytorchjob":
        replicas = manifest["spec"]["pytorchReplicaSpecs"]
        containers = [replicas["Master"]["template"]["spec"]["containers"][0],
                      *[replicas["Worker"]["template"]["spec"]["containers"][0]] * (nodes - 1)]
        hostnames = [f"{name}-master-0", *[f"{name}-worker-{i}" for i in range(nodes - 1)]]
        # The Training Operator's env: the master's service, the pods' count and this pod's rank.
        injected = [{"MASTER_ADDR": hostnames[0], "MASTER_PORT": "23456", "WORLD_SIZE": str(nodes), "RANK": str(i)}
                    for i in range(nodes)]
        mounts = [c["volumeMounts"][0]["mountPath"] for c in containers]
        commands, envs = [c["command"] for c in containers], [c["env"] for c in containers]
    else:
        hostnames = [f"{name}-node-0-{i}.{name}" for i in range(nodes)]  # <jobset>-<job>-<job index>-<pod index>
        if kind == "jobset":
            pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            container = pod["containers"][0]
            command, env, mount = container["command"], container["env"], container["volumeMounts"][0]["mountPath"]
            injected = [{"JOB_COMPLETION_INDEX": str(i)} for i in range(nodes)]
        else:  # trainjob: the torch runtime injects PET_*
            trainer = manifest["spec"]["trainer"]
            patch = manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
            pod = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            command, env = trainer["command"], trainer["env"]
            mount = pod["containers"][0]["volumeMounts"][0]["mountPath"]
            injected = [{"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
                         "PET_NODE_RANK": str(i),
                         "PET_MASTER_ADDR": hostnames[0], "PET_MASTER_PORT": "29400"} for i in range(nodes)]
        commands, envs, mounts = [command] * nodes, [env] * nodes, [mount] * nodes
    pods = []
    for index in range(nodes):
        # A valueFrom is the completion index (the only one the manifests use), resolved as the kubelet would.
        env = {e["name"]: e["value"] if "value" in e else str(index) for e in envs[index]}
        command = [sys.executable, "-m", "ddp_amp",
                   *[part.replace(mounts[index], str(claim)) for part in commands[index][1:]]]
        pods.append((command, {**env, **injected[index]}))
    return pods, hostnames


class _Pods:
    """The "pods" of one manifest in the test's namespaces: each its own network namespace (the hostnames in
    /etc/netns/<ns>/hosts, which `ip netns exec` mounts over /etc/hosts) and its own pid namespace, in which
    ddp-amp is PID 1 as in a container."""

    def __init__(self, kind: str, hosts, tmp_path: Path, *extra: str) -> None:
        import yaml

        self.kind, self.hosts, self.folders = kind, hosts, []
        path = tmp_path / f"{kind}.yaml"
        emitted = subprocess.run([sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", str(len(hosts)),
                                  *POD_TRAINING, *extra, "--emit-k8s", str(path), "--k8s-kind", kind, "--image",
                                  "ddp-amp:test", "--pvc", "claim", "--run-dir", "k8s"],
                                 capture_output=True, text=True, timeout=60)
        assert emitted.returncode == 0, emitted.stderr
        self.manifest = yaml.safe_load(path.read_text())

    def __enter__(self) -> "_Pods":
        _, hostnames = _pod_commands(self.kind, self.manifest, Path("/"), len(self.hosts))
        lines = "".join(f"{address} {hostname} {hostname.split('.')[0]}\n"
                        for (_, address), hostname in zip(self.hosts, hostnames))
        for ns, _ in self.hosts:
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("127.0.0.1 localhost\n" + lines)
            self.folders.append(folder)
        return self

    def __exit__(self, *exc: object) -> None:
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)

    def start(self, claim: Path, extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
        pods, _ = _pod_commands(self.kind, self.manifest, claim, len(self.hosts))
        return [subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--pid", "--fork", "--mount-proc",
                                  "--kill-child", *command], env={**os.environ, **env, **(extra_env or {})},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
                for (ns, _), (command, env) in zip(self.hosts, pods)]

    @staticmethod
    def finish(pods: list[subprocess.Popen]) -> list[tuple[str, str]]:
        try:
            return [pod.communicate(timeout=240) for pod in pods]
        finally:
            for pod in pods:
                if pod.poll() is None:
                    os.killpg(pod.pid, 9)

    @staticmethod
    def pid_1(pod: subprocess.Popen) -> int:
        """The host's pid of the pod's PID 1 (unshare's one child), to signal it as the kubelet does."""
        children = Path(f"/proc/{pod.pid}/task/{pod.pid}/children").read_text().split()
        assert len(children) == 1, children
        with open(f"/proc/{children[0]}/status") as f:
            assert [line.split()[-1] for line in f if line.startswith("NSpid:")] == ["1"]
        return int(children[0])


def _spawned(tmp_path: Path) -> Path:
    reference = tmp_path / "spawn"
    spawned = subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", *POD_TRAINING, "--run-dir",
                              str(reference)], capture_output=True, text=True, timeout=240)
    assert spawned.returncode == 0, spawned.stderr
    return reference


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_kubernetes_pods_of_each_kind_train_like_spawn(three_hosts, tmp_path, kind):
    """The TrainJob's and the PyTorchJob's pods, with the rendezvous each kind's controller injects (PET_*;
    MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK) and its hostnames: spawn's weights, bit for bit."""
    reference = _spawned(tmp_path)
    with _Pods(kind, three_hosts[:2], tmp_path) as pods:
        started = pods.start(tmp_path / "claim")
        for pod, (out, err) in zip(started, pods.finish(started)):
            assert pod.returncode == 0, out + err
    assert read_summary(tmp_path / "claim" / "k8s")["world_size"] == 2
    assert (tmp_path / "claim" / "k8s" / "model.pt").read_bytes() == (reference / "model.pt").read_bytes()


def test_kubernetes_pods_train_like_spawn_and_a_kubelet_sigterm_keeps_the_work(three_hosts, tmp_path):
    """Two "pods" of the emitted JobSet (see _Pods): they train to spawn's weights; SIGTERM to each pod's PID 1
    stops them at one step with a checkpoint on the shared claim; "restarted" pods resume to the uninterrupted
    weights, bit for bit."""
    reference = _spawned(tmp_path)
    with _Pods("jobset", three_hosts[:2], tmp_path, "--stop-timeout", "60") as pods:
        # Uninterrupted: the pods' weights are spawn's.
        started = pods.start(tmp_path / "whole")
        for pod, (out, err) in zip(started, pods.finish(started)):
            assert pod.returncode == 0, out + err
        run_dir = tmp_path / "whole" / "k8s"
        assert read_summary(run_dir)["world_size"] == 2
        assert (run_dir / "model.pt").read_bytes() == (reference / "model.pt").read_bytes()

        # Preempted: SIGTERM to each pod's PID 1 (ddp-amp itself) while they train, as the kubelet sends it.
        claim = tmp_path / "claim"
        started = pods.start(claim, {"DDP_AMP_TEST_STEP_SLEEP": "0.05"})
        metrics = claim / "k8s" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and all(p.poll() is None for p in started), "the pods never trained"
            time.sleep(0.1)
        for pod in started:
            os.kill(pods.pid_1(pod), 15)
        for pod, (out, err) in zip(started, pods.finish(started)):
            assert pod.returncode == 143, out + err  # unshare exits with its child's code
        stopped_at = read_summary(claim / "k8s")["stopped_at_step"]
        assert 20 <= stopped_at < 120 and (claim / "k8s" / "checkpoints" / f"step-{stopped_at}.pt").exists()
        # Restarted by the JobSet: the same commands; --from-env continues from the checkpoint on the claim.
        started = pods.start(claim)
        for pod, (out, err) in zip(started, pods.finish(started)):
            assert pod.returncode == 0, out + err
    resumed = read_summary(claim / "k8s")
    assert resumed["resumed_from_step"] == stopped_at and resumed["steps"] == 120
    assert (claim / "k8s" / "model.pt").read_bytes() == (reference / "model.pt").read_bytes()


def _finish_or_report(jobs: list[tuple[subprocess.Popen, Path]], timeout: float,
                      run_dirs: list[Path]) -> list[tuple[str, str]]:
    """Every job's (stdout, stderr), read from the files `_start_logged` gave it, once all have exited. Past
    `timeout`, what each job's process group still runs (command line and kernel wait channel) and the run dirs'
    rank logs go into the failure, and the groups are killed, so that a hang is explained and leaves nothing
    running."""
    deadline = time.monotonic() + timeout
    while any(job.poll() is None for job, _ in jobs) and time.monotonic() < deadline:
        time.sleep(0.2)
    hung = [job for job, _ in jobs if job.poll() is None]
    report, members = [], {}
    for job in hung:  # what each group runs, before anything is signalled
        members[job.pid] = subprocess.run(["pgrep", "-g", str(job.pid)], capture_output=True, text=True).stdout.split()
        for pid in members[job.pid]:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
                report.append(f"{pid} [{Path(f'/proc/{pid}/wchan').read_text()}] {command}")
            except OSError:
                pass
    # PYTHONFAULTHANDLER (_start_logged, inherited): every thread's stack to stderr, the ranks' into their logs,
    # all at once (one rank's end would have the launcher take the others down); the launcher's after them.
    for launcher, pids in members.items():
        for pid in [int(pid) for pid in pids if int(pid) != launcher] + [launcher]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(1)
    if hung:
        time.sleep(2)
    for job in hung:
        os.killpg(job.pid, 9)
    for job, _ in jobs:
        job.wait()
    outputs = [(prefix.with_suffix(".out").read_text(), prefix.with_suffix(".err").read_text())
               for _, prefix in jobs]
    if hung:
        logs = [f"--- {log}\n{log.read_text()[-2000:]}" for run_dir in run_dirs
                for log in sorted(run_dir.glob("logs/*.log"))]
        pytest.fail("\n".join([f"{len(hung)} launcher(s) still running after {timeout}s:", *report, *logs,
                               *(f"--- job {i} stdout\n{out[-3000:]}\n--- job {i} stderr\n{err[-8000:]}"
                                 for i, (out, err) in enumerate(outputs))]))
    return outputs


def _start_logged(command: list[str], prefix: Path, **env: str) -> tuple[subprocess.Popen, Path]:
    """`command` in a session of its own, its output in files (`prefix`.out/.err): no pipe to fill while the
    test waits on another job. `env`: variables set on top of this process's."""
    with open(prefix.with_suffix(".out"), "w") as out, open(prefix.with_suffix(".err"), "w") as err:
        return subprocess.Popen(command, stdout=out, stderr=err, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1", **env}), prefix


def test_a_users_script_runs_on_two_namespaces_in_one_process_group(three_hosts, tmp_path):
    """`ddp-amp multinode --nnodes 2 ... script_checks.py --steps 5` in two "hosts", the same command on each:
    exit 0 on both, each node's launcher shows its own rank's lines, and each all-reduce summed both ranks (one
    process group across the hosts). Not the origin example: its destroy_process_group() while its DDP model is
    alive hangs at exit about 1 run in 12 under load, under plain torchrun as well (docs/scripts.md); its
    weights are checked against torchrun's on one machine (tests/system/test_scripts.py)."""
    (_, host_addr), *_ = three_hosts
    run_dirs = [tmp_path / f"node{index}" for index in range(2)]
    jobs = []
    for index, (ns, _) in enumerate(three_hosts[:2]):
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "2",
                   "--nproc-per-node", "1", "--endpoint", f"{host_addr}:29400", "--rdzv-timeout", "60",
                   "--log-format", "plain", "--run-dir", str(run_dirs[index]), str(CHECKS_SCRIPT), "--steps", "5"]
        jobs.append(_start_logged(command, tmp_path / f"launcher{index}"))
    outputs = _finish_or_report(jobs, 240, run_dirs)
    for index, ((job, _), (out, err)) in enumerate(zip(jobs, outputs)):
        assert job.returncode == 0, out + err
        lines = [line for line in out.splitlines() if " step " in line]
        assert lines == [f"[rank {index}] rank {index} step {step} sum {2 * (step + 1)} restart 0"
                         for step in range(5)], out
        assert read_summary(run_dirs[index])["outcome"] == "finished"


def _group(pid: int) -> list[int]:
    """The processes of the process group `pid` leads (a launcher started in a session of its own)."""
    found = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(member) for member in found]


@pytest.mark.serial
def test_a_node_cut_off_from_the_network_ends_its_launcher_and_leaves_nothing_running(three_hosts, tmp_path):
    """Two namespaces train with `multinode --nnodes 2`; mid-run the second one's veth is deleted. Its rank fails
    (--timeout), but its elastic agent sits in a call to the rendezvous store on the first node, which the dead
    link keeps blocked until TCP gives up (~15 minutes: its launcher lived 938 s). Its launcher now gives up on
    the agent once that call outlasts the store's own read timeout: exit 1, one line naming the rank's failure
    and the store call, and nothing of it left running. The first node's ranks fail too (their peer vanished),
    which its agent, the store's host, sees: exit 1."""
    (_, host_addr), (cut_ns, _), _ = three_hosts
    run_dirs = [tmp_path / f"node{index}" for index in range(2)]
    jobs = []
    for index, (ns, _) in enumerate(three_hosts[:2]):
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "2",
                   "--nproc-per-node", "1", "--endpoint", f"{host_addr}:29400", "--device", "cpu", "--task",
                   f"{HELPER_TASKS}:resumable", "--steps", "100000", "--log-every", "10", "--timeout", "20",
                   "--rdzv-timeout", "60", "--log-format", "plain", "--run-dir", str(run_dirs[index])]
        jobs.append(_start_logged(command, tmp_path / f"launcher{index}", DDP_AMP_TEST_STEP_SLEEP="0.05"))
    try:
        deadline = time.monotonic() + 180
        while not all(prefix.with_suffix(".out").read_text().count(" step ") >= 1 for _, prefix in jobs):
            assert time.monotonic() < deadline and all(job.poll() is None for job, _ in jobs), "never trained"
            time.sleep(0.2)
        cut_off = jobs[1][0]
        processes = _group(cut_off.pid)  # the launcher, its fork server and resource tracker, the rank
        assert len(processes) >= 3, processes
        assert ip("-n", cut_ns, "link", "del", f"v{cut_ns}").returncode == 0
    except BaseException:
        for job, _ in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
        raise
    (_, host_err), (_, cut_err) = _finish_or_report(jobs, 300, run_dirs)  # a hang guard: it took ~15 minutes
    assert cut_off.returncode == 1, cut_err
    verdict = cut_err.strip().splitlines()[-1]
    # The rank's own error (gloo's timeout, --timeout), as its agent would have told it, then why it never did.
    assert verdict.startswith("ddp-amp: error: rank 1 failed: RuntimeError: "), verdict
    assert ("the elastic agent has not seen it: its call to the rendezvous store at "
            f"{host_addr}:29400 has not returned (the network between the nodes failed?)") in verdict
    deadline = time.monotonic() + 30  # the fork server's parent-death signal is delivered, not instant
    while (left := [pid for pid in processes if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left and not _group(cut_off.pid), left
    # The first node's rank times out too (its peer vanished); its agent hosts the store and sees it at once.
    assert jobs[0][0].returncode == 1, host_err
    assert "ddp-amp: error: rank 0 failed: RuntimeError: " in host_err, host_err
