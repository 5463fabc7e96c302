"""Round 25b of issue 48: round 24's named leftovers, one class a test group:

2. make_checkpoint's `scale` refused only a value that made every weight subnormal or 0: one
   leaving most of them subnormal (fewer bits of precision) was written with exit 0. Now a
   scale leaving more than 1 in 10 of the narrowest-drawn tensor's weights subnormal is
   refused, naming the range that works; `rms_norm_eps` below float32's smallest normal number
   (0 or subnormal where RMSNorm runs) too.
"""

from __future__ import annotations

import pytest

from experiments.make_checkpoint import check_scale, check_usable
from real.checkpoint import reduced_spec
from tests.probes.conftest import raises_one_line

# --- 2. make_checkpoint's numeric options that lose precision ---


@pytest.mark.parametrize(
    ("model", "scale"),
    [
        ("mixtral-tiny", 1e-36),  # float32: most of w2's weights (std 2.2e-38) subnormal
        ("tiny", 1e-36),  # bfloat16
        ("tiny", 1e300),  # overflow: the same range named
    ],
)
def test_a_scale_leaving_most_weights_subnormal_is_refused_with_its_range(
    model: str, scale: float
) -> None:
    line = raises_one_line(lambda: check_scale(reduced_spec(model), scale), f"scale={scale:g}")
    low, high = map(float, line.rpartition("pass scale in [")[2].rstrip("]").split(", "))
    for edge in (low, 1.0, high):  # the range named works at both ends
        check_scale(reduced_spec(model), edge)


@pytest.mark.parametrize("dtype", [{"float16": True}, {}])
def test_the_default_scale_is_taken_by_a_full_size_model(dtype: dict[str, bool]) -> None:
    """Mixtral-8x7B's w2 (fan-in 14336, 32 layers) draws with std 1e-3: in float16 (smallest
    normal 6.1e-5) 4% of its weights are subnormal at scale 1, as in the real model's."""
    check_scale(reduced_spec("mixtral-8x7b", **dtype), 1.0)


@pytest.mark.parametrize("eps", [1e-300, 1e-40])
def test_an_rms_norm_eps_float32_cannot_hold_is_refused(eps: float) -> None:
    spec = reduced_spec("mixtral-tiny", rms_norm_eps=eps)
    raises_one_line(lambda: check_usable(spec), "rms_norm_eps=", "in [1.18e-38, 3.4e+38]")
