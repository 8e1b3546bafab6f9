"""multinode --emit-k8s and --from-env: the manifests checked offline against the kinds' real schemas (Kubeflow
Trainer's TrainJob and JobSet models, the Training Operator's PyTorchJob models, Kubernetes' own JSON schemas in
strict mode), the rendezvous each kind injects, and the refusals."""

import json
import os
from pathlib import Path

import pytest
import yaml
from helpers import one_line, run_main

from ddp_amp.launch.kubernetes import rendezvous_from_env

KUBERNETES = "1.30.0"  # a version whose schemas kubernetes-validate ships; the fields used are in every 1.2x too


def emit(tmp_path, capsys, kind: str, *extra: str, run_dir: str = "runs/bert") -> tuple[dict, str]:
    """The manifest `multinode --emit-k8s` writes (in this process: nothing launches) and what it printed to
    stderr."""
    path = tmp_path / f"{kind}.yaml"
    code, out, err = run_main(["multinode", "--nnodes", "2", "--nproc-per-node", "2", "--device", "cpu", "--steps",
                               "50", "--stop-timeout", "40", "--emit-k8s", str(path), "--k8s-kind", kind, "--image",
                               "registry.example/ddp-amp:1", "--run-dir", run_dir, *extra], capsys)
    assert code == 0, err
    text = path.read_text()
    assert text in out  # printed before use, like the torchrun line
    return yaml.safe_load(text), err


def contained(original, parsed, where="") -> list[str]:
    """Every field of `original` is in `parsed` with the same value: a field the schema does not know is dropped
    by the models, so it shows here (a schema's own defaults, added in `parsed`, are fine)."""
    if isinstance(original, dict):
        if not isinstance(parsed, dict):
            return [f"{where}: not an object"]
        return [problem for key, value in original.items()
                for problem in (contained(value, parsed[key], f"{where}.{key}") if key in parsed
                                else [f"{where}.{key}: not in the schema"])]
    if isinstance(original, list):
        if not isinstance(parsed, list) or len(parsed) != len(original):
            return [f"{where}: a list of another length"]
        return [p for i, (a, b) in enumerate(zip(original, parsed)) for p in contained(a, b, f"{where}[{i}]")]
    return [] if original == parsed else [f"{where}: {original!r} became {parsed!r}"]


def strict_kubernetes(resource: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(resource, KUBERNETES, strict=True)


def pod_template_as_pod(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": template["spec"]}


def test_the_trainjob_validates_against_kubeflow_trainers_models(tmp_path, capsys):
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    manifest, _ = emit(tmp_path, capsys, "trainjob", "--pvc", "checkpoints", "--cpu", "4", "--memory", "16Gi")
    assert contained(manifest, TrainerV1alpha1TrainJob.from_dict(manifest).to_dict()) == []
    spec = manifest["spec"]
    assert spec["runtimeRef"]["name"] == "torch-distributed" and spec["trainer"]["numNodes"] == 2
    # The runtime injects numProcPerNode as PET_NPROC_PER_NODE (auto when unset): it must be the command's count.
    assert spec["trainer"]["numProcPerNode"] == 2 and "--nproc-per-node" in spec["trainer"]["command"]
    assert spec["trainer"]["command"][:3] == ["ddp-amp", "multinode", "--from-env"]
    assert spec["trainer"]["resourcesPerNode"] == {"requests": {"cpu": "4", "memory": "16Gi"}}
    pod = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 40 + 30  # the stop agreement and checkpoint fit in
    assert pod["volumes"] == [{"name": "run-dir", "persistentVolumeClaim": {"claimName": "checkpoints"}}]


def test_the_jobset_validates_against_the_jobset_models_and_its_job_against_kubernetes(tmp_path, capsys):
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

    manifest, _ = emit(tmp_path, capsys, "jobset", "--pvc", "checkpoints", "--max-restarts", "3")
    assert contained(manifest, JobsetV1alpha2JobSet.from_dict(manifest).to_dict()) == []
    replicated = manifest["spec"]["replicatedJobs"][0]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}, "spec": replicated["template"]["spec"]}
    strict_kubernetes(job)
    assert manifest["spec"]["failurePolicy"] == {"maxRestarts": 3}  # every pod recreated, up to 3 times
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    # The headless service's name of pod 0: <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>
    assert env["PET_MASTER_ADDR"] == "ddp-amp-bert-node-0-0.ddp-amp-bert"
    assert env["PET_NODE_RANK"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}


