"""A continuous-batching decode loop over a paged KV cache, one CUDA graph replayed every step.

    python examples/serving_decode.py                       # 8 slots, 200 steps, checked every 25
    python examples/serving_decode.py --slots 32 --steps 500 --check-every 0 --time

What a serving engine does with autosoft.attention_kvcache: a pool of 16-token pages shared by the
sequences in flight, a block table naming each sequence's pages, and a fixed number of batch slots.
Sequences arrive with a prompt (its keys and values written into fresh pages), decode one token a
step (the new token's key and value appended by the attention call itself, in place), and finish
after a random number of tokens, their pages going back to the pool and their slot to the next
sequence. The step's attention is captured once in a CUDA graph for all the slots and replayed
every step with the inputs updated in place (queries, new keys and values, lengths, block table):
the kernel reads the lengths and the table on the GPU, so the one graph serves every composition
of the batch. Every --check-every steps each live sequence's output is compared with SDPA on its
keys gathered from the pages. --time times the graph's replay against the same call launched
eagerly and against SDPA on the gathered keys, one call per sequence, as a loop without a paged
kernel would run it.
"""
from __future__ import annotations

import argparse
import math
import random

import torch

import autosoft

HQ, HKV, D, PAGE = 32, 8, 128, 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8, help="batch slots (sequences decoded together)")
    parser.add_argument("--max-len", type=int, default=2048, help="the most tokens a sequence holds")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--check-every", type=int, default=25, help="compare with SDPA every N steps (0: never)")
    parser.add_argument("--time", action="store_true", help="time the replay, the eager call and an SDPA loop")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    dev, dt = "cuda", torch.bfloat16
    pages_each = args.max_len // PAGE
    pool_pages = args.slots * pages_each
    k_pool = torch.zeros(pool_pages, PAGE, HKV, D, device=dev, dtype=dt)
    v_pool = torch.zeros_like(k_pool)
    free = list(range(pool_pages))
    rng.shuffle(free)  # pages come back in any order: a sequence's pages are scattered through the pool

    # the graph's inputs, updated in place every step
    table = torch.zeros(args.slots, pages_each, device=dev, dtype=torch.int32)
    lengths = torch.zeros(args.slots, device=dev, dtype=torch.int32)  # tokens cached before this step
    q = torch.zeros(args.slots, 1, HQ, D, device=dev, dtype=dt)
    k_new = torch.zeros(args.slots, 1, HKV, D, device=dev, dtype=dt)
    v_new = torch.zeros_like(k_new)
    live: list[dict | None] = [None] * args.slots

    def admit(slot: int) -> None:
        """A new sequence in `slot`: a prompt of random length written into fresh pages."""
        prompt = rng.randint(1, args.max_len // 2)
        budget = rng.randint(1, args.max_len - prompt - 1)  # tokens it will decode
        pages = [free.pop() for _ in range(math.ceil((prompt + budget) / PAGE))]
        table[slot, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        keys = torch.randn(prompt, HKV, D, device=dev, dtype=dt)
        values = torch.randn(prompt, HKV, D, device=dev, dtype=dt)
        for t in range(0, prompt, PAGE):
            page = pages[t // PAGE]
            k_pool[page, : min(PAGE, prompt - t)] = keys[t:t + PAGE]
            v_pool[page, : min(PAGE, prompt - t)] = values[t:t + PAGE]
        lengths[slot] = prompt
        live[slot] = {"pages": pages, "left": budget}

    def gathered(slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n keys and values of the sequence in `slot`, (1, Hkv, n, D)."""
        rows = [(int(table[slot, t // PAGE]), t % PAGE) for t in range(n)]
        pages = torch.tensor([p for p, _ in rows], device=dev)
        offsets = torch.tensor([o for _, o in rows], device=dev)
        return k_pool[pages, offsets].transpose(0, 1)[None], v_pool[pages, offsets].transpose(0, 1)[None]

    for slot in range(args.slots):
        admit(slot)
    step_inputs = (q, k_pool, v_pool, lengths, table, k_new, v_new)
    out = autosoft.attention_kvcache(*step_inputs)  # compiles and loads the kernel before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = autosoft.attention_kvcache(*step_inputs)
    worst = 0.0
    for step in range(args.steps):
        q.normal_()
        k_new.normal_()
        v_new.normal_()
        graph.replay()  # appends each slot's new token at lengths[slot], then attends over lengths + 1 keys
        if args.check_every and step % args.check_every == 0:
            for slot in range(args.slots):
                keys, values = gathered(slot, int(lengths[slot]) + 1)
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q[slot:slot + 1].transpose(1, 2).float(), keys.float(), values.float(), enable_gqa=True)
                error = float((out[slot:slot + 1].transpose(1, 2).float() - ref).norm() / ref.norm())
                worst = max(worst, error)
                if not error <= 2e-2:
                    raise SystemExit(f"step {step}, slot {slot}: relative error {error:.3g} against SDPA")
        lengths += 1
        for slot in range(args.slots):  # finished sequences hand their pages and slot on
            live[slot]["left"] -= 1
            if live[slot]["left"] == 0:
                free.extend(live[slot]["pages"])
                admit(slot)
    print(f"{args.steps} steps of {args.slots} slots: worst relative error against SDPA {worst:.3g}")

    if args.time:
        def timed(run, reps: int = 50) -> float:
            for _ in range(5):
                run()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                run()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) * 1e3 / reps

        lengths -= 1  # every call below rewrites each sequence's last token in its own page
        snapshot = [(int(lengths[s]) + 1, gathered(s, int(lengths[s]) + 1)) for s in range(args.slots)]
        replay = timed(graph.replay)
        eager = timed(lambda: autosoft.attention_kvcache(q, k_pool, v_pool, lengths, table, k_new, v_new))
        queries = [q[s:s + 1].transpose(1, 2) for s in range(args.slots)]
        sdpa = timed(lambda: [torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True)
                              for qs, (_, (k, v)) in zip(queries, snapshot)])
        print(f"decode step, {args.slots} sequences of {min(n for n, _ in snapshot)} to "
              f"{max(n for n, _ in snapshot)} keys: graph replay {replay:.1f} us, eager {eager:.1f} us, "
              f"SDPA per sequence on gathered keys {sdpa:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
