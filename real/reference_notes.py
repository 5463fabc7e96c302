"""Where a checkpoint's field makes transformers' class and DeepSeek's own modeling code run
differently, the reference moepipe follows for each family (docs/commands.md), and the
warning a load logs naming the field, once a process.
"""

from __future__ import annotations

import functools
import logging

from core.hf_config import HFConfig
from core.spec import ModelSpec

log = logging.getLogger(__name__)

# moe_layer_freq > 1, where DeepSeek's modeling_deepseek.py (V2 and V3 alike) leaves the layers
# between MoE layers dense and transformers' classes ignore it: each family's stated reference
_FREQ_REFERENCE = {
    "deepseek_v2": "moepipe leaves the layers between MoE layers dense as DeepSeek's "
    "modeling_deepseek.py does; transformers' DeepseekV2 class ignores the field, so its "
    "logits differ",
    "deepseek_v3": "moepipe ignores it as transformers' DeepseekV3 class does (every layer "
    "from first_k_dense_replace on is MoE); DeepSeek's modeling_deepseek.py leaves the layers "
    "between dense, so its logits differ",
}
# DeepSeek-V3's router fields transformers' class does not have (it always runs these values)
# and DeepSeek's modeling_deepseek.py refuses at any other value
_V3_ONLY = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


@functools.cache
def _warn_once(message: str) -> None:
    """A warning about a checkpoint, logged once a process (every forward reloads the model)."""
    log.warning(message)


def warn_where_references_differ(cfg: HFConfig, spec: ModelSpec, renormalize: bool) -> None:
    """DeepSeek-V2 follows DeepSeek's modeling_deepseek.py where transformers' class drops a
    field (norm_topk_prob, moe_layer_freq), DeepSeek-V3 transformers' class (moe_layer_freq,
    scoring_func, topk_method): a warning where the value makes the two differ."""
    if spec.family == "deepseek_v2" and renormalize and spec.top_k > 1:
        _warn_once(
            f"{cfg.where}: norm_topk_prob is true: moepipe renormalises DeepSeek-V2's top-k "
            "router weights as DeepSeek's modeling_deepseek.py does; transformers' "
            "DeepseekV2 class ignores the field, so its logits differ from these"
        )
    if cfg.get("moe_layer_freq", 1) != 1 and spec.family in _FREQ_REFERENCE:
        _warn_once(
            f"{cfg.where}: moe_layer_freq is {cfg.get('moe_layer_freq')}: "
            + _FREQ_REFERENCE[spec.family]
        )
    for key, only in _V3_ONLY.items() if spec.family == "deepseek_v3" else ():
        if cfg.get(key, only) != only:
            _warn_once(
                f"{cfg.where}: {key}={cfg.get(key)!r}: moepipe ignores it as transformers' "
                f"DeepseekV3 class does (sigmoid scores, noaux_tc's groups); DeepSeek's "
                f"modeling_deepseek.py implements {key} {only!r} alone"
            )
