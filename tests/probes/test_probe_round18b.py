"""Probe round 18b (issue 48): the real, distributed and checkpoint commands.

`python -m experiments.torchrun`: two launches of one --rdzv_id at one --rdzv_endpoint ended the
second in an internal error (torch's RendezvousConnectionError once the first's store went);
it is one line naming the id and endpoint. A --rdzv_conf key the chosen backend does not read
(c10d's `timeout`, a typo of join_timeout, static's `rank`) and a TORCHELASTIC_SIGNALS_TO_HANDLE
name that is no signal were accepted without a word (torch logged the latter in the agent's
hidden log): each is one line before any rank starts. Two --standalone launches, and two of one
--master_port (the second's one line: round 16b), are as designed.

A checkpoint run in another dtype than it was saved in (executor.dtype=float32 on bfloat16
weights, bfloat16 on float32): the planners and the simulator counted an expert's disk read at
the compute dtype's bytes, the executor read the saved ones; each disk read is the saved bytes
now (`ModelSpec.disk_dtype_bytes`), as it was for FP8.

Switch in float16 under executor.distributed: transformers decides its clamp over the whole
batch; each rank decided over its own sequences and the split went unsaid. Each rank's flags
are gathered with its results and rank 0 warns as a single process does.
"""

from __future__ import annotations

import pytest

from experiments import torchrun
from tests.probes.conftest import raises_one_line

RUN = ["-m", "experiments.run", "executor=real"]


@pytest.fixture
def launcher_env(monkeypatch):
    """torchrun's agent log left as it is (LOGLEVEL set): the test process's logging kept."""
    monkeypatch.setenv("LOGLEVEL", "WARNING")


# --- 1. the torchrun launcher: keys and names nothing reads, two launches of one rendezvous ---


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--rdzv_conf=foo=1"], ["foo is no key", "static", "timeout"]),
        (["--rdzv_conf=rank=1"], ["rank is no key of the static"]),
        (["--standalone", "--rdzv_conf=timeout=60"], ["c10d", "did you mean 'join_timeout'"]),
        (
            ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:1", "--rdzv_conf=join_timout=5"],
            ["join_timout is no key", "did you mean 'join_timeout'"],
        ),
        (["--rdzv_backend=etcd", "--rdzv_conf=store_type=tcp"], ["etcd rendezvous", "cacert"]),
        (["--rdzv_backend=etcd-v2", "--rdzv_conf=cert=x"], ["cert is no key", "ssl_cert"]),
    ],
)
def test_a_rdzv_conf_key_the_backend_ignores_is_one_line(argv, names, launcher_env):
    raises_one_line(lambda: torchrun.main([*argv, *RUN]), "--rdzv_conf=", *names)


@pytest.mark.parametrize("names", ["SIGFOO", "SIGTERM,SIGFOO", "SIGTERM,", "SIGKILL", "SIG_DFL"])
def test_a_signal_to_handle_that_is_no_signal_is_one_line(names, launcher_env, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", names)
    raises_one_line(lambda: torchrun.main(RUN), f"TORCHELASTIC_SIGNALS_TO_HANDLE={names}")


@pytest.mark.parametrize(
    "error", ["RendezvousConnectionError", "RendezvousClosedError", "RendezvousTimeoutError"]
)
def test_a_failed_rendezvous_names_its_id_and_endpoint(error, launcher_env, monkeypatch):
    """A second launch of one --rdzv_id at one --rdzv_endpoint (the first's store gone with
    it): torch's RendezvousConnectionError was an internal error."""
    from torch.distributed.elastic.rendezvous import api

    def failed(args):
        raise getattr(api, error)("The connection to the C10d store has failed.")

    monkeypatch.setattr("torch.distributed.run.run", failed)
    argv = ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:29533", "--rdzv_id=same", *RUN]
    raises_one_line(lambda: torchrun.main(argv), "--rdzv_id=same", "localhost:29533", "own")
