"""torchrun helper of test_copies_overlap_the_layers_before_theirs: runs `ep_generate` on a
placement that moves every MoE layer's experts at every step and writes, per rank, the order of
copy waits (with the layers whose copies are in flight then) and MoE layers to argv[2]."""

import json
import sys

import torch
import torch.distributed as dist

import real.distributed as rd
from real.checkpoint import load_checkpoint


def main(ckpt: str, out: str) -> None:
    log: list[list] = []
    finish, moe = rd.EPRank.finish_moves, rd.EPRank.start_moe

    post, inside = dist.batch_isend_irecv, [False]

    class LoggedWork:  # a copy waited for outside `finish_moves` did not overlap anything
        def __init__(self, work: dist.Work) -> None:
            self.work = work

        def wait(self) -> bool:
            if not inside[0]:
                log.append(["early wait"])
            return self.work.wait()

    def logged_post(ops: list[dist.P2POp]) -> list[LoggedWork]:
        return [LoggedWork(w) for w in post(ops)]

    def logged_finish(self: rd.EPRank, layer: int) -> None:
        if layer in self.pending:
            log.append(["wait", layer, sorted(self.pending)])
        inside[0] = True
        finish(self, layer)
        inside[0] = False

    def logged_moe(self: rd.EPRank, step: int, layer: int, *args):  # type: ignore[no-untyped-def]
        log.append(["moe", step, layer])
        return moe(self, step, layer, *args)

    rd.EPRank.finish_moves, rd.EPRank.start_moe = logged_finish, logged_moe  # type: ignore[method-assign]
    dist.batch_isend_irecv = logged_post  # type: ignore[assignment]
    dist.init_process_group("gloo")
    spec = load_checkpoint(ckpt)[0]
    e, g, gen = spec.n_experts, dist.get_world_size(), 3
    # the experts rotate over the ranks: every MoE layer moves at every step
    placement = [[[sorted((x + step) % e for x in range(r, e, g)) for r in range(g)]
                  for _ in spec.moe_layers] for step in range(gen)]  # fmt: skip
    prompts = torch.randint(0, spec.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    rd.ep_generate(ckpt, spec, prompts, gen, placement)
    logs: list = [None] * g
    dist.all_gather_object(logs, log)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(logs, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
