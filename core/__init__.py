"""The core: specs, routing, the schedule IR, cost model, trace and metrics, with no torch,
simpy or hydra import (tests/test_layering.py); each module says what it holds."""
