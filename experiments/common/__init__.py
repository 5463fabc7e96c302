"""What the commands share: the hydra app wrapper, schemas, run pipeline and real-run wiring."""
