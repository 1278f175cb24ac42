"""Is the RULER judge any good? Rank agreement with groups whose right order is known by construction.

    python bench/ruler_agreement.py [--tasks N] [--modes sampled,weighted,pairwise]
                                    [--judge-model M [--judge-base-url URL] [--judge-api-key K]]

Each of the small tasks written below has four replies whose order is known: the right answer,
a partly right (vague or incomplete) one, an off-topic one and an empty one. Each group is shown
to the judge in a shuffled order (fixed seed), judged, and the judge's scores are compared with
the known order:

- pairwise accuracy: over all pairs of replies of all groups, the fraction the judge orders
  right (a tie counts 1/2, so 0.5 is chance and constant scores);
- Kendall tau (tau-a): per group (concordant - discordant pairs) / pairs, averaged over groups.

A group the judge fails on counts as all ties (accuracy 0.5, tau 0) and is reported.

The judges: (i)-(iii) SmolLM2-135M-Instruct served in-process by our own server (the model's
own judge, as RULER's local default uses it) with sampled JSON scores, probability-weighted
digit scores and pairwise preferences; (iv) a stronger judge given by --judge-model (a LiteLLM
model string, or a model name at --judge-base-url), with sampled JSON scores. The last line is
one JSON object: pairwise_sampled, pairwise_weighted, pairwise_pairs, kendall_sampled,
kendall_weighted, kendall_pairs (and pairwise_strong, kendall_strong with --judge-model).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TASKS: list[tuple[str, str, str, str]] = [
    # (question, right answer, partly right answer, off-topic answer); the fourth reply is empty.
    (
        "What is the capital of France?",
        "The capital of France is Paris.",
        "France's capital is a big city in the north of the country.",
        "I like to watch football on Sundays.",
    ),
    (
        "What is 7 times 8?",
        "7 times 8 is 56.",
        "7 times 8 is somewhere around 50.",
        "The weather is sunny today.",
    ),
    (
        "How do you say 'thank you' in Spanish?",
        "'Thank you' in Spanish is 'gracias'.",
        "It is a Spanish word that starts with the letter g.",
        "My favourite colour is blue.",
    ),
    (
        "Which is the largest planet of the solar system?",
        "Jupiter is the largest planet of the solar system.",
        "It is one of the gas giants.",
        "Pizza was invented in Italy.",
    ),
    (
        "How many days are there in a week?",
        "A week has 7 days.",
        "A week has more than five days.",
        "Cats sleep a lot.",
    ),
    (
        "At what temperature does water boil at sea level, in Celsius?",
        "Water boils at 100 degrees Celsius at sea level.",
        "Water boils when it gets very hot.",
        "The Eiffel Tower is made of iron.",
    ),
    (
        "What is the opposite of 'hot'?",
        "The opposite of 'hot' is 'cold'.",
        "The opposite of 'hot' is a word about temperature.",
        "I had toast for breakfast.",
    ),
    (
        "Who wrote Romeo and Juliet?",
        "William Shakespeare wrote Romeo and Juliet.",
        "An English playwright wrote it a long time ago.",
        "Mount Everest is very tall.",
    ),
    (
        "What is the chemical symbol for gold?",
        "The chemical symbol for gold is Au.",
        "The symbol for gold has two letters.",
        "Dogs are loyal animals.",
    ),
    (
        "What is the square root of 81?",
        "The square root of 81 is 9.",
        "It is a single-digit number.",
        "Trains run on tracks.",
    ),
    (
        "Which colour do you get by mixing blue and yellow?",
        "Mixing blue and yellow gives green.",
        "You get a new colour that is neither blue nor yellow.",
        "A football team has eleven players.",
    ),
    (
        "At what temperature does water freeze, in Fahrenheit?",
        "Water freezes at 32 degrees Fahrenheit.",
        "Water freezes below 40 degrees Fahrenheit.",
        "Apples grow on trees.",
    ),
    (
        "Sort the list [3, 1, 2] in ascending order.",
        "Sorted in ascending order: [1, 2, 3].",
        "After sorting, the list starts with 1.",
        "The moon orbits the Earth.",
    ),
    (
        "What is the longest river in Africa?",
        "The Nile is the longest river in Africa.",
        "It flows north through several countries.",
        "I enjoy playing the piano.",
    ),
    (
        "What is the plural of 'mouse'?",
        "The plural of 'mouse' is 'mice'.",
        "It is an irregular plural.",
        "Coffee contains caffeine.",
    ),
    (
        "In Python, how do you get the length of a list called xs?",
        "Use len(xs): it returns the number of items in xs.",
        "There is a built-in function for it.",
        "Paris is known for its museums.",
    ),
    (
        "How fast does light travel, roughly?",
        "Light travels at about 300,000 kilometres per second.",
        "Light is very fast, faster than sound.",
        "Tennis is played with a racket.",
    ),
    (
        "How many continents are there?",
        "There are seven continents.",
        "There are more than five.",
        "Bread is made from flour.",
    ),
    (
        "Who painted the Mona Lisa?",
        "Leonardo da Vinci painted the Mona Lisa.",
        "An Italian artist of the Renaissance painted it.",
        "Rain falls from clouds.",
    ),
    (
        "What is the main language spoken in Brazil?",
        "Portuguese is the main language of Brazil.",
        "It is a language that came from Europe.",
        "Elephants have long trunks.",
    ),
    (
        "How many minutes are there in 2 hours?",
        "2 hours is 120 minutes.",
        "It is more than 100 minutes.",
        "Roses are red.",
    ),
    (
        "Which gas do plants take in from the air to make their food?",
        "Plants take in carbon dioxide (CO2).",
        "They take in a gas that animals breathe out.",
        "Cars need fuel to run.",
    ),
    (
        "What is the capital of Japan?",
        "Tokyo is the capital of Japan.",
        "It is a very large city in the east of the country.",
        "Chocolate is made from cocoa.",
    ),
    (
        "What is 255 in hexadecimal?",
        "255 in hexadecimal is FF.",
        "It is a two-digit hexadecimal number.",
        "Birds can fly.",
    ),
]

SYSTEM = "You are a helpful assistant. Answer the user's question correctly and briefly."
KINDS = ("right", "partly right", "off-topic", "empty")
"""Reply kinds, best first: the known order."""


@dataclass(frozen=True)
class Group:
    """One task's replies in the order shown to the judge, and each one's known quality rank."""

    message_lists: list[list[dict[str, Any]]]
    quality: list[int]
    """3 for the right answer ... 0 for the empty one, per shown position."""


def groups(n_tasks: int, seed: int) -> list[Group]:
    """The first `n_tasks` tasks as groups, each shuffled by its own fixed seed."""
    out = []
    for k, (question, right, partial, off_topic) in enumerate(TASKS[:n_tasks]):
        replies = list(zip((right, partial, off_topic, ""), (3, 2, 1, 0), strict=True))
        random.Random(seed * 1000 + k).shuffle(replies)
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        lists = [[*prompt, {"role": "assistant", "content": text}] for text, _ in replies]
        out.append(Group(lists, [q for _, q in replies]))
    return out


def pair_outcomes(scores: Sequence[float], quality: Sequence[int]) -> list[float]:
    """Per pair of replies: 1 ordered like `quality`, 0 reversed, 0.5 tied; pure."""
    out = []
    for i, j in itertools.combinations(range(len(scores)), 2):
        truth, judged = quality[i] - quality[j], scores[i] - scores[j]
        out.append(0.5 if judged == 0 else float((truth > 0) == (judged > 0)))
    return out


def kendall_tau(scores: Sequence[float], quality: Sequence[int]) -> float:
    """Kendall's tau-a of the scores against the known order (ties count 0); pure."""
    outcomes = pair_outcomes(scores, quality)
    return sum(2 * o - 1 for o in outcomes) / len(outcomes)


