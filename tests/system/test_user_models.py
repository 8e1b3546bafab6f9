"""The user's own model and data as they already wrote them, in real 2-rank gloo runs: Hugging Face batches
and losses, collate functions, iterable datasets and their end, DDP's switches, task arguments and imports."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import USER_TASKS, assert_ok, last_line, launch, load_weights, read_summary, run_cli

from ddp_amp.checkpoint.sharded import read_model
from ddp_amp.checkpoint.weights import read_weights

pytestmark = pytest.mark.slow

FP32_SGD = ["--device", "cpu", "--amp", "off", "--optimizer", "sgd", "--lr", "0.05", "--schedule", "constant",
            "--seed", "4"]


def task(name: str) -> str:
    return f"{USER_TASKS}:{name}"


def spawn(run_dir, *args, env=None, nproc=2):
    return launch(run_dir, *FP32_SGD, *args, env=env, nproc=nproc)


def trained_indices(log_dir: Path) -> list[int]:
    return [int(line) for path in log_dir.glob("*.txt") for line in path.read_text().split()]


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory) -> Path:
    """One run of a Hugging Face model on dict items, for the tests that read it (none writes into it)."""
    run_dir = tmp_path_factory.mktemp("bert") / "plain"
    assert_ok(spawn(run_dir, "--task", task("bert_dict_items"), "--steps", "6", "--batch-size", "4"))
    return run_dir


def test_a_hugging_face_model_with_dict_items_trains_as_the_wrapper_and_pairs_form(tmp_path, bert_run):
    """model(**batch) and the model's own output.loss: the same weights, bit for bit, as the 12 lines of glue
    users wrote before (a wrapper calling hf(**batch), pairs, loss_fn=output.loss)."""
    plain, wrapped = bert_run, tmp_path / "wrapped"
    assert_ok(spawn(wrapped, "--task", task("bert_wrapped_pairs"), "--steps", "6", "--batch-size", "4"))
    ours, theirs = load_weights(plain), {k.removeprefix("hf."): v for k, v in load_weights(wrapped).items()}
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    from transformers import BertConfig, BertForSequenceClassification

    # model.pt is the model's own state_dict: its class loads it without renaming anything.
    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=32,
                                                     max_position_embeddings=12, num_labels=3))
    model.load_state_dict(ours)
    assert read_summary(plain)["final_loss"] == pytest.approx(read_summary(wrapped)["final_loss"], abs=0)


def test_an_output_without_a_loss_and_no_loss_fn_is_one_line_naming_the_task(tmp_path):
    result = spawn(tmp_path, "--task", task("output_without_loss"), "--steps", "2", "--batch-size", "8")
    assert result.returncode == 1
    verdict = last_line(result.stderr)
    assert "output_without_loss" in verdict and "no loss" in verdict and "loss_fn" in verdict, verdict
    assert "Traceback" not in result.stderr


def test_a_padding_collate_fn_batches_variable_length_dict_items(tmp_path):
    """Without the task's collate_fn, default collation cannot stack sequences of different lengths."""
    assert_ok(spawn(tmp_path / "whole", "--task", task("padded_sequences"), "--steps", "4", "--batch-size", "8"))
    # --micro-batch cuts a dict batch along the batch dimension of every tensor: the same mathematics.
    assert_ok(spawn(tmp_path / "pieces", "--task", task("padded_sequences"), "--steps", "4", "--batch-size", "8",
                    "--micro-batch", "3"))
    whole, pieces = load_weights(tmp_path / "whole"), load_weights(tmp_path / "pieces")
    for key in whole:
        torch.testing.assert_close(pieces[key], whole[key], rtol=1e-5, atol=1e-6)


def test_an_unsharded_iterable_is_split_between_the_ranks_and_ends_at_one_agreed_step(tmp_path):
    """33 items over 2 ranks at 4 a batch: rank 0 holds 17 (5 batches), rank 1 holds 16 (4). Both ranks stop
    after step 4, no item is trained twice, nothing hangs, and model.pt is written."""
    logs = tmp_path / "indices"
    logs.mkdir()
    result = spawn(tmp_path / "run", "--task", task("stream"), "--steps", "100", "--batch-size", "4",
                   env={"DDP_AMP_TEST_INDEX_LOG": str(logs)})
    assert_ok(result)
    summary = read_summary(tmp_path / "run")
    assert summary["steps"] == 4 and summary["data_ended_at_step"] == 4
    assert "the data ran out at step 4" in result.stderr
    counts = Counter(trained_indices(logs))
    assert max(counts.values()) == 1, counts
    assert len(counts) == 4 * 4 * 2  # 4 steps x 4 samples x 2 ranks, each once
    assert (tmp_path / "run" / "model.pt").exists()


