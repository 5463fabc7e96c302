"""The expert-parallel machinery's names in one place, for callers that import them from here;
it lives in planners/ep/ (params, cost, placement, runner)."""

from core.dispatch import (  # noqa: F401
    DENSE,
    DISPATCH,
    balanced_split,
    copies_sent,
    copy_moves,
    micro_batch_rows,
    micro_batch_seqs,
    source_counts,
    split_tokens,
    times_held,
    traffic,
    water_fill_level,
    whole_tokens,
)
from planners.ep.cost import (  # noqa: F401
    ExpertTime,
    expert_width,
    expert_widths,
    new_copies,
    predicted_tokens,
)
from planners.ep.params import (  # noqa: F401
    GATES,
    LANE_SHARING,
    EPParams,
    Layout,
    ReplicaParams,
    resolve_layout,
)
from planners.ep.placement import (  # noqa: F401
    PredictionError,
    Replicator,
    home_slots,
    polish,
    read_load,
    read_npy,
    replicate_onto,
    swap_homes,
)
from planners.ep.runner import POOL, EPRunner, SlotPolicy  # noqa: F401