@dataclass
class Tally:
    """Agreement of one judge over all groups."""

    outcomes: list[float]
    taus: list[float]
    failures: int = 0
    calls: int = 0
    errors: int = 0
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        return sum(self.outcomes) / len(self.outcomes)

    @property
    def tau(self) -> float:
        return sum(self.taus) / len(self.taus)


async def judge_all(items: list[Group], judge: Any, mode: str, concurrency: int) -> Tally:
    """Judge every group with one mode (`concurrency` groups at once) and tally the agreement."""
    from autorl.judge import JudgeError
    from autorl.judging import RulerConfig
    from autorl.ruler import judge_message_lists

    limit = asyncio.Semaphore(concurrency)
    tally = Tally([], [])

    async def one(group: Group) -> None:
        async with limit:
            try:
                judgement = await judge_message_lists(
                    group.message_lists, judge, config=RulerConfig(mode=mode)
                )  # type: ignore[arg-type]
            except JudgeError as exc:
                logging.getLogger("bench").warning("%s judge failed on a group: %s", mode, str(exc)[:300])
                tally.failures += 1
                tally.calls += exc.calls
                tally.errors += exc.errors
                tally.outcomes += [0.5] * 6
                tally.taus.append(0.0)
                return
        scores = [s.score for s in judgement.scores]
        tally.calls += judgement.attempts
        tally.errors += judgement.errors
        tally.outcomes += pair_outcomes(scores, group.quality)
        tally.taus.append(kendall_tau(scores, group.quality))

    start = time.perf_counter()
    await asyncio.gather(*(one(g) for g in items))
    tally.seconds = time.perf_counter() - start
    return tally


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header(threads: int) -> str:
    """Machine line: CPU model, cores, torch version and threads, torch's CPU ISA, oneDNN."""
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    onednn = torch.backends.mkldnn.is_available()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__} ({threads} threads), "
        f"ISA {isa}, oneDNN {'on' if onednn else 'off'}, load average {load:.1f}"
    )