def test_an_iterable_split_by_node_already_is_not_split_again(tmp_path):
    logs = tmp_path / "indices"
    logs.mkdir()
    result = spawn(tmp_path / "run", "--task", task("hf_stream_split_by_node"), "--steps", "100", "--batch-size",
                   "4", env={"DDP_AMP_TEST_INDEX_LOG": str(logs), "DDP_AMP_TEST_STREAM_ITEMS": "32"})
    assert_ok(result)
    counts = Counter(trained_indices(logs))
    assert sorted(counts) == list(range(32)) and set(counts.values()) == {1}  # every item once, none skipped


ITERABLE_RUN = ["--steps", "30", "--batch-size", "2", "--checkpoint-every", "2", "--log-every", "1"]


def _stopped_then_resumed(tmp_path, name: str, env: dict) -> tuple[Path, str]:
    """Stopped by SIGTERM to the group at rank 0's 9th step, then resumed from the stop checkpoint."""
    run_dir = tmp_path / "resumed"
    stopped = subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", *FP32_SGD, "--task", task(name),
                              *ITERABLE_RUN, "--run-dir", str(run_dir)], capture_output=True, text=True,
                             start_new_session=True, env={**os.environ, **env, "DDP_AMP_TEST_STOP_AT": "9",
                                                          "DDP_AMP_TEST_STEP_SLEEP": "0.05"},
                             timeout=180)
    assert stopped.returncode == 143, stopped.stderr
    resumed = spawn(run_dir, "--task", task(name), *ITERABLE_RUN, "--resume", "auto", env=env)
    assert_ok(resumed)
    return run_dir, resumed.stderr


@pytest.mark.parametrize("name", ["stateful_stream", "stream"])
def test_a_resumed_iterable_run_equals_the_uninterrupted_one(tmp_path, name):
    """A stateful iterable is restored per rank; another is fast-forwarded past what was consumed. Either way
    the weights equal the uninterrupted run's bit for bit and no item is trained twice."""
    env = {"DDP_AMP_TEST_STREAM_ITEMS": "200"}
    logs = tmp_path / "indices"
    logs.mkdir()
    assert_ok(spawn(tmp_path / "whole", "--task", task(name), *ITERABLE_RUN,
                    env={**env, "DDP_AMP_TEST_INDEX_LOG": str(logs)}))
    resumed_logs = tmp_path / "resumed-indices"
    resumed_logs.mkdir()
    run_dir, stderr = _stopped_then_resumed(tmp_path, name, {**env, "DDP_AMP_TEST_INDEX_LOG": str(resumed_logs)})
    whole, resumed = load_weights(tmp_path / "whole"), load_weights(run_dir)
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key
    stopped_at = read_summary(run_dir)["resumed_from_step"]
    if name == "stream":
        assert f"skipped the {stopped_at * 2 * 2} items trained before step {stopped_at}" in stderr, stderr
    assert Counter(trained_indices(resumed_logs)) == Counter(trained_indices(logs))


@pytest.mark.parametrize("frozen", [False, True], ids=["all-trainable", "a-frozen-layer-first"])
def test_find_unused_parameters_trains_a_branch_used_every_other_step(tmp_path, frozen):
    """Without the flag: one line naming the parameters that got no gradient. DDP numbers only the parameters
    that require gradients: with a frozen layer first, numbering all of them would name the head instead."""
    args = ("--task", task("branch_every_other_step"), "--task-arg", f"frozen={frozen}", "--steps", "4")
    without = spawn(tmp_path / "without", *args)
    assert without.returncode == 1
    verdict = last_line(without.stderr)
    assert "2 parameters got no gradient" in verdict, verdict
    assert "sometimes.weight" in verdict and "sometimes.bias" in verdict, verdict
    assert "--find-unused-parameters" in verdict and "trunk" not in verdict and "head" not in verdict, verdict
    assert "Traceback" not in without.stderr, without.stderr
    assert_ok(spawn(tmp_path / "with", *args, "--find-unused-parameters"))


def test_a_graph_that_changes_under_static_graph_is_one_line_naming_the_flag(tmp_path):
    result = spawn(tmp_path, "--task", task("branch_every_other_step"), "--steps", "4", "--static-graph")
    assert result.returncode == 1
    verdict = last_line(result.stderr)
    assert "the model used other parameters than in the steps before" in verdict, verdict
    assert "drop --static-graph" in verdict, verdict
    assert "Traceback" not in result.stderr and "RuntimeError" not in result.stderr, result.stderr


