"""torchrun helper of test_ep_static_two_ranks_match_reference (routing=live): runs
`experiments.ep_run` with argv[1:], each rank leaving `live_routing.<rank>` in its out dir when
it runs the live routing's reference forward (the whole model), so the test counts the ranks
that loaded it."""

import os
import sys
from pathlib import Path

import experiments.ep_run as ep_run

if __name__ == "__main__":
    argv = sys.argv[1:]
    out = Path(next(a for a in argv if a.startswith("out=")).split("=", 1)[1])
    reference = ep_run.live_routing

    def counted(*args, **kw):  # type: ignore[no-untyped-def]
        out.mkdir(parents=True, exist_ok=True)
        (out / f"live_routing.{os.environ['RANK']}").touch()
        return reference(*args, **kw)

    ep_run.live_routing = counted  # type: ignore[assignment]
    sys.exit(ep_run.main(argv))
