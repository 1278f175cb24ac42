"""Whether the torch engine's prefix cache pays: agent turns decoded with it and without.

    python bench/prefix_cache.py [--model smollm2-135m] [--conversations 8] [--turns 4]
                                 [--system 200] [--new 30] [--max-tokens 16] [--mib 128]

`--conversations` conversations share a `--system`-token system prompt; each turn appends the
previous completion and `--new` fresh tokens, as an agent resends its whole conversation. Every
turn is one `DecodeBatch` (greedy, `--max-tokens` tokens a row), run once with a `PrefixCache` of
`--mib` MiB and once without, on the same prompts. Prints the CPU first, then one JSON object:
seconds per turn with and without the cache, their totals, the cache's hit tokens and bytes, and
whether both sampled the same tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from machine import machine_header  # bench/ is on sys.path when a bench script runs

from art_core.engine.sampling import SamplingParams
from art_core.engine.torch.decoding import DecodeBatch, RowState
from art_core.engine.torch.prefix_cache import PrefixCache
from art_core.models.loading import LoadedModel, load_model


def decode(
    loaded: LoadedModel, prompts: list[list[int]], cache: PrefixCache | None, max_tokens: int
) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rows = [
        RowState(None, 0, p, params, None, max_tokens, torch.Generator().manual_seed(0), frozenset())
        for p in prompts
    ]
    started = time.perf_counter()
    with torch.inference_mode():
        DecodeBatch(loaded.model, loaded.tokenizer, rows, False, cache).run(0.25)
    return time.perf_counter() - started, [r.token_ids for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=200)
    parser.add_argument("--new", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mib", type=int, default=128)
    args = parser.parse_args()
    print(machine_header(), flush=True)
    loaded = load_model(args.model)
    loaded.model.eval()
    vocab = min(loaded.tokenizer.vocab_size, 5000)
    system = [(7 * i) % vocab + 10 for i in range(args.system)]
    prompts = [
        system + [(13 * i + 101 * c) % vocab + 10 for i in range(args.new)] for c in range(args.conversations)
    ]
    cache = PrefixCache(args.mib * 2**20)
    decode(loaded, [system[:20]], None, 2)  # warm-up
    timings: dict[str, list[float]] = {"cache": [], "none": []}
    same = True
    for turn in range(args.turns):
        with_cache, tokens = decode(loaded, prompts, cache, args.max_tokens)
        without, plain = decode(loaded, prompts, None, args.max_tokens)
        timings["cache"].append(round(with_cache, 3))
        timings["none"].append(round(without, 3))
        same = same and tokens == plain
        print(f"turn {turn}: {with_cache:.2f} s with the cache, {without:.2f} s without", flush=True)
        prompts = [
            p + t + [(17 * i + 31 * c + turn) % vocab + 10 for i in range(args.new)]
            for c, (p, t) in enumerate(zip(prompts, tokens, strict=True))
        ]
    stats = cache.stats()
    result = {
        "model": args.model,
        "turn_s_cache": timings["cache"],
        "turn_s_none": timings["none"],
        "total_s_cache": round(sum(timings["cache"]), 2),
        "total_s_none": round(sum(timings["none"]), 2),
        "hit_tokens": stats.hit_tokens,
        "looked_up_tokens": stats.looked_up_tokens,
        "cache_bytes": stats.bytes,
        "same_tokens": same,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
