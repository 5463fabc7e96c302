"""The FFN activations config.json's hidden_act (Switch: dense_act_fn) names, each computed as
transformers' ACT2FN module computes it, op for op, so bfloat16 rounds as transformers does.
core.hf_config.runtime's GATED_ACTS lists the names; LEARNED_ACTS those refused.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation, op for op (its tanh approximation in Python)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """transformers' FastGELUActivation, op for op."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_python(x: torch.Tensor) -> torch.Tensor:
    """transformers' GELUActivation(use_gelu_python=True), op for op."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_python_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' GELUTanh(use_gelu_tanh_python=True), op for op."""
    return x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


def _gelu_accurate(x: torch.Tensor) -> torch.Tensor:
    """transformers' AccurateGELUActivation, op for op."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))


def _laplace(x: torch.Tensor) -> torch.Tensor:
    """transformers' LaplaceActivation (mu 0.707107, sigma 0.282095), op for op."""
    return 0.5 * (1.0 + torch.erf((x - 0.707107).div(0.282095 * math.sqrt(2.0))))


# config.json's hidden_act -> the function transformers' ACT2FN computes for it (GATED_ACTS)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": _gelu_new,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10, 10),  # ClippedGELUActivation
    "gelu_accurate": _gelu_accurate,
    "gelu_fast": _gelu_fast,
    "gelu_python": _gelu_python,
    "gelu_python_tanh": _gelu_python_tanh,
    "hardswish": F.hardswish,
    "laplace": _laplace,
    "leaky_relu": F.leaky_relu,  # nn.LeakyReLU's slope, 0.01
    "linear": lambda x: x,
    "mish": F.mish,
    "relu2": lambda x: torch.square(F.relu(x)),  # ReLUSquaredActivation
    "relu6": F.relu6,
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
}
