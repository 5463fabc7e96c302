"""Expert-parallel execution shared by the replication planners (`ep_static`, `eplb`,
`predictive_replication`, `oracle_replication`): they differ only in which experts each device
holds for each (batch, layer), a `SlotPolicy`; this package emits the rest (dense work, dispatch,
one grouped-GEMM expert op per device, combine, replica copies) on G GPUs or G lanes of one GPU.
The setting and its cost model: docs/replication-model.md#the-setting.
"""
