"""multinode on Kubernetes: the manifests `--emit-k8s` writes (Kubeflow Trainer's TrainJob, Training Operator's
PyTorchJob, a plain JobSet), and `--from-env`, which reads the rendezvous each kind injects into its pods.

Every pod runs `ddp-amp multinode --from-env ...` as its container's command, so ddp-amp is the
pod's PID 1: the SIGTERM the kubelet sends at preemption or deletion stops every rank at one agreed step with a
checkpoint on the claim (terminationGracePeriodSeconds covers --stop-timeout), and a restarted pod resumes from
the newest one (--from-env takes up the run dir as a requeued Slurm job does: --resume auto).
No torch here: the CLI writes manifests without importing it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddp_amp.errors import UsageError

RUN_DIR_MOUNT = "/ddp-amp"
"""Where the claim (or, without --pvc, an emptyDir) is mounted in every pod; the run dir lies below it."""
RDZV_PORT = 29400
GRACE_MARGIN_S = 30
"""terminationGracePeriodSeconds beyond --stop-timeout: the launcher's own exit after its ranks stopped."""
TRAINJOB_RUNTIME = "torch-distributed"
TRAINJOB_CONTAINER = "node"
"""The torch runtime's replicated job and container: a TrainJob's overrides name them."""
PYTORCHJOB_CONTAINER = "pytorch"
"""The container name the Training Operator looks for in a PyTorchJob."""
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
QUANTITY = re.compile(r"\+?(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+|[mkMGTPE])?")
"""Kubernetes' resource quantity (its serialization grammar: a number, then a binary or decimal SI suffix or an
exponent), unsigned: a request is never negative."""
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
IMAGE_REFERENCE = re.compile(rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?"
                             r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")
"""An image reference as the container runtimes parse it (distribution's reference grammar): [registry/]path
[:tag][@digest], the path in lower case."""


@dataclass(frozen=True)
class PodSpec:
    """What every pod of the job gets, whatever the kind."""

    name: str
    image: str
    namespace: str
    nnodes_min: int
    nnodes_max: int
    nproc_per_node: str
    args: list[str]
    """ddp-amp multinode's training options (the same on every pod)."""
    run_dir: str
    pvc: str | None
    gpus_per_node: int | None
    cpu: str | None
    memory: str | None
    stop_timeout: float
    max_restarts: int
    script: list[str] = field(default_factory=list)
    """A user's script and its arguments (`-m MODULE ...` for a module), run by every pod's ranks: last on the
    command line, as ddp-amp takes it."""

    @property
    def elastic(self) -> bool:
        return self.nnodes_min != self.nnodes_max


def check_dns_name(value: str, flag: str) -> str:
    """A Kubernetes object name (RFC 1123 label: lower-case letters, digits and '-', at most 63)."""
    if len(value) > 63 or not DNS_1123_LABEL.fullmatch(value):
        raise UsageError(f"{flag} {value!r} is not a valid Kubernetes name (RFC 1123: lower-case letters, digits "
                         "and '-', starting and ending with a letter or digit, at most 63 characters)")
    return value


def check_quantity(value: str, flag: str) -> str:
    """A positive Kubernetes resource quantity: 500m, 2, 1.5, 4Gi, 512Mi, 1e3."""
    found = QUANTITY.fullmatch(value)
    if found is None or float(found["number"]) == 0:
        raise UsageError(f"{flag} {value!r} is not a positive Kubernetes quantity (a number with an optional suffix: "
                         "500m, 2, 1.5, 4Gi, 512Mi, 1e3)")
    return value


def check_image(value: str) -> str:
    if not IMAGE_REFERENCE.fullmatch(value):
        why = "it holds whitespace" if re.search(r"\s", value) else "expected [registry/]name[:tag][@digest], the " \
            "name in lower case"
        raise UsageError(f"--image {value!r} is not a container image reference: {why}")
    return value


def job_name(run_dir: str) -> str:
    """The job's name from its run directory's: ddp-amp-<name>, cut to a DNS label (room left for pod names)."""
    base = re.sub(r"[^a-z0-9-]+", "-", run_dir.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-") or "run"
    return f"ddp-amp-{base}"[:40].rstrip("-")


def pod_command(spec: PodSpec) -> list[str]:
    # --from-env also takes up the run dir as a restarted job should: from its newest checkpoint where there is one.
    return ["ddp-amp", "multinode", "--from-env", "--nproc-per-node", spec.nproc_per_node, *spec.args,
            "--run-dir", f"{RUN_DIR_MOUNT}/{spec.run_dir}", *spec.script]


def _volume(spec: PodSpec) -> dict[str, Any]:
    if spec.pvc is not None:
        return {"name": "run-dir", "persistentVolumeClaim": {"claimName": spec.pvc}}
    return {"name": "run-dir", "emptyDir": {}}


def _resources(spec: PodSpec) -> dict[str, Any]:
    requests = {key: value for key, value in (("cpu", spec.cpu), ("memory", spec.memory)) if value}
    resources: dict[str, Any] = {"requests": requests} if requests else {}
    if spec.gpus_per_node:
        resources["limits"] = {"nvidia.com/gpu": str(spec.gpus_per_node)}
    return resources


def _grace_s(spec: PodSpec) -> int:
    return int(spec.stop_timeout) + GRACE_MARGIN_S


def _container(spec: PodSpec, name: str, env: list[dict[str, Any]]) -> dict[str, Any]:
    container = {"name": name, "image": spec.image, "command": pod_command(spec),
                 "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}, *env],
                 "ports": [{"containerPort": RDZV_PORT, "name": "rendezvous"}],
                 "volumeMounts": [{"name": "run-dir", "mountPath": RUN_DIR_MOUNT}]}
    if resources := _resources(spec):
        container["resources"] = resources
    return container


def _metadata(spec: PodSpec) -> dict[str, Any]:
    return {"name": spec.name, "namespace": spec.namespace, "labels": {"app.kubernetes.io/managed-by": "ddp-amp"}}


def trainjob(spec: PodSpec) -> dict[str, Any]:
    """Kubeflow Trainer v2: the torch-distributed ClusterTrainingRuntime runs one pod per node and injects PET_*.
    Its JobSet's failure policy restarts every pod when one fails (the runtime's maxRestarts)."""
    pod_patch = {"terminationGracePeriodSeconds": _grace_s(spec), "volumes": [_volume(spec)],
                 "containers": [{"name": TRAINJOB_CONTAINER,
                                 "volumeMounts": [{"name": "run-dir", "mountPath": RUN_DIR_MOUNT}]}]}
    trainer: dict[str, Any] = {"image": spec.image, "command": pod_command(spec), "numNodes": spec.nnodes_max,
                               "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}]}
    if spec.nproc_per_node.isdigit():
        # The torch runtime's default is auto, injected as PET_NPROC_PER_NODE, which --from-env reads where
        # --nproc-per-node is left at 1: the same count in both places.
        trainer["numProcPerNode"] = int(spec.nproc_per_node)
    if resources := _resources(spec):
        trainer["resourcesPerNode"] = resources
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _metadata(spec),
            "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                    "name": TRAINJOB_RUNTIME},
                     "trainer": trainer,
                     "runtimePatches": [{"manager": "ddp-amp", "trainingRuntimeSpec": {"template": {"spec": {
                         "replicatedJobs": [{"name": TRAINJOB_CONTAINER, "template": {"spec": {"template": {
                             "spec": pod_patch}}}}]}}}}]}}


def pytorchjob(spec: PodSpec) -> dict[str, Any]:
    """Training Operator v1: Master + Workers (MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK), or, with --nnodes
    MIN:MAX, Workers under an elasticPolicy (PET_RDZV_ENDPOINT, PET_NNODES=MIN:MAX). A failed pod is restarted
    (OnFailure) and rejoins: every node's agent then restarts all ranks from the newest checkpoint."""
    def replicas(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": {
            "terminationGracePeriodSeconds": _grace_s(spec), "volumes": [_volume(spec)],
            "containers": [_container(spec, PYTORCHJOB_CONTAINER, [])]}}}

    body: dict[str, Any] = {"nprocPerNode": spec.nproc_per_node,
                            "runPolicy": {"backoffLimit": spec.max_restarts, "cleanPodPolicy": "None"}}
    if spec.elastic:
        body["elasticPolicy"] = {"minReplicas": spec.nnodes_min, "maxReplicas": spec.nnodes_max,
                                 "rdzvBackend": "c10d", "rdzvPort": RDZV_PORT, "maxRestarts": spec.max_restarts}
        body["pytorchReplicaSpecs"] = {"Worker": replicas(spec.nnodes_max)}
    else:
        body["pytorchReplicaSpecs"] = {"Master": replicas(1)}
        if spec.nnodes_max > 1:
            body["pytorchReplicaSpecs"]["Worker"] = replicas(spec.nnodes_max - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(spec), "spec": body}