def test_frozen_parameters_stay_as_initialised_and_are_counted(tmp_path):
    assert_ok(spawn(tmp_path / "frozen", "--task", task("frozen_trunk"), "--steps", "5"))
    torch.manual_seed(4)  # the factory runs after the seed is set, on every rank
    import importlib.util

    spec = importlib.util.spec_from_file_location("user_tasks_again", USER_TASKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    initial = module.frozen_trunk().model.state_dict()
    trained = load_weights(tmp_path / "frozen")
    assert torch.equal(trained["0.weight"], initial["0.weight"]) and torch.equal(trained["0.bias"], initial["0.bias"])
    assert not torch.equal(trained["2.weight"], initial["2.weight"])
    summary = read_summary(tmp_path / "frozen")
    assert summary["trainable_parameters"] == 16 + 1 and summary["frozen_parameters"] == 8 * 16 + 16


def test_a_plain_forward_trains_on_dict_items_whose_extra_field_only_the_loss_reads(tmp_path):
    """{x, y, weight} items, forward(self, x): the model gets x, the loss the whole batch. All weights 0: the loss
    is 0, so plain SGD leaves the weights as initialised (the loss saw the weight); the start line names the
    fields left out."""
    result = spawn(tmp_path, "--task", task("weighted_items"), "--task-arg", "weight=0", "--optimizer", "sgd",
                   "--schedule", "constant", "--steps", "5", "--batch-size", "8", "--seed", "7")
    assert_ok(result)
    assert ("ddp-amp: batch fields y, weight not passed to the model (its forward does not name them): the loss "
            "and the metrics still get the whole batch (Task.pass_every_field passes them)") in result.stderr
    torch.manual_seed(7)  # as every rank builds it
    from ddp_amp.tasks import build_task

    initial = build_task(task("weighted_items"), ["weight=0"]).model.state_dict()
    trained = load_weights(tmp_path)
    assert all(torch.equal(trained[k], initial[k]) for k in initial)
    assert read_summary(tmp_path)["final_loss"] == 0


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_t5"])
def test_a_token_mean_loss_on_two_ranks_gives_one_ranks_weights_of_the_whole_batch(tmp_path, model):
    """A Hugging Face causal LM's or seq2seq model's loss is the mean over its label tokens, and the sequences hold
    2 to 11 of them, so the ranks hold uneven counts: 2 ranks of 16 end on the weights of one rank's batch of 32
    within 1e-5 (fp32, no dropout). --micro-batch and --grad-accum: the test below."""
    common = ["--task", task(f"{model}_uneven_labels"), "--steps", "3"]  # fp32, plain SGD (FP32_SGD)
    assert_ok(spawn(tmp_path / "full", *common, "--batch-size", "32", nproc=1))
    assert_ok(spawn(tmp_path / "ranks", *common, "--batch-size", "16", nproc=2))
    full, ranks = load_weights(tmp_path / "full"), load_weights(tmp_path / "ranks")
    assert max((ranks[k] - full[k]).abs().max().item() for k in full) < 1e-5
    logged = {name: read_summary(tmp_path / name)["final_loss"] for name in ("full", "ranks")}
    assert logged["ranks"] == pytest.approx(logged["full"], rel=1e-5)  # the logged loss is the token mean too


@pytest.mark.parametrize("model", ["tiny_t5", "tiny_llama"])
def test_a_token_mean_loss_in_pieces_or_accumulated_gives_the_full_batchs_weights(one_rank_group, tmp_path, model):
    """T5's and a causal LM's own loss is the mean over its label tokens, and the targets hold 2 to 11 of them:
    --micro-batch 8 and --micro-batch 3 (uneven pieces) of a batch of 32 and --grad-accum 4 of batches of 8 follow
    the batch of 32 within 1e-5 (weighted by samples, as before, they drift: 0.04 at --micro-batch 3 of 8 on T5,
    8e-3 at --micro-batch 2 of 8 on the causal LM). Across ranks: the test above. In-process, one rank; here rather
    than in tests/unit for its time (about 15 s, importing transformers included)."""
    from ddp_amp.config import TrainConfig
    from ddp_amp.precision import Precision
    from ddp_amp.tasks import build_task
    from ddp_amp.train.trainer import Trainer

    class Records:
        def on_log(self, record):
            pass

    def run(**options):
        config = TrainConfig(task="inline", steps=3, log_every=3, amp="off", seed=5, optimizer="sgd",
                             schedule="constant", lr=0.5, run_dir=str(tmp_path), **options)
        torch.manual_seed(5)
        task = build_task(f"{USER_TASKS}:{model}_uneven_labels")
        trainer = Trainer(config, one_rank_group, torch.device("cpu"), Precision("fp32"), task, Records())
        trainer.train()
        weights = {k: v.clone() for k, v in trainer.module.state_dict().items()}
        trainer.close()
        return weights

    whole = run(batch_size=32)
    for options in ({"batch_size": 32, "micro_batch": "8"}, {"batch_size": 32, "micro_batch": "3"},
                    {"batch_size": 8, "grad_accum": 4}):
        other = run(**options)
        assert max((other[k] - whole[k]).abs().max().item() for k in whole) < 1e-5, options


def test_task_arguments_are_converted_by_the_factorys_annotations_and_recorded(tmp_path):
    seen = tmp_path / "seen.txt"
    args = ["--task", task("sized"), "--task-arg", "width=5", "--task-arg", "scale=0.5", "--task-arg", "bias=false",
            "--task-arg", "note=a=b", "--task-arg", f"out={seen}", "--steps", "3"]
    assert_ok(spawn(tmp_path / "first", *args))
    assert eval(seen.read_text()) == {"width": 5, "scale": 0.5, "bias": False, "note": "a=b"}
    weights = load_weights(tmp_path / "first")
    assert weights["0.weight"].shape == (5, 8) and "0.bias" not in weights
    # config.toml keeps them: --config trains the same model again.
    again = run_cli("spawn", "--config", str(tmp_path / "first" / "config.toml"), "--run-dir", str(tmp_path / "again"))
    assert_ok(again)
    for key, value in load_weights(tmp_path / "again").items():
        assert torch.equal(value, weights[key]), key


def test_a_task_file_imports_its_sibling_modules(tmp_path):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "shapes.py").write_text("WIDTH = 3\n")
    (tmp_path / "project" / "train_me.py").write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\n"
        "from ddp_amp.tasks import Task\nimport shapes\n\n"
        "def build():\n"
        "    x = torch.randn(16, shapes.WIDTH)\n"
        "    return Task(nn.Linear(shapes.WIDTH, 1), TensorDataset(x, x.sum(1, keepdim=True)),\n"
        "                nn.functional.mse_loss)\n")
    assert_ok(spawn(tmp_path / "run", "--task", f"{tmp_path / 'project' / 'train_me.py'}:build", "--steps", "2",
                    "--batch-size", "8"))
    assert load_weights(tmp_path / "run")["weight"].shape == (1, 3)


