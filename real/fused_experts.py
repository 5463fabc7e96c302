"""Experts saved fused, as transformers' own modules hold them (`save_pretrained(...,
save_original_format=False)`, which transformers loads as they are): a MoE layer's
`mlp.experts.gate_up_proj` [E, 2F, H] (each expert's gate rows, then its up rows) and
`mlp.experts.down_proj` [E, H, F], and Mixtral's router as `mlp.gate`. Each expert's matrices
are consecutive bytes of those tensors, so the checkpoint's index gets an entry per expert
matrix under the per-expert names, and every reader (the reference, the tiered store) reads
them as any other tensor.

Usage: `listed = unfuse_experts(d, spec, names, index, listed)` in `load_checkpoint`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from core.errors import ConfigError, quoted
from core.spec import ModelSpec
from real.shards import AT_ODDS, TensorEntry

_FUSED = "model.layers.{i}.mlp.experts."
_ROUTER = "model.layers.{i}.mlp.gate.weight"  # Mixtral's router in transformers' modules


def unfuse_experts(
    d: Path, spec: ModelSpec, names: Any, index: dict[str, TensorEntry], listed: list[str]
) -> list[str]:
    """Add to `index` each fused MoE layer's per-expert entries (names: real.hf_names.HFNames) and
    return the checkpoint's tensor list with them in place of the fused tensors; a ConfigError
    naming a fused tensor without its pair, of another shape, or beside per-expert ones."""
    gone: set[str] = set()
    added: list[str] = []
    for layer in spec.moe_layers:
        gate_up, down = (_FUSED.format(i=layer) + m for m in ("gate_up_proj", "down_proj"))
        if gate_up not in index and down not in index:
            continue
        have, lack = (gate_up, down) if gate_up in index else (down, gate_up)
        if lack not in index:
            raise ConfigError(
                f"{d}: tensor {quoted(have)} is in the checkpoint without {quoted(lack)}"
            )
        e, f, h = spec.n_experts, spec.expert_ffn_size, spec.hidden_size
        for name, shape in ((gate_up, (e, 2 * f, h)), (down, (e, h, f))):
            if index[name].shape != shape:
                raise ConfigError(
                    f"{index[name].file}: tensor {quoted(name)} has shape "
                    f"{list(index[name].shape)}, config.json expects {list(shape)}; {AT_ODDS}"
                )
        whole_gate_up, whole_down = index[gate_up], index[down]
        mat = f * h * whole_gate_up.dtype.itemsize  # bytes of one [F, H] or [H, F] matrix
        for x in range(e):
            gu, dn = whole_gate_up.offset, whole_down.offset
            parts = {  # gate rows, then up rows, of expert x; its down matrix
                "w1": replace(whole_gate_up, shape=(f, h), offset=gu + 2 * x * mat, nbytes=mat),
                "w3": replace(
                    whole_gate_up, shape=(f, h), offset=gu + (2 * x + 1) * mat, nbytes=mat
                ),
                "w2": replace(whole_down, shape=(h, f), offset=dn + x * mat, nbytes=mat),
            }
            for key, entry in parts.items():
                name = names.expert.format(i=layer, e=x, w=names.expert_mats[key])
                if name in index:
                    raise ConfigError(
                        f"{d}: holds layer {layer}'s experts twice, as {quoted(gate_up)} and as "
                        f"{quoted(name)}; "
                        "keep one of them"
                    )
                index[name] = entry
                added.append(name)
        gone |= {gate_up, down}
        router, own = _ROUTER.format(i=layer), names.router.format(i=layer)
        if router != own and router in index and own not in index:
            index[own] = index.pop(router)
            gone.add(router)
            added.append(own)
    return [n for n in listed if n not in gone] + added
