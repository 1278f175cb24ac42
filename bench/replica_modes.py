"""Two replicas at the engine level (no HTTP): all in child processes, or replica 0 in this process.

`TorchServing(replica_processes=True)` runs every replica in a child (`ProcessEngine`); the
alternative keeps replica 0 as a TorchEngine on the trainer's model in the parent and starts N-1
children. This drives one `ReplicatedEngine` of each kind (and one TorchEngine alone) with
`--requests` (32) requests at once of `--max-tokens` (64) tokens, ignore_eos, temperature 1,
one warm-up round then the median of `--repeats` (3), and prints tok/s. The HTTP server, which
also runs in the parent, is left out (bench/serve_throughput.py --replica-mode measures that).

Usage: python bench/replica_modes.py one|children|mixed [--requests 32] [--max-tokens 64] [--repeats 3]
"one": one TorchEngine with 2 torch threads; "children": two ProcessEngines, 1 thread each;
"mixed": a TorchEngine here (run it with OMP_NUM_THREADS=1) and one ProcessEngine with 1 thread.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from art_core.engine.openmp import prefer_short_spin


async def timed_rounds(engine: Any, prompts: list[list[int]], max_tokens: int, repeats: int) -> list[float]:
    from art_core.engine.config import GenerationRequest
    from art_core.engine.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    rates = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        done = await asyncio.gather(*[engine.generate(GenerationRequest(p, params)) for p in prompts])
        rates.append(sum(len(c[0].token_ids) for c in done) / (time.perf_counter() - started))
    return rates[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["one", "children", "mixed"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prefer_short_spin()  # before torch loads its OpenMP, as the `art` CLI does
    import torch
    from machine import machine_header  # bench/ is on sys.path when a bench script runs

    from art_core.engine.config import EngineConfig
    from art_core.engine.replicas import ReplicatedEngine
    from art_core.engine.torch.engine import TorchEngine
    from art_core.engine.torch.process_engine import ProcessEngine, SharedLora
    from art_core.host.torch_replicas import ReplicaModel
    from art_core.training.config import LoRAConfig

    print(machine_header(), flush=True)
    build = ReplicaModel("smollm2-135m", False, LoRAConfig(), "live")
    model, tokenizer = build()
    lora = SharedLora.of(model, "live")
    config = EngineConfig(serve_dtype=torch.float32)
    prompts = [
        tokenizer(f"Write a short poem about thing number {i}.")["input_ids"] for i in range(args.requests)
    ]
    engines: list[Any]
    if args.mode == "one":
        torch.set_num_threads(2)
        engines = [TorchEngine(model, tokenizer, config)]
    elif args.mode == "children":
        engines = [ProcessEngine(build, lora, config, 1, wait=False) for _ in range(2)]
        for engine in engines:
            engine.wait_ready()
    else:
        torch.set_num_threads(1)
        engines = [TorchEngine(model, tokenizer, config), ProcessEngine(build, lora, config, 1)]
    replicated = ReplicatedEngine(engines)
    try:
        rates = asyncio.run(timed_rounds(replicated, prompts, args.max_tokens, args.repeats))
    finally:
        replicated.close()
    print(f"{args.mode}: {statistics.median(rates):.1f} tok/s (rounds {[round(r, 1) for r in rates]})")


if __name__ == "__main__":
    main()
