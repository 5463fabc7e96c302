"""The CPU-only executor's compute thread count is measured: one of every core, every core but
one, or one, and torch's own thread count is left as it was."""

import os

import torch

from real.interpreter import cpu_compute_threads


def test_measured_count_is_a_candidate_and_restores_torch():
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    n = cpu_compute_threads.__wrapped__(reps=3)  # a fresh measurement, not the process's memo
    assert n in {cores, max(1, cores - 1), 1}
    assert torch.get_num_threads() == before
    assert cpu_compute_threads() == cpu_compute_threads()  # measured once a process
