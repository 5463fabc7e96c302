"""What the planners that load a layer's experts whole (sequential, layer_prefetch, flexgen,
zero_inference) share: releasing the experts its batches do not run, at the gate that says so.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from core.types import Tensor
from planners.common import Emitter


def free_unrouted(
    em: Emitter,
    step: int,
    layer: int,
    counts: np.ndarray,
    loads: Mapping[int, int | None],
    gate: int,
    used: Mapping[int, int] | None = None,
) -> list[int]:
    """Release the GPU copy of each expert of a layer loaded whole that `gate`'s batch does
    not run (`counts[e]` 0), once the gate has said so (and after its last use in an earlier
    batch, `used`): right after the gate, not after the experts run before it in index order
    (each one was held past its last use for them). Returns the free ops."""
    frees = []
    for e, load in loads.items():
        if not counts[e]:
            op = em.free(Tensor.EXPERT, step, layer, ((used or {}).get(e, gate), load), expert=e)
            frees += [] if op is None else [op]
    return frees
