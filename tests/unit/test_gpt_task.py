"""The built-in `gpt` task: its sizes are what they say (GPT-2 small and medium), its FLOP count is nanoGPT's,
its tokens have structure to learn, and a size it does not have is refused in one line before any launch. Its
training with real ranks: tests/system/test_utilisation_runs.py."""

import math

import pytest
import torch
from helpers import one_line, run_main

from ddp_amp.tasks.gpt import GPT, SIZES, build, token_walks


@pytest.mark.parametrize(("size", "millions"), [("124m", 124.4), ("350m", 354.8)])
def test_the_accelerator_sizes_are_gpt2_small_and_medium(size, millions):
    config = SIZES[size]
    with torch.device("meta"):  # no storage: the shapes alone
        model = GPT(config)
    counted = sum(p.numel() for p in model.parameters())  # the tied output layer once
    assert counted == config.parameters()
    assert counted / 1e6 == pytest.approx(millions, abs=0.1)
    # nanoGPT's estimate_mfu: 6 N (no position embedding) + 12 L d T per token
    assert config.flops_per_token() == 6 * (counted - config.context * config.width) + \
        12 * config.layers * config.width * config.context


def test_the_output_layer_is_the_token_embedding():
    model = GPT(SIZES["tiny"])
    assert model.head.weight is model.tok.weight


def test_the_tokens_follow_the_walk_and_its_entropy_is_the_floor():
    config = SIZES["tiny"]
    (walks,), entropy = token_walks(config, 64)
    steps = (walks[:, 1:] - walks[:, :-1]) % config.vocab
    offsets = steps.unique()
    assert len(offsets) <= 4  # each token is the one before plus one of 4 offsets
    shares = torch.stack([(steps == offset).float().mean() for offset in offsets])
    assert -(shares * shares.log()).sum().item() == pytest.approx(entropy, abs=0.02)
    assert entropy < math.log(4) < math.log(config.vocab)


def test_the_default_size_describes_itself():
    task = build()
    assert task.items_per_sample == 128 and task.item_name == "tokens"
    assert task.description.startswith("GPT-2-style decoder, size tiny: ")
    assert task.flops_per_item == SIZES["tiny"].flops_per_token()


def test_a_size_it_does_not_have_is_one_line_and_launches_nothing(tmp_path, capsys):
    code, _, err = run_main(["spawn", "-n", "1", "--device", "cpu", "--task", "gpt", "--task-arg", "size=1b",
                             "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert one_line(err) == "ddp-amp: error: --task-arg size='1b' is not one of tiny, 124m, 350m (build's size)"
    assert not (tmp_path / "run").exists()


def test_the_transformer_tasks_flops_are_its_matmuls():
    """torch's FlopCounterMode on one training step of the transformer task, plus the attention a CPU's
    scaled_dot_product_attention hides from it (12 L d T) and 6 FLOPs per bias and norm weight: the task's own
    count, within 0.1%. Its embeddings do no matmul (the output layer is a layer of its own): counted, they put
    the figure, and the MFU with it, 4.6% high."""
    from torch.utils.flop_counter import FlopCounterMode

    from ddp_amp.tasks import transformer

    task = transformer.build()
    tokens, targets = task.dataset[:2]
    with FlopCounterMode(display=False) as counter:
        task.loss_fn(task.model(tokens), targets).backward()
    per_token = counter.get_total_flops() / tokens.numel()
    attention = 12 * transformer.LAYERS * transformer.D_MODEL * transformer.SEQ_LEN
    small = sum(p.numel() for name, p in task.model.named_parameters() if p.dim() == 1)  # biases, norms
    assert task.flops_per_item == pytest.approx(per_token + attention + 6 * small, rel=1e-3)