def test_the_rank_that_failed_first_is_named_not_the_peer_that_saw_it_die(tmp_path):
    result = spawn(tmp_path, "--task", task("real_failure_after_peer_sees_it_die"), "--steps", "10")
    assert result.returncode == 1
    verdict = last_line(result.stderr)
    assert "rank 1" in verdict and "the real cause, on rank 1" in verdict, verdict
    # Its flight record says where its loop was when the exception left it: step 3 (the loss's third call).
    record = json.loads((tmp_path / "flight_recorder" / "rank1.json").read_text())
    assert record["position"]["step"] == 3 and record["reason"].startswith("failed: ValueError"), record


def _metrics_lines(run_dir: Path) -> list[dict]:
    import json

    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_validation_on_two_ranks_counts_each_sample_once(tmp_path):
    """37 validation samples over 2 ranks: the logged val_loss at the end is the one-process loss of model.pt
    over the whole set (a padded duplicate would shift it), at every --eval-every step and at the end."""
    run_dir = tmp_path / "run"
    assert_ok(spawn(run_dir, "--task", task("with_validation"), "--steps", "9", "--batch-size", "4",
                    "--eval-every", "4"))
    evaluations = [m for m in _metrics_lines(run_dir) if "val_loss" in m]
    assert [m["step"] for m in evaluations] == [4, 8, 9]
    import importlib.util

    spec = importlib.util.spec_from_file_location("user_tasks_val", USER_TASKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reference = module.with_validation()
    reference.model.load_state_dict(load_weights(run_dir))
    x, y = reference.val_dataset.x, reference.val_dataset.y
    with torch.no_grad():
        output = reference.model(x)
    assert evaluations[-1]["val_loss"] == pytest.approx(torch.nn.functional.mse_loss(output, y).item(), abs=1e-6)
    assert evaluations[-1]["val_abs_error"] == pytest.approx((output - y).abs().mean().item(), abs=1e-6)
    summary = read_summary(run_dir)
    assert summary["validation"]["evaluations"] == 3 and summary["validation"]["seconds_each"] > 0


def test_a_metric_some_batches_do_not_report_is_the_mean_over_those_that_do(tmp_path):
    """val_metrics may leave a metric out of a batch: its mean is over the samples of the batches that report
    it, each counted once (before, the others counted as zeros: a constant 7 was logged as about 3.6)."""
    run_dir = tmp_path / "run"
    assert_ok(spawn(run_dir, "--task", task("metric_on_some_batches"), "--steps", "8", "--batch-size", "4",
                    "--eval-every", "4", "--keep-best", "val_seven"))
    evaluations = [m for m in _metrics_lines(run_dir) if "val_loss" in m]
    assert [(m["step"], m["val_seven"]) for m in evaluations] == [(4, 7.0), (8, 7.0)]
    assert read_summary(run_dir)["validation"]["val_seven"] == 7.0


def test_validation_batches_are_the_training_pieces_not_the_whole_batch(tmp_path):
    """--batch-size 8 --micro-batch 3: every validation batch holds at most 3 samples, as every training piece
    does (the whole batch at once could need more memory than the training's pieces)."""
    run_dir = tmp_path / "run"
    assert_ok(spawn(run_dir, "--task", task("reports_validation_batches"), "--steps", "2", "--batch-size", "8",
                    "--micro-batch", "3", "--eval-every", "1"))
    size = 3
    shares = [len(range(rank, 37, 2)) for rank in range(2)]  # user_tasks.VAL_SAMPLES: 19 and 18 samples
    batches = [min(size, share - start) for share in shares for start in range(0, share, size)]
    expected = sum(n * n for n in batches) / sum(batches)  # each batch's size, weighted by its samples
    assert [m["val_batch_samples"] for m in _metrics_lines(run_dir) if "val_loss" in m] == \
        [pytest.approx(expected)] * 2


KEEP_BEST = ["--task", task("val_passes_optimum"), "--steps", "30", "--batch-size", "8", "--eval-every", "2",
             "--checkpoint-every", "2", "--keep", "1", "--keep-best", "val_loss", "--log-every", "2"]


def _assert_best_kept(run_dir: Path, suffix: str = ".pt") -> int:
    """suffix: ".pt" for --checkpoint-format single's files, "" for sharded's directories."""
    evaluations = [m for m in _metrics_lines(run_dir) if "val_loss" in m]
    best = min(evaluations, key=lambda m: m["val_loss"])
    assert 2 < best["step"] < 30, evaluations  # the task's validation loss falls, then rises
    summary = read_summary(run_dir)
    assert summary["best"]["step"] == best["step"] and summary["best"]["metric"] == "val_loss"
    assert summary["best"]["value"] == pytest.approx(best["val_loss"])
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*") if p.suffix != ".json")
    assert kept == sorted([f"step-{best['step']}{suffix}", f"step-30{suffix}"]), kept  # --keep 1, and the best
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.json")) == sorted(
        [f"step-{best['step']}.json", "step-30.json"])
    path = run_dir / "checkpoints" / f"step-{best['step']}{suffix}"
    model = torch.load(path, weights_only=True)["trainer"]["model"] if suffix else read_model(path)
    model_best = torch.load(run_dir / "model_best.pt", weights_only=True)
    for key, value in model.items():
        assert torch.equal(model_best[key], value), key
    return best["step"]


