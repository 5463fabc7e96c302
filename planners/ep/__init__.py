"""Expert-parallel execution shared by the replication planners (`ep_static`, `eplb`,
`predictive_replication`, `oracle_replication`): they differ only in which experts each device
holds for each (batch, layer): a `SlotPolicy`.

Setting: G compute devices, either G GPUs (`gpu`, `gpu:1`, ...; device d's NVLink is `p2p:d`
into it and `p2p_out:d` out of it, full duplex, each direction's transfers sharing its
bandwidth: a simulator pool) or G concurrent lanes on one GPU (`lanes=True`:
no dispatch/combine traffic; lane d runs on `lane{d}`, by default a partition of 1/G of the
GPU's SMs and memory bandwidth, so the lanes together have one GPU's capacity: `lane_share`; or,
`lane_sharing="shared"`, as plain CUDA streams whose kernels share the SMs, each up to what its
thread blocks fill: a simulator pool, which the replica gate weighs with `pool_makespan_s`).
Every device holds `slots_per_device` expert copies per MoE layer; all weights stay resident. Dense work (attention, gate, shared experts,
head) is data-parallel over the G GPUs, each running (and gating) its contiguous share of the
batch's sequences, or tensor-parallel (`dense`: every GPU runs every token on 1/G of the weights,
partial sums all-reduced); on lanes it runs as whole-GPU kernels on `compute`, between the lanes'
expert phases. At each MoE layer the tokens are dispatched to the devices holding their experts
(the pairs of each GPU's sequences leave by its `p2p_out:d`, the pairs it computes arrive by
its `p2p:d`, as `core.dispatch.traffic` counts them; tensor-parallel: every GPU has them), a
replicated expert's tokens split evenly over its copies (`dispatch="balanced"`: over the devices
holding it so that the busiest holds the fewest tokens, `balanced_split`), and results are
combined back (all-reduced), so a layer lasts as long as its busiest device.
A device's expert work in a layer is ONE grouped-GEMM op (`grouped_gemm=True`, how vLLM/SGLang's
fused MoE and DeepEP + DeepGEMM run it): roofline of its total tokens x expert flops and the bytes
of the distinct experts it touches, plus one launch overhead; `grouped_gemm=False` emits one op
per (device, expert) as an eager per-expert loop does (docs/replication-model.md).
A copy whose expert changes is refilled from a device holding it (`copy_moves`: into `p2p:d`
and out of the source's `p2p_out`; on lanes within the GPU's memory, `d2d`) after the slot's
previous user is done and once the policy's information exists: behind earlier layers, not on
the critical path unless it is late. Iteration t = (step, batch).
"""
