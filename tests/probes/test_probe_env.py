"""Environment variables a run reads through its libraries: a value they refuse is one line
naming the variable, not an internal error."""

from __future__ import annotations

import pytest

from experiments.common.cli import error_line


def test_a_torch_variable_torch_refuses_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_LOGS=bogus (or TORCH_DISTRIBUTED_DEBUG=bogus) made every real run an "internal
    error": torch raises ValueError as it loads. One line names the variable and its value;
    the same error raised by our own code stays a bug's."""
    from torch._logging._internal import _parse_log_settings

    monkeypatch.setenv("TORCH_LOGS", "bogus")
    with pytest.raises(ValueError) as info:
        _parse_log_settings("bogus")  # what `import torch` runs on TORCH_LOGS
    line = error_line(info.value)
    assert line is not None and "\n" not in line
    assert "TORCH_LOGS='bogus'" in line and "unset it" in line
    assert error_line(ValueError("TORCH_LOGS is bad")) is None
