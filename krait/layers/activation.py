"""Activation functions by HF name."""

from __future__ import annotations

import torch

from krait.ops.activation import relu2, silu_and_mul


class SiluAndMul(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def get_act_fn(name: str):
    """Element-wise activation by its transformers name."""
    table = {
        "silu": torch.nn.functional.silu,
        "swish": torch.nn.functional.silu,
        "gelu": torch.nn.functional.gelu,
        "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        "relu": torch.relu,
        "relu2": relu2,
    }
    if name not in table:
        raise ValueError(f"hidden_act {name!r} is not supported ({', '.join(table)})")
    return table[name]