def jobset(spec: PodSpec) -> dict[str, Any]:
    """A JobSet for clusters without Kubeflow: one Indexed Job of --nnodes pods behind a headless service; each
    pod's node rank is its completion index, and node 0's DNS name is the rendezvous. The failure policy
    recreates every pod when one fails, up to --max-restarts times."""
    master = f"{spec.name}-node-0-0.{spec.name}"  # <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>
    env = [{"name": "PET_NNODES", "value": str(spec.nnodes_max)},
           {"name": "PET_NPROC_PER_NODE", "value": spec.nproc_per_node},
           {"name": "PET_MASTER_ADDR", "value": master}, {"name": "PET_MASTER_PORT", "value": str(RDZV_PORT)},
           {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
               "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}]
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": _grace_s(spec), "volumes": [_volume(spec)],
           "containers": [_container(spec, "node", env)]}
    job = {"parallelism": spec.nnodes_max, "completions": spec.nnodes_max, "completionMode": "Indexed",
           "backoffLimit": 0, "template": {"spec": pod}}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _metadata(spec),
            "spec": {"failurePolicy": {"maxRestarts": spec.max_restarts},
                     "network": {"enableDNSHostnames": True, "subdomain": spec.name},
                     "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job}}]}}


BUILDERS = {"trainjob": trainjob, "pytorchjob": pytorchjob, "jobset": jobset}


def manifest(kind: str, spec: PodSpec) -> dict[str, Any]:
    return BUILDERS[kind](spec)


@dataclass(frozen=True)
class Rendezvous:
    """What --from-env read: the values of --nnodes, --endpoint, --node-rank and --nproc-per-node."""

    nnodes: str
    endpoint: str
    node_rank: int | None
    nproc_per_node: str | None
    source: str


def rendezvous_from_env(environ: Mapping[str, str]) -> Rendezvous:
    """The rendezvous a pod's controller injected: Kubeflow Trainer's torch runtime (PET_NNODES,
    PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT), a PyTorchJob (MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE = pods, RANK = this pod; elastic: PET_RDZV_ENDPOINT and PET_NNODES=MIN:MAX), or
    this tool's JobSet (PET_* from its own manifest; JOB_COMPLETION_INDEX as the node rank otherwise)."""
    def get(*names: str) -> tuple[str, str] | None:
        for name in names:
            if environ.get(name):
                return name, environ[name]
        return None

    nnodes = get("PET_NNODES", "WORLD_SIZE")
    if nnodes is None:
        raise UsageError("--from-env: neither PET_NNODES nor WORLD_SIZE is set (a TrainJob, PyTorchJob or "
                         "ddp-amp's JobSet sets them); pass --nnodes and --endpoint instead")
    endpoint = get("PET_RDZV_ENDPOINT")
    if endpoint is None:
        host, port = get("PET_MASTER_ADDR", "MASTER_ADDR"), get("PET_MASTER_PORT", "MASTER_PORT")
        if host is None:
            raise UsageError("--from-env: none of PET_RDZV_ENDPOINT, PET_MASTER_ADDR, MASTER_ADDR is set")
        endpoint = (host[0], f"{host[1]}:{port[1] if port else RDZV_PORT}")
    elastic = ":" in nnodes[1]
    rank = None if elastic else get("PET_NODE_RANK", "RANK", "JOB_COMPLETION_INDEX")
    node_rank = None
    if rank is not None:
        try:
            node_rank = int(rank[1])
        except ValueError:
            raise UsageError(f"--from-env: {rank[0]}={rank[1]!r} is not a node rank") from None
    nproc = get("PET_NPROC_PER_NODE")
    names = [nnodes[0], endpoint[0], *([rank[0]] if rank else []), *([nproc[0]] if nproc else [])]
    return Rendezvous(nnodes=nnodes[1], endpoint=endpoint[1], node_rank=node_rank,
                      nproc_per_node=nproc[1] if nproc else None, source=", ".join(names))


def manifest_text(k8s: dict, shared_args: list[str], nodes, *, device: str, run_dir: str | None,
                  nproc_per_node: str, max_restarts: int, stop_timeout: float, script: list[str]) -> str:
    """--emit-k8s's YAML for this multinode command (`k8s`: the Kubernetes options; `shared_args`: the options every
    pod passes), its options checked first (UsageError)."""
    if not k8s["image"]:
        raise UsageError("--emit-k8s needs --image: the container image the pods run (with ddp-amp installed)")
    check_image(k8s["image"])
    check_dns_name(k8s["namespace"], "--namespace")
    for flag in ("cpu", "memory"):
        if k8s[flag] is not None:
            check_quantity(k8s[flag], f"--{flag}")
    if k8s["pvc"] is not None:
        check_dns_name(k8s["pvc"], "--pvc")
    gpus = k8s["gpus_per_node"]
    if gpus is not None and (gpus < 1 or device == "cpu"):
        raise UsageError(f"--gpus-per-node {gpus}: " + ("must be >= 1" if gpus < 1 else
                         "--device cpu trains on CPUs; drop --gpus-per-node, or use --device cuda or auto"))
    if nproc_per_node == "1" and gpus:
        nproc_per_node = str(gpus)  # a rank per GPU, as --nproc-per-node gpu would
    if gpus and (nproc_per_node == "cpu" or nproc_per_node.isdigit() and int(nproc_per_node) > gpus):
        ranks = "a rank per core" if nproc_per_node == "cpu" else f"{nproc_per_node} ranks"
        raise UsageError(f"--nproc-per-node {nproc_per_node} starts {ranks} on each pod, more than its --gpus-per-node "
                         f"{gpus} GPUs (a rank per GPU): pass --nproc-per-node {gpus} or gpu, or more --gpus-per-node")
    run_dir = (run_dir or "run").strip("/")
    spec = PodSpec(name=job_name(run_dir), image=k8s["image"], namespace=k8s["namespace"], nnodes_min=nodes.min,
                   nnodes_max=nodes.max, nproc_per_node=nproc_per_node, args=shared_args, run_dir=run_dir,
                   pvc=k8s["pvc"], gpus_per_node=gpus, cpu=k8s["cpu"], memory=k8s["memory"],
                   stop_timeout=stop_timeout, max_restarts=max_restarts, script=script)
    import yaml

    return yaml.safe_dump(manifest(k8s["k8s_kind"], spec), sort_keys=False)



def emit_manifest(k8s: dict, shared_args: list[str], nodes, *, device: str, run_dir: str | None,
                  nproc_per_node: str, max_restarts: int, stop_timeout: float, script=None) -> None:
    """--emit-k8s: the manifest (TrainJob, PyTorchJob or JobSet) that runs this on --nnodes pods; printed, then
    written as YAML."""
    from ddp_amp.files import write_new_file

    text = manifest_text(k8s, shared_args, nodes, device=device, run_dir=run_dir, nproc_per_node=nproc_per_node,
                         max_restarts=max_restarts, stop_timeout=stop_timeout,
                         script=script.argv() if script is not None else [])
    write_new_file(k8s["emit_k8s"], text, "--emit-k8s")  # first: a path it cannot be written to prints nothing
    print(text, end="")

    def say(line: str) -> None:
        print(line, file=sys.stderr)

    if k8s["pvc"] is None:
        say("ddp-amp: warning: without --pvc the run dir is an emptyDir: checkpoints do not outlive a pod")
    if script is not None:
        say(f"ddp-amp: the pods run {' '.join(script.argv())} from their working directory: the image must hold it "
            "there")
    say(f"ddp-amp: wrote {k8s['emit_k8s']}; start it with kubectl apply -f {k8s['emit_k8s']}")