def line(name: str, tally: Tally) -> str:
    fails = f", {tally.failures} failed group(s)" if tally.failures else ""
    return (
        f"{name:<34} pairwise accuracy {tally.accuracy:.3f}  Kendall tau {tally.tau:+.3f}  "
        f"({tally.calls} calls, {tally.errors} failed{fails}, {tally.seconds:.0f} s)"
    )


async def run(args: argparse.Namespace) -> dict[str, float]:
    from art_core import TrainableModel
    from art_core.backends import LocalBackend
    from autorl.judge import JudgeConfig

    items = groups(args.tasks, args.seed)
    print(f"groups: {len(items)} tasks x 4 replies ({', '.join(KINDS)}), shown shuffled (seed {args.seed})")
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ruler-agreement-") as tmp:
        backend = LocalBackend(Path(tmp))
        try:
            model = TrainableModel(project="ruler-agreement", name="judge", base_model=args.base_model)
            await model.register(backend)
            local = JudgeConfig(
                model=model.get_inference_name(),
                base_url=model.inference_base_url,
                api_key=model.inference_api_key,
                max_tokens=args.judge_max_tokens,
                cache=False,
                explanation_max_chars=args.explanation_max_chars,
            )
            short = {"sampled": "sampled", "weighted": "weighted", "pairwise": "pairs"}
            for mode in args.modes:
                tally = await judge_all(items, local, mode, args.concurrency)
                print(line(f"{args.base_model} {mode}", tally), flush=True)
                results[f"pairwise_{short[mode]}"] = round(tally.accuracy, 4)
                results[f"kendall_{short[mode]}"] = round(tally.tau, 4)
        finally:
            await backend.close()
    if args.judge_model:
        strong = JudgeConfig(model=args.judge_model, base_url=args.judge_base_url, api_key=args.judge_api_key)
        tally = await judge_all(items, strong, "sampled", args.concurrency)
        print(line(f"{args.judge_model} sampled", tally), flush=True)
        results["pairwise_strong"] = round(tally.accuracy, 4)
        results["kendall_strong"] = round(tally.tau, 4)
    else:
        print("stronger judge: skipped (point --judge-model, and --judge-base-url if needed, at one)")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks", type=int, default=len(TASKS), help=f"Tasks to judge (at most {len(TASKS)})"
    )
    parser.add_argument(
        "--modes", default="sampled,weighted,pairwise", help="Local judge modes, comma-separated"
    )
    parser.add_argument("--base-model", default="smollm2-135m", help="The local judge (served in-process)")
    parser.add_argument(
        "--judge-model", default=None, help="A stronger judge: LiteLLM model, or name at --judge-base-url"
    )
    parser.add_argument(
        "--judge-base-url", default=None, help="OpenAI-compatible URL of --judge-model (ending in /v1)"
    )
    parser.add_argument("--judge-api-key", default=None, help="API key of the stronger judge")
    parser.add_argument(
        "--judge-max-tokens", type=int, default=400, help="Longest sampled-JSON answer (local)"
    )
    parser.add_argument(
        "--explanation-max-chars", type=int, default=80, help="Local sampled judge's explanation bound"
    )
    parser.add_argument("--concurrency", type=int, default=4, help="Groups judged at once")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the shown order")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - {"sampled", "weighted", "pairwise"}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}: use sampled, weighted, pairwise")
    if not 1 <= args.tasks <= len(TASKS):
        parser.error(f"--tasks must be 1..{len(TASKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import torch

    print(header(torch.get_num_threads()))
    results = asyncio.run(run(args))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