@pytest.mark.parametrize("nnodes", ["2", "1:3"])
def test_the_pytorchjob_validates_against_the_training_operators_models(tmp_path, nnodes, capsys):
    from kubeflow.training.api_client import ApiClient

    path = tmp_path / "job.yaml"
    code, _, err = run_main(["multinode", "--nnodes", nnodes, "--device", "cpu", "--emit-k8s", str(path),
                             "--k8s-kind", "pytorchjob", "--image", "registry.example/ddp-amp:1", "--pvc", "ckpt"],
                            capsys)
    assert code == 0, err
    manifest = yaml.safe_load(path.read_text())

    class Response:
        data = json.dumps(manifest)

    client = ApiClient()
    parsed = client.sanitize_for_serialization(client.deserialize(Response(), "KubeflowOrgV1PyTorchJob"))
    assert contained(manifest, parsed) == []
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    for replica in replicas.values():
        strict_kubernetes(pod_template_as_pod(replica["template"]))
        assert replica["template"]["spec"]["containers"][0]["name"] == "pytorch"
    if nnodes == "2":
        assert {k: v["replicas"] for k, v in replicas.items()} == {"Master": 1, "Worker": 1}
    else:
        assert manifest["spec"]["elasticPolicy"]["minReplicas"] == 1
        assert manifest["spec"]["elasticPolicy"]["maxReplicas"] == 3 and list(replicas) == ["Worker"]


def test_a_field_the_schema_does_not_know_fails_the_check(tmp_path, capsys):
    """The check itself: a misspelt field is caught."""
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

    manifest, _ = emit(tmp_path, capsys, "jobset")
    manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["terminationGracePeriod"] = 5
    assert contained(manifest, JobsetV1alpha2JobSet.from_dict(manifest).to_dict()) != []


@pytest.mark.parametrize(("args", "flag"), [
    (["--k8s-kind", "jobset"], "--image"),
    (["--image", "i:1", "--pvc", "My_Claim"], "--pvc"),
    (["--image", "i:1", "--namespace", "Team A"], "--namespace"),
    (["--image", "i:1", "--gpus-per-node", "2"], "--gpus-per-node"),
    (["--image", "i:1", "--k8s-kind", "mpijob"], "--k8s-kind"),
    (["--image", "i:1", "--cpu", "abc"], "--cpu"),
    (["--image", "i:1", "--cpu", "-2"], "--cpu"),
    (["--image", "i:1", "--memory", "lots"], "--memory"),
    (["--image", "i:1", "--memory", "16 Gi"], "--memory"),
    (["--image", "img with space"], "--image"),
    (["--image", "Registry/Img:1"], "--image"),
    (["--image", "i:1", "--emit-slurm", "job.sbatch"], "--emit-slurm"),
])
def test_bad_kubernetes_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, flag, capsys):
    path = tmp_path / "job.yaml"
    code, _, err = run_main(["multinode", "--nnodes", "2", "--device", "cpu", "--emit-k8s", str(path), *args], capsys)
    assert code == 2 and flag in one_line(err)
    assert not path.exists() and not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize("nproc", ["3", "cpu"])
def test_more_ranks_per_pod_than_its_gpus_is_one_line_exit_2(tmp_path, capsys, nproc):
    path = tmp_path / "job.yaml"
    code, out, err = run_main(["multinode", "--nnodes", "2", "--nproc-per-node", nproc, "--gpus-per-node", "2",
                               "--emit-k8s", str(path), "--image", "i:1"], capsys)
    line = one_line(err)
    assert code == 2 and out == "" and not path.exists()
    assert line.startswith(f"ddp-amp: error: --nproc-per-node {nproc} starts ") and "--gpus-per-node 2" in line


@pytest.mark.parametrize("quantity", ["500m", "2", "1.5", "4Gi", "512Mi", "1e3", "2E", ".5"])
def test_kubernetes_quantities_and_image_references_are_taken(tmp_path, capsys, quantity):
    path = tmp_path / "job.yaml"
    image = "ghcr.io:443/org/ddp-amp:v1.2@sha256:" + "0123456789abcdef" * 4
    code, _, err = run_main(["multinode", "--nnodes", "2", "--nproc-per-node", "2", "--gpus-per-node", "2",
                             "--emit-k8s", str(path), "--image", image, "--cpu", quantity, "--memory", quantity,
                             "--k8s-kind", "pytorchjob"], capsys)
    assert code == 0, err
    container = yaml.safe_load(path.read_text())["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]
    assert container["image"] == image and container["resources"]["requests"] == {"cpu": quantity,
                                                                                  "memory": quantity}


def test_without_a_claim_the_manifest_says_checkpoints_do_not_outlive_a_pod(tmp_path, capsys):
    manifest, err = emit(tmp_path, capsys, "jobset")
    assert "without --pvc" in err
    assert manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"] == [
        {"name": "run-dir", "emptyDir": {}}]


@pytest.mark.parametrize(("environ", "expected"), [
    # Kubeflow Trainer's torch runtime
    ({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job",
      "PET_MASTER_PORT": "29400"}, ("2", "job-node-0-0.job:29400", 1, "4")),
    # PyTorchJob: WORLD_SIZE counts pods and RANK is this pod's
    ({"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"},
     ("3", "job-master-0:23456", 2, None)),
    # PyTorchJob with an elasticPolicy: no fixed node rank
    ({"PET_RDZV_ENDPOINT": "job-worker-0:29400", "PET_NNODES": "1:3", "MASTER_ADDR": "x", "RANK": "0",
      "WORLD_SIZE": "3"}, ("1:3", "job-worker-0:29400", None, None)),
    # an Indexed Job's completion index
    ({"PET_NNODES": "2", "PET_MASTER_ADDR": "m", "JOB_COMPLETION_INDEX": "1"}, ("2", "m:29400", 1, None)),
])
def test_from_env_reads_what_each_kind_injects(environ, expected):
    found = rendezvous_from_env(environ)
    assert (found.nnodes, found.endpoint, found.node_rank, found.nproc_per_node) == expected


