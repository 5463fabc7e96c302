"""What tests/conftest.py does for every test process of the session, beside the fixtures."""

from __future__ import annotations

import gc


def test_what_the_process_held_once_it_collected_is_frozen_out_of_the_collector() -> None:
    """The modules and collected tests (70,000 objects for this file alone) are not walked again
    by each collection the tests' own garbage sets off (`pytest_collection_finish`)."""
    assert gc.isenabled()
    assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()
