"""One decode step of 60 sequences (15 batches of 4) of a Mixtral checkpoint, every weight in RAM:
transformers' forward, moepipe's forward over all 60, Klotski's order (gates per batch, each
expert once over all 60) with attention per batch and with one attention call over the group,
and the attention calls alone. Medians (and minima) of interleaved reps; outputs checked equal.

Usage (from the repository root):
    python -m scripts.decode_step_timing CHECKPOINT_DIR [reps=7] [threads=2]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from transformers import MixtralForCausalLM

from core.types import Tensor
from real.checkpoint import Unit
from real.model import (
    KVCache,
    Model,
    expert_tokens,
    forward_step,
    load_units,
    moe_output,
    new_slots,
    put_expert,
)

N, B, P = 15, 4, 16  # batches, sequences per batch, prompt tokens


def time_cases(cases: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Each case's seconds over `reps` rounds (the cases interleaved), after one warm-up each."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for f in cases.values():
        f()
    for _ in range(reps):
        for k, f in cases.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return times


def main(ckpt: str, reps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    spec, units = load_units(ckpt)
    model = Model.from_checkpoint(ckpt, spec)
    prompts = torch.randint(
        0, spec.vocab_size, (N * B, P), generator=torch.Generator().manual_seed(0)
    )
    kv = KVCache.allocate(spec, N * B, P + 4)
    with torch.inference_mode():
        logits, _, _ = forward_step(model, units, prompts, kv, 0)
    nxt = logits.argmax(-1)[:, None]  # [N*B, 1]
    pos = torch.arange(P, P + 1)

    def own(layer: int, k: int) -> KVCache:
        rows = slice(k * B, (k + 1) * B)
        return KVCache(
            tuple(
                tuple(t[rows] for t in lay) if i == layer else () for i, lay in enumerate(kv.layers)
            )
        )

    def attention(layer: int, h: torch.Tensor, merged: bool) -> torch.Tensor:
        w = units[Unit(Tensor.ATTENTION, layer)]
        if merged:
            return model.attention(layer, w, h, kv, pos)
        return torch.cat(
            [
                model.attention(layer, w, h[k * B : (k + 1) * B], own(layer, k), pos)
                for k in range(N)
            ]
        )

    def klotski(merged: bool) -> torch.Tensor:
        h = model.embed(units[Unit(Tensor.EMBED)], nxt)  # [N*B, 1, H]
        for layer in range(spec.n_layers):
            h = attention(layer, h, merged)
            gw = units[Unit(Tensor.GATE, layer)]
            parts = [model.gate(layer, gw, h[k * B : (k + 1) * B]) for k in range(N)]
            normed, ids, wts = (torch.cat([p[i] for p in parts]) for i in range(3))
            slots = new_slots(normed, spec.top_k)
            for e in range(spec.n_experts):
                rows, slot = expert_tokens(ids, e)
                if len(rows):
                    y = model.expert(units[Unit(Tensor.EXPERT, layer, e)], normed[rows])
                    put_expert(slots, rows, slot, y)
            h = moe_output(h, slots, wts, None, model.float32_combine)
        head = units[Unit(Tensor.HEAD)]
        return torch.cat([model.head(head, h[k * B : (k + 1) * B]) for k in range(N)])

    def attention_only(merged: bool) -> None:
        h = model.embed(units[Unit(Tensor.EMBED)], nxt)
        for layer in range(spec.n_layers):
            attention(layer, h, merged)

    hf = MixtralForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        cache = hf(prompts, use_cache=True).past_key_values

    def hf_step() -> None:
        hf(nxt, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # back to the prompt: every rep decodes the same position

    cases: dict[str, Callable[[], object]] = {
        "transformers, all 60": hf_step,
        "moepipe forward, all 60": lambda: forward_step(model, units, nxt, kv, P),
        "klotski order, attention per batch": lambda: klotski(False),
        "klotski order, attention merged": lambda: klotski(True),
        "attention only, 15 calls": lambda: attention_only(False),
        "attention only, 1 call": lambda: attention_only(True),
    }
    with torch.inference_mode():
        ref = forward_step(model, units, nxt, kv, P)[0]
        for merged in (False, True):
            torch.testing.assert_close(klotski(merged), ref, atol=1e-4, rtol=1e-4)
        times = time_cases(cases, reps)
    for k, v in times.items():
        print(f"{k:38s} {statistics.median(v) * 1e3:7.1f} ms  (min {min(v) * 1e3:.1f})")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], int(args[1]) if len(args) > 1 else 7, int(args[2]) if len(args) > 2 else 2)
