"""What the commands share: the hydra app wrapper, schemas, the run pipeline and the real-run wiring."""