def test_the_built_in_transformer_validates_while_training_and_keeps_its_best_weights(tmp_path):
    """`--task transformer --eval-every N --keep-best val_loss` as a user first types it (default options)."""
    result = launch(tmp_path, "--device", "cpu", "--task", "transformer", "--steps", "12", "--batch-size", "16",
                    "--eval-every", "6", "--keep-best", "val_loss")
    assert_ok(result)
    evaluations = {m["step"]: m["val_loss"] for m in _metrics_lines(tmp_path) if "val_loss" in m}
    assert sorted(evaluations) == [6, 12] and evaluations[12] < evaluations[6] < 4.2, evaluations  # ln 64 = 4.16
    best = read_summary(tmp_path)["best"]
    assert best["step"] == 12 and best["value"] == pytest.approx(evaluations[12])
    assert (tmp_path / "model_best.pt").read_bytes() == (tmp_path / "model.pt").read_bytes()


@pytest.fixture(scope="module")
def keep_best_run(tmp_path_factory) -> Path:
    """One uninterrupted --keep-best run in single files, for the tests that read it (none writes into it)."""
    run_dir = tmp_path_factory.mktemp("keep-best")
    assert_ok(spawn(run_dir, *KEEP_BEST))
    return run_dir


@pytest.mark.parametrize("checkpoint_format", ["single", "sharded"])
def test_keep_best_keeps_the_best_steps_checkpoint_and_weights(tmp_path, checkpoint_format, keep_best_run):
    if checkpoint_format == "single":
        run_dir = keep_best_run
    else:
        run_dir = tmp_path / "run"
        assert_ok(spawn(run_dir, *KEEP_BEST, "--checkpoint-format", checkpoint_format))
    _assert_best_kept(run_dir, ".pt" if checkpoint_format == "single" else "")


def test_keep_best_survives_a_resume(tmp_path, keep_best_run):
    best = _assert_best_kept(keep_best_run)
    run_dir = tmp_path / "resumed"
    stopped = subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", *FP32_SGD, *KEEP_BEST,
                              "--run-dir", str(run_dir)], capture_output=True, text=True, start_new_session=True,
                             # loss calls: one a step, and the evaluations' batches (3 a rank, every 2 steps)
                             env={**os.environ, "DDP_AMP_TEST_STOP_AT": str((best + 1) * 5 // 2),
                                  "DDP_AMP_TEST_STEP_SLEEP": "0.05"}, timeout=180)
    assert stopped.returncode == 143, stopped.stderr
    assert read_summary(run_dir)["stopped_at_step"] > best
    assert_ok(spawn(run_dir, *KEEP_BEST, "--resume", "auto"))
    assert _assert_best_kept(run_dir) == best


def _keep_all_best(checkpoint_format: str) -> list[str]:
    """KEEP_BEST keeping every checkpoint, in `checkpoint_format`."""
    return [*KEEP_BEST[:KEEP_BEST.index("--keep")], "--keep", "100", *KEEP_BEST[KEEP_BEST.index("--keep") + 2:],
            "--checkpoint-format", checkpoint_format]


@pytest.fixture(scope="module")
def keep_all_best_step(tmp_path_factory):
    """The best step of an uninterrupted _keep_all_best run, one launch per checkpoint format (cached)."""
    steps = {}

    def best_step(checkpoint_format: str) -> int:
        if checkpoint_format not in steps:
            run_dir = tmp_path_factory.mktemp(f"keep-all-best-{checkpoint_format}")
            assert_ok(spawn(run_dir, *_keep_all_best(checkpoint_format)))
            steps[checkpoint_format] = read_summary(run_dir)["best"]["step"]
        return steps[checkpoint_format]
    return best_step


