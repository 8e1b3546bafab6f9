"""--dtype fp8: torchao's float8 training (`convert_to_float8_training`), the recipe the precision names.

Each eligible nn.Linear becomes torchao's Float8Linear, which keeps its weight as it was (fp32) and casts the
input, the weight and the output's gradient to fp8 with dynamic scales for its three matmuls. Its state_dict has
nn.Linear's keys and dtypes, so checkpoints and model.pt hold the high-precision weights: a run resumes from
them in fp8 or in any other precision, and a plain model loads model.pt. torchao's kernels are fast under
--compile (its recommendation); eager fp8 runs, slower.
"""

from __future__ import annotations

from torch import nn

FP8_ALIGNMENT = 16
"""fp8 matmuls need every dimension divisible by 16: a layer whose weight is not stays as it is; the tokens of a
batch (the inner dimension of the weight's gradient) are padded where they are not (torchao's pad_inner_dim),
so any --batch-size, a halved --micro-batch or a short last batch trains."""


def fp8_eligible(module: nn.Module, _name: str = "") -> bool:
    return (isinstance(module, nn.Linear) and module.in_features % FP8_ALIGNMENT == 0
            and module.out_features % FP8_ALIGNMENT == 0)


def to_float8(module: nn.Module, recipe: str) -> nn.Module:
    """`module` with its eligible linear layers converted in place to torchao's float8 (`recipe`: tensorwise or
    rowwise). Tied weights stay tied (a converted layer keeps its Parameter object)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    return convert_to_float8_training(module, config=config, module_filter_fn=fp8_eligible)


def float8_layers(module: nn.Module) -> int:
    """How many of the module's layers compute in fp8 (summary.json's fp8.layers)."""
    return sum(type(m).__name__ == "Float8Linear" for m in module.modules())
