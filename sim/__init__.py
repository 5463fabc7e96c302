"""The simulator: a schedule run on simpy (`sim.executor.simulate_times`); imports neither
real nor planners."""
