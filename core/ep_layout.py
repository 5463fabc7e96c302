"""The device layout of an expert-parallel schedule (`Schedule.ep`): how many devices, whether
they are GPUs or lanes of one GPU, how dense work and tokens are split, and each iteration's
expert placement. The replication planners write it; the validator, the simulator's balance
metrics, the bubble analysis and the real executor (one process or G) read it.

Usage:
    ep = schedule.ep                      # None: not an expert-parallel schedule
    ep.n_devices, ep.lanes, ep.placements[(step, batch, moe)]   # [G][K] expert ids, -1 empty
    summary["plan"]["ep"] = ep.summary()  # what summary.json records
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.dispatch import micro_batch_rows, micro_batch_seqs
from core.types import Dense, Dispatch, LaneSharing

# (step, batch, MoE layer index) -> per device its expert slots' ids (-1: empty)
Placements = dict[tuple[int, int, int], list[list[int]]]


@dataclass(frozen=True)
class EPLayout:
    n_devices: int  # G devices: GPUs, or lanes of one GPU
    lanes: bool  # True: the devices are lanes of one GPU (no all-to-all)
    lane_share: float | None = None  # lanes: each lane's share of the GPU (None on GPUs)
    replica_slots: int = 0  # extra expert slots per device per MoE layer
    replicas: int = 0  # redundant copies per layer placed
    slots_per_device: int = 0  # home + replica slots per device per MoE layer
    replica_gb: float = 0.0  # GB of replica slots over all devices
    grouped_gemm: bool = False  # one grouped-GEMM op per device and layer (simulator only)
    dense: Dense | None = Dense.DATA  # dense work over GPUs: data or tensor parallel (lanes: None)
    lane_sharing: LaneSharing | None = None  # lanes: partitioned or shared SMs (None on GPUs)
    dispatch: Dispatch = Dispatch.EVEN  # how a replicated expert's tokens split over its copies
    micro_batches: int = 1  # micro-batches per batch (2: two-batch overlap)
    copy_kernels: bool = False  # replica copies between GPUs run as kernels (NCCL p2p)
    copies: int = 0  # replica copies the run makes
    pairs_sent: tuple[int, ...] = ()  # per device, (token, expert) pairs sent to another one
    staging_bytes: int | None = None  # per GPU, bytes held for incoming replicas (None: none)
    prediction_tv: float | None = None  # predicting planners: mean TV of predicted load
    # every iteration's placement; filled while the planner plans (a live run reads it as it
    # grows), so it is one dict shared by every copy of the layout
    placements: Placements = field(default_factory=dict, compare=False, repr=False)

    @property
    def _splitters(self) -> int:
        """The GPUs whose shares of a batch its micro-batches split: each GPU its own
        (data-parallel), or the one batch every GPU holds whole (tensor-parallel)."""
        return 1 if self.dense == Dense.TENSOR else self.n_devices

    def micro_seqs(self, batch_size: int, device: int, micro: int) -> tuple[int, int]:
        """Sequences [s0, s1) of a batch that `device` runs micro-batch `micro` of (-1: its whole
        share; tensor-parallel: every device the same ones), `micro_batch_seqs`."""
        if self._splitters == 1:
            device = 0
        return micro_batch_seqs(batch_size, self._splitters, self.micro_batches, device, micro)

    def micro_rows(self, batch_size: int, micro: int, per: int) -> np.ndarray:
        """The rows of a batch's routing (`per` tokens a sequence) micro-batch `micro` holds."""
        return micro_batch_rows(batch_size, self._splitters, self.micro_batches, micro, per)

    def summary(self) -> dict[str, Any]:
        """The layout as summary.json's `plan.ep` (the placements are run data, left out)."""
        out: dict[str, Any] = dict(
            n_devices=self.n_devices,
            lanes=self.lanes,
            lane_share=self.lane_share,
            replica_slots=self.replica_slots,
            replicas=self.replicas,
            slots_per_device=self.slots_per_device,
            replica_gb=self.replica_gb,
            grouped_gemm=self.grouped_gemm,
            dense=None if self.dense is None else str(self.dense),
            lane_sharing=None if self.lane_sharing is None else str(self.lane_sharing),
            dispatch=str(self.dispatch),
            micro_batches=self.micro_batches,
            copy_kernels=self.copy_kernels,
            copies=self.copies,
            pairs_sent=list(self.pairs_sent),
        )
        if self.staging_bytes is not None:
            out["staging_bytes"] = self.staging_bytes
        if self.prediction_tv is not None:
            out["prediction_tv"] = self.prediction_tv
        return out
