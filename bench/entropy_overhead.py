"""What logging the policy's entropy (`loss/entropy`) costs the trainer's log-prob pass.

The trainer computes log-probs through the frozen lm head in chunks (`token_logprobs`); with
`with_entropy=True` the same chunks also give the entropy. This times the head's forward and
backward with and without it, on a SmolLM2-sized head (576 x 49152) and random hidden states,
alternating the two so machine load hits both alike, and prints the ratio (1.00 = free).

    python bench/entropy_overhead.py [--tokens 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch
from machine import machine_header  # bench/ is on sys.path when a bench script runs

from art_core.training.logprobs import token_logprobs


def _step(head: torch.nn.Linear, targets: torch.Tensor, hidden_size: int, with_entropy: bool) -> float:
    hidden = torch.randn(1, targets.shape[1], hidden_size, requires_grad=True)
    started = time.perf_counter()
    logprobs, _ = token_logprobs(hidden, head, targets, chunk_size=512, with_entropy=with_entropy)
    logprobs.sum().backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    print(machine_header())
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).requires_grad_(False)
    targets = torch.randint(0, args.vocab, (1, args.tokens))
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for with_entropy in (False, True):
            times[with_entropy].append(_step(head, targets, args.hidden, with_entropy))
    plain, entropy = min(times[False][1:]), min(times[True][1:])
    print(f"head fwd+bwd, {args.tokens} tokens, vocab {args.vocab}: without entropy {plain * 1e3:.1f} ms,")
    print(f"with entropy {entropy * 1e3:.1f} ms; ratio {entropy / plain:.3f}")


if __name__ == "__main__":
    main()
