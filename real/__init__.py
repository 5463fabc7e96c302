"""The real executor: the PyTorch MoE model, checkpoints, the tiered weight store and the
interpreter that runs a schedule on them (`real.executor.Executor`); imports neither sim nor
planners."""