def environment_of_a_pod(monkeypatch, variables: dict[str, str]) -> None:
    """This process's environment as a pod's: the rendezvous variables of the caller's shell removed, `variables`
    set."""
    for name in [name for name in os.environ if name.startswith(("PET_", "MASTER_", "JOB_COMPLETION"))] + [
            "WORLD_SIZE", "RANK"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_from_env_without_a_rendezvous_is_one_line_exit_2(monkeypatch, capsys):
    environment_of_a_pod(monkeypatch, {"PET_NNODES": "", "WORLD_SIZE": ""})
    code, _, err = run_main(["multinode", "--from-env", "--device", "cpu"], capsys)
    assert code == 2 and "--from-env" in one_line(err)


def test_from_env_reaches_torchrun(tmp_path, monkeypatch, capsys):
    environment_of_a_pod(monkeypatch, {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
                                       "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "29999"})
    code, out, err = run_main(["multinode", "--from-env", "--device", "cpu", "--dry-run", "--run-dir",
                               str(tmp_path)], capsys)
    assert code == 0, err
    command = out.splitlines()[0]
    assert "--nnodes 2" in command and "--nproc-per-node 2" in command and "--node-rank 1" in command
    assert "--rdzv-endpoint 127.0.0.1:29999" in command


@pytest.mark.parametrize(("where", "problem"), [
    (lambda tmp: tmp / "missing" / "job.yaml", "directory '{parent}' does not exist"),
    (lambda tmp: Path("/proc/ddp-amp-job.yaml"), "cannot be written"),  # not writable, even as root
])
def test_emit_k8s_where_it_cannot_write_is_one_line_before_printing_anything(tmp_path, capsys, where, problem):
    path = where(tmp_path)
    code, out, err = run_main(["multinode", "--nnodes", "2", "--device", "cpu", "--emit-k8s", str(path), "--image",
                               "i:1"], capsys)
    assert code == 2 and out == ""  # the manifest is not printed either
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ddp-amp: error: --emit-k8s '{path}'"), err
    assert problem.format(parent=path.parent) in lines[0]


def test_an_elastic_trainjob_asks_for_the_most_nodes_its_range_allows(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    code, _, err = run_main(["multinode", "--nnodes", "1:3", "--nproc-per-node", "2", "--device", "cpu",
                             "--emit-k8s", str(path), "--k8s-kind", "trainjob", "--image",
                             "registry.example/ddp-amp:1", "--run-dir", "r"], capsys)
    assert code == 0, err
    assert yaml.safe_load(path.read_text())["spec"]["trainer"]["numNodes"] == 3


def pod_environment(container: dict, completion_index: int) -> dict[str, str]:
    """A pod's environment as Kubernetes makes it for an Indexed Job's pod: each `value`, each `valueFrom` of the
    completion-index annotation resolved, and the JOB_COMPLETION_INDEX every Indexed Job's pod gets."""
    annotation = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    environ = {"JOB_COMPLETION_INDEX": str(completion_index)}
    for entry in container["env"]:
        if "value" in entry:
            environ[entry["name"]] = entry["value"]
        else:
            assert entry["valueFrom"] == {"fieldRef": {"fieldPath": annotation}}, entry
            environ[entry["name"]] = str(completion_index)
    return environ


@pytest.mark.parametrize("index", [0, 1])
def test_each_jobset_pod_reads_its_own_node_and_the_rendezvous_from_the_environment_it_gets(tmp_path, monkeypatch,
                                                                                           capsys, index):
    """The JobSet's own pod command, run with the environment its manifest gives pod `index`: torchrun gets both
    nodes, this pod's node rank, node 0's DNS name and the per-node count (a variable left out of the manifest,
    PET_NNODES say, fails here)."""
    manifest, _ = emit(tmp_path, capsys, "jobset")
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    environment_of_a_pod(monkeypatch, pod_environment(container, index))
    import socket

    resolve = socket.getaddrinfo
    master = "ddp-amp-bert-node-0-0.ddp-amp-bert"  # the cluster's DNS answers for the headless service
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: resolve("10.0.0.1" if host == master else host,
                                                                             *a, **k))
    command = container["command"] + container.get("args", [])
    assert command[:3] == ["ddp-amp", "multinode", "--from-env"], command
    code, out, err = run_main([*command[1:], "--dry-run"], capsys)
    assert code == 0, err
    torchrun = out.splitlines()[0]
    assert f"--nnodes {job['completions']}" in torchrun and job["completions"] == 2, torchrun
    assert f"--node-rank {index}" in torchrun and "--nproc-per-node 2" in torchrun, torchrun
    assert f"--rdzv-endpoint {master}:29400" in torchrun, torchrun