@pytest.mark.parametrize(("best_checkpoint_left", "checkpoint_format"),
                         [(True, "single"), (True, "sharded"), (False, "single")])
def test_a_resume_from_before_the_last_best_keeps_model_best_the_checkpoints_best(tmp_path, best_checkpoint_left,
                                                                                   checkpoint_format,
                                                                                   keep_all_best_step):
    """A --keep-best run stopped past its best, resumed from the checkpoint two steps before that best (whose best
    is its own step) and stopped before any evaluation: model_best.pt (the later best's weights) is rewritten
    from that step's checkpoint, and summary.json names that step; where that checkpoint is gone from the run
    (resumed from a copy), a line says so and no best is claimed (before: summary.json named the earlier step
    beside the later step's weights)."""
    flags = _keep_all_best(checkpoint_format)
    suffix = ".pt" if checkpoint_format == "single" else ""
    later_best = keep_all_best_step(checkpoint_format)
    run_dir = tmp_path / "run"
    stopped = launch(run_dir, *FP32_SGD, *flags, own_session=True, env={
        # loss calls: one a step, and the evaluations' batches (3 a rank, every 2 steps)
        "DDP_AMP_TEST_STOP_AT": str((later_best + 1) * 5 // 2), "DDP_AMP_TEST_STEP_SLEEP": "0.05"})
    assert stopped.returncode == 143, stopped.stderr
    assert read_summary(run_dir)["stopped_at_step"] > later_best == read_summary(run_dir)["best"]["step"]
    checkpoints = run_dir / "checkpoints"
    resumed_from = checkpoints / f"step-{later_best - 2}{suffix}"
    recorded = torch.load(resumed_from, weights_only=True)["trainer"]["best"] if suffix else \
        torch.load(resumed_from / "extras.pt", weights_only=True)["trainer"]["best"]
    assert recorded["step"] < later_best, recorded
    if not best_checkpoint_left:  # resumed from a copy elsewhere; the run's own pruned
        (tmp_path / "kept").mkdir()
        for name in (resumed_from.name, resumed_from.with_suffix(".json").name):
            (checkpoints / name).rename(tmp_path / "kept" / name)
        resumed_from = tmp_path / "kept" / resumed_from.name
    no_evaluation = [flag if flag != "2" or flags[i - 1] != "--eval-every" else "25" for i, flag in enumerate(flags)]
    stopped = launch(run_dir, *FP32_SGD, *no_evaluation, "--resume", str(resumed_from), own_session=True,
                     env={"DDP_AMP_TEST_STOP_AT": "1"})  # rank 0's first loss: stopped a step or two on
    assert stopped.returncode == 143, stopped.stderr
    summary = read_summary(run_dir)
    assert summary["stopped_at_step"] < 25
    model_best = torch.load(run_dir / "model_best.pt", weights_only=True)
    if best_checkpoint_left:
        assert f"model_best.pt rewritten from step {recorded['step']}'s checkpoint" in stopped.stderr
        assert summary["best"]["step"] == recorded["step"]
        weights = read_weights(checkpoints / f"step-{recorded['step']}{suffix}")
        assert model_best.keys() == weights.keys()
        assert all(torch.equal(model_best[key], weights[key]) for key in weights)
        assert_ok(run_cli("verify", str(run_dir)))
    else:
        assert f"does not hold step {recorded['step']}'s weights" in stopped.stderr, stopped.stderr
        assert "best" not in summary


def test_an_evaluation_a_stop_cut_short_runs_again_on_resume(tmp_path):
    """A SIGTERM inside the last step's evaluation: the run stops at that step with its checkpoint, and the
    resumed run evaluates that step first (before, it never was: no val_ line for it, summary.json's validation
    empty and --keep-best's choice made without it)."""
    run_dir = tmp_path / "run"
    args = ["--task", task("val_passes_optimum"), "--steps", "6", "--batch-size", "8", "--eval-every", "2",
            "--checkpoint-every", "2", "--keep-best", "val_loss", "--log-every", "2"]
    stopped = subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", *FP32_SGD, *args, "--run-dir",
                              str(run_dir)], capture_output=True, text=True, start_new_session=True,
                             # loss calls on rank 0: one a step, 3 an evaluation: the 13th is step 6's evaluation
                             env={**os.environ, "DDP_AMP_TEST_STOP_AT": "13"}, timeout=180)
    assert stopped.returncode == 143, stopped.stderr
    assert read_summary(run_dir)["stopped_at_step"] == 6
    assert [m["step"] for m in _metrics_lines(run_dir) if "val_loss" in m] == [2, 4]
    assert_ok(spawn(run_dir, *args, "--resume", "auto"))
    evaluations = [m for m in _metrics_lines(run_dir) if "val_loss" in m]
    assert [m["step"] for m in evaluations] == [2, 4, 6]
    summary = read_summary(run_dir)
    assert summary["validation"]["evaluations"] == 1
    assert summary["validation"]["val_loss"] == evaluations[-1]["val_loss"]
    best = min(evaluations, key=lambda m: m["val_loss"])
    assert summary["best"]["step"] == best["step"] and summary["best"]["value"] == best["val_loss"]


def test_keep_best_of_a_metric_the_evaluation_does_not_log_is_one_line_and_keeps_the_trained_weights(tmp_path):
    """Without --eval-every the first evaluation is the last step's: the run is refused there (exit 2), but the
    trained weights are written, not lost to the refusal."""
    result = spawn(tmp_path / "run", "--task", task("with_validation"), "--steps", "6", "--keep-best", "val_acc")
    assert result.returncode == 2, result.stderr
    verdict = last_line(result.stderr)
    assert "--keep-best val_acc" in verdict and "val_abs_error" in verdict and "Traceback" not in result.stderr
    assert verdict.endswith(f"no model_best.pt kept; the trained weights are in {tmp_path / 'run' / 'model.pt'}")
    assert read_summary(tmp_path / "run")["steps"] == 6 and (tmp_path / "run" / "model.pt").exists()
    assert not (tmp_path / "run" / "model_best.pt").exists()


TINY_LR = ["--optimizer", "sgd", "--momentum", "0", "--lr", "1e-30", "--steps", "1"]
"""One step that cannot move an fp32 weight: |lr x grad| is far below half an ulp of every weight."""


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


SIZED = ["--task", task("sized"), "--task-arg", "width=5"]


@pytest.fixture(scope="module")
def sized_run(tmp_path_factory) -> Path:
    """A finished run with a checkpoint, the weights to start from for the --init-from tests (none writes into it)."""
    run_dir = tmp_path_factory.mktemp("sized") / "source"
    assert_ok(spawn(run_dir, *SIZED, "--steps", "3", "--checkpoint-every", "3"))
    return run_dir


def test_init_from_every_format_starts_from_its_weights(tmp_path, sized_run):
    source, sized = sized_run, SIZED
    trained = load_weights(source)
    torch.save({f"module._orig_mod.{k}": v for k, v in trained.items()}, tmp_path / "wrapped.pt")  # DDP + compile
    exported = tmp_path / "exported.safetensors"
    assert_ok(run_cli("export", str(source), "-o", str(exported)))
    for name, path in [("model.pt", source / "model.pt"), ("checkpoint", source / "checkpoints" / "step-3.pt"),
                       ("prefixed", tmp_path / "wrapped.pt"), ("safetensors", exported)]:
        result = spawn(tmp_path / name, *sized, *TINY_LR, "--init-from", str(path))
        assert_ok(result)
        assert f"initial weights from {path}: 4 tensors" in result.stderr
        _assert_same_weights(load_weights(tmp_path / name), trained)
        assert read_summary(tmp_path / name)["init_from"]["loaded"] == 4


def test_init_from_not_strict_loads_what_matches_and_counts_the_rest(tmp_path):
    partial = tmp_path / "partial.pt"
    torch.manual_seed(0)
    torch.save({"0.weight": torch.randn(5, 8), "extra.weight": torch.zeros(2)}, partial)
    # Without --no-init-strict it is refused: tests/unit/test_launch_refusals.py.
    assert_ok(spawn(tmp_path / "loose", "--task", task("sized"), "--task-arg", "width=5", *TINY_LR,
                    "--init-from", str(partial), "--no-init-strict"))
    assert read_summary(tmp_path / "loose")["init_from"] == {"path": str(partial), "loaded": 1, "missing": 3,
                                                             "unexpected": 1, "used": True}
    assert torch.equal(load_weights(tmp_path / "loose")["0.weight"], torch.load(partial)["0.weight"])


def test_a_resumed_checkpoint_wins_over_init_from_and_says_so(tmp_path, sized_run):
    run_dir, other = tmp_path / "run", sized_run
    sized = [*SIZED, "--steps", "4", "--checkpoint-every", "2"]
    assert_ok(spawn(run_dir, *sized))
    (run_dir / "model.pt").unlink()
    (run_dir / "summary.json").unlink()
    result = spawn(run_dir, *sized, "--resume", "auto", "--init-from", str(other / "model.pt"))
    assert_ok(result)
    assert f"--init-from {other / 'model.pt'} is not used: --resume continues from" in result.stderr
    assert read_summary(run_dir)["init_from"]["used"] is False


def test_export_writes_a_state_dict_or_the_models_own_format(tmp_path, bert_run):
    run_dir = bert_run
    weights = load_weights(run_dir)
    from transformers import BertForSequenceClassification

    # At the end of training a Hugging Face model is also written by its own save_pretrained.
    _assert_same_weights(BertForSequenceClassification.from_pretrained(run_dir / "pretrained").state_dict(), weights)
    assert_ok(run_cli("export", str(run_dir), "-o", str(tmp_path / "w.pt"), "--hf", str(tmp_path / "hf")))
    _assert_same_weights(torch.load(tmp_path / "w.pt", weights_only=True), weights)
    _assert_same_weights(BertForSequenceClassification.from_pretrained(tmp_path / "hf").state_dict(), weights)
    # An existing output is never overwritten.
    again = run_cli("export", str(run_dir), "-o", str(tmp_path / "w.pt"))
    assert again.returncode == 2 and "already exists" in last_line(again.stderr)


def test_export_which_best_is_the_best_evaluation(tmp_path, keep_best_run):
    run_dir = keep_best_run
    out = tmp_path / "best.safetensors"
    assert_ok(run_cli("export", str(run_dir), "--which", "best", "-o", str(out)))
    from safetensors.torch import load_file

    _assert_same_weights(load_file(str(out)), torch.load(run_dir / "model_best.pt", weights_only=True))
    assert not torch.equal(load_file(str(out))["weight"], load_weights(run_dir)["weight"])


def test_a_stop_signal_during_an_evaluation_stops_there_with_that_steps_checkpoint(tmp_path):
    logs = tmp_path / "calls"
    logs.mkdir()
    run_dir = tmp_path / "run"
    stopped = subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", *FP32_SGD, "--task",
                              task("stops_in_evaluation"), "--steps", "20", "--batch-size", "4", "--eval-every", "4",
                              "--log-every", "1",
                              "--run-dir", str(run_dir)], capture_output=True, text=True, start_new_session=True,
                             env={**os.environ, "DDP_AMP_TEST_INDEX_LOG": str(logs)}, timeout=180)
    assert stopped.returncode == 143, stopped.stderr
    summary = read_summary(run_dir)
    assert summary["stopped_at_step"] == 4 and summary["checkpoint"].endswith("step-4.pt")
    assert (run_dir / "checkpoints" / "step-4.pt").exists()
    assert "stopped by SIGTERM at step 4" in last_line(stopped.stderr)
    calls = sum(len(p.read_text().split()) for p in logs.glob("metric-calls-*.txt"))
    assert calls < 2 * 25, calls  # neither rank finished its 25 batches
    assert not any("val_loss" in m for m in _metrics_lines(run_dir))  # an unfinished evaluation is not logged


