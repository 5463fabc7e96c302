"""A shared expert of width 0 in a checkpoint: transformers saves one where config.json sizes
none (Qwen2-MoE's shared_expert_intermediate_size 0, DeepSeek-V2's n_shared_experts 0), which
adds exactly 0 unless it holds a bias of elements (DeepSeek-V2's mlp_bias).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from core.errors import ConfigError, quoted
from core.spec import ModelSpec
from real.shards import TensorEntry

# a layer's shared expert(s) (Qwen2-MoE's with its sigmoid gate); group 2: one of its projections
_SHARED = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_experts?(\.\w+_proj\.weight$)?")


def empty_shared(spec: ModelSpec, listed: list[str], index: Mapping[str, TensorEntry]) -> set[str]:
    """The shared-expert tensors of layers whose shared projections hold no elements, where
    config.json sizes none: transformers saves one of width 0 for Qwen2-MoE's
    shared_expert_intermediate_size 0 and DeepSeek-V2's n_shared_experts 0; it adds exactly 0,
    but for a bias of elements (mlp_bias), refused in one line."""
    shared = {n: m for n in listed if not spec.shared_ffn_size and (m := _SHARED.match(n))}
    held = {int(m[1]) for n, m in shared.items() if m[2] and math.prod(index[n].shape)}
    zero = {int(m[1]) for m in shared.values() if m[2]} - held
    empty = {n for n, m in shared.items() if int(m[1]) in zero}
    # a bias of elements (DeepSeek-V2's mlp_bias: down_proj's) is added even at width 0
    added = sorted(n for n in empty if n.endswith(".bias") and math.prod(index[n].shape))
    if added:
        raise ConfigError(
            f"{index[added[0]].file.parent / 'config.json'}: the shared expert of width 0 holds "
            f"bias {quoted(added[0])}, which transformers adds to every token (mlp_bias=true "
            "with n_shared_experts=0); moepipe runs no such bias-only expert: use a checkpoint "
            "with n_shared_experts >= 1 or mlp_bias false"
        )
    return empty
