"""--dtype fp8: torchao's float8 training (`convert_to_float8_training`), the recipe the precision names.

Each eligible nn.Linear becomes torchao's Float8Linear, which keeps its weight as it was (fp32) and casts the
input, the weight and the output's gradient to fp8 with dynamic scales for its three matmuls. Its state_dict has
nn.Linear's keys and dtypes, so checkpoints and model.pt hold the high-precision weights: a run resumes from
them in fp8 or in any other precision, and a plain model loads model.pt. torchao's kernels are fast under
--compile (its recommendation); eager fp8 runs, slower.
"""

from __future__ import annotations

from typing import Any

from torch import nn

FP8_ALIGNMENT = 16
"""fp8 matmuls need every dimension divisible by 16: a layer whose weight is not stays as it is; the tokens of a
batch (the inner dimension of the weight's gradient) are padded where they are not (torchao's pad_inner_dim),
so any --batch-size, a halved --micro-batch or a short last batch trains."""


OUTPUT_LAYER_NAMES = ("lm_head", "output")
"""The names of a model's output layer (Hugging Face's, torchtitan's): kept in high precision, as torchtitan
keeps its `output` (the logits' precision matters most to the loss, and the layer is one of many)."""


def fp8_eligible(module: nn.Module, _name: str = "") -> bool:
    return (isinstance(module, nn.Linear) and module.in_features % FP8_ALIGNMENT == 0
            and module.out_features % FP8_ALIGNMENT == 0)


def output_layers(model: nn.Module) -> list[str]:
    """The names of the model's output layers, which stay nn.Linear: a layer named as one, or whose weight is
    an embedding's (a tied output layer: the embedding reads the same weight, GPT-2's and most LMs')."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and (
        name.rsplit(".", 1)[-1] in OUTPUT_LAYER_NAMES or id(m.weight) in embeddings)]


def to_float8(module: nn.Module, recipe: str) -> nn.Module:
    """`module` with its eligible linear layers but the output layers converted in place to torchao's float8
    (`recipe`: tensorwise or rowwise)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    kept = set(output_layers(module))
    return convert_to_float8_training(module, config=config,
                                      module_filter_fn=lambda m, name: fp8_eligible(m) and name not in kept)


def fp8_summary(module: nn.Module, recipe: str) -> dict[str, Any]:
    """summary.json's fp8: the recipe, how many of the converted module's layers compute in fp8, and the output
    layers kept in high precision."""
    return {"recipe": recipe, "layers": sum(type(m).__name__ == "Float8Linear" for m in module.modules()),
            "output_layers_kept": output_layers(module)}