def test_every_rank_starts_from_the_init_file(tmp_path):
    source = {f"net.{k}": v for k, v in (torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.ReLU(),
                                                             torch.nn.Linear(5, 1))).state_dict().items()}
    torch.save(source, tmp_path / "init.pt")
    assert_ok(spawn(tmp_path / "run", "--task", task("reports_start"), "--steps", "1", "--init-from",
                    str(tmp_path / "init.pt"), env={"DDP_AMP_TEST_INDEX_LOG": str(tmp_path)}))
    for rank in (0, 1):
        started = torch.load(tmp_path / f"start-{rank}.pt", weights_only=True)
        for key, value in started.items():
            assert torch.equal(value, source[f"net.{key}"]), (rank, key)


SLOW_IMPORT_TASK = '''
import os, time
from pathlib import Path
from ddp_amp.tasks import Task
if os.environ.get("DDP_AMP_TEST_IMPORT_MARK"):
    Path(os.environ["DDP_AMP_TEST_IMPORT_MARK"]).touch()
    time.sleep(60)
def build():
    raise AssertionError("never built: the launch is stopped while it imports the task")
'''


def test_a_stop_while_the_launch_starts_says_what_it_changed(tmp_path):
    """SIGTERM while the launcher imports the task (before the run dir is touched): exit 143 and one line
    saying that nothing was written; an earlier run under --overwrite is left whole."""
    import signal
    import time

    (tmp_path / "slow_task.py").write_text(SLOW_IMPORT_TASK)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "model.pt").write_bytes(b"an earlier run's weights")
    mark = tmp_path / "importing"
    process = subprocess.Popen([sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", "--device", "cpu", "--task",
                                f"{tmp_path / 'slow_task.py'}:build", "--run-dir", str(earlier), "--overwrite"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "DDP_AMP_TEST_IMPORT_MARK": str(mark)})
    deadline = time.monotonic() + 60
    while not mark.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert last_line(stderr) == ("ddp-amp: error: stopped by SIGTERM while the launch was starting, before any "
                                 "rank trained: nothing was written"), stderr
    assert (earlier / "model.pt").read_bytes() == b"an earlier run's weights"


def test_the_start_up_line_names_what_the_launch_had_changed():
    from ddp_amp.launch.preflight import changed_on_disk
    from ddp_amp.process import StopSignal

    assert StopSignal(15).startup == "nothing was written"  # a stop before the run directory was prepared
    assert changed_on_disk(Path("r"), created=True, cleared=False) == \
        "r was created, with this launch's config.json only"
    assert changed_on_disk(Path("r"), created=False, cleared=True) == \
        "--overwrite had already removed the earlier run's files in r"
    assert "nothing of an earlier run there was changed" in changed_on_disk(Path("r"), created=False, cleared=False)
