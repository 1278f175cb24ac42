"""One decode step of the engine's serving copy, broken into its parts, against this machine's floor.

For batch sizes 1, 8 and 32 (SmolLM2-135M-Instruct, the merged serving copy the engine decodes
on, in the serving dtype the hardware probes choose) this prefills chat prompts through the real
`DecodeBatch` and times its decode steps (`DecodeBatch.forward`, the lean `decode_step`, then
`DecodeBatch.step`, the sampler) three ways:

- plain: the real path, nothing added (the step time reported);
- sections: the same path with timers around the functions `decode_step` calls (each matmul by
  weight, norms, rotary, the KV-cache append, attention (SDPA, or two matmuls in float32), the MLP's
  activation) and around
  sampling and the grammar masks, each section's own time excluding the sections inside it;
- ops: torch.profiler over the plain path; the step's wall time minus the time spent inside
  top-level torch ops is the Python overhead (the interpreter between ops).

Grammar masks are timed on a second batch whose rows are all constrained by a JSON schema (free
rows never mask). The floor: the step must read every weight once and the KV cache (bytes /
measured memory bandwidth, from a large copy) and do its FLOPs (2 x rows x weights + attention,
/ the measured rate of a square GEMM in the serving dtype); whichever binds. The last line is
`{"step_ms_b32", "floor_ms_b32", "fraction_of_floor"}` (floor / step: 1.0 is the hardware's pace).

That floor assumes the matmuls read their weights while they compute. Each batch also times the
gate/up matmul with its weight in cache and with every layer's streamed from memory in turn: the
difference, against the weight's bytes at the measured bandwidth, is how much of the stream the
matmul hides; where it hides none, memory + compute is the floor that kernel can reach, printed too.

    python bench/decode_profile.py [--batches 1,8,32] [--steps 16] [--threads N] [--dtype auto] [--tiny]

`--tiny` runs the random test model (seconds; tests/engine/test_decode_profile.py does, so the
script does not rot). Results: docs/benchmarks.md ("Decode step profile").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from machine import machine_header  # bench/ is on sys.path when a bench script runs

import art_core.engine.torch.decode_step as lean
from art_core.engine.grammar import RowConstraint, json_schema_grammar
from art_core.engine.sampling import SamplingParams
from art_core.engine.torch.decoding import DecodeBatch, RowState
from art_core.engine.torch.serving_weights import MergedWeights, fast_bf16
from art_core.models.loading import load_model

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
TOPICS = ["the sea", "a lighthouse", "bread", "autumn", "a train", "cats", "rain", "a garden"]


class Sections:
    """Exclusive wall time per named section (a section's time excludes the sections inside it)."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open section: [time of its children]

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        self._stack.append([0.0])
        started = time.perf_counter()
        try:
            yield
        finally:
            total = time.perf_counter() - started
            children = self._stack.pop()[0]
            self.own[name] += total - children
            if self._stack:
                self._stack[-1][0] += total

    def wrap(self, name: Callable[..., str] | str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.time(name(*args) if callable(name) else name):
                return fn(*args, **kwargs)

        return timed


@dataclass
class Patched:
    """`attribute` of `owner` replaced for the duration of a `with`."""

    owner: Any
    attribute: str
    value: Any

    def __enter__(self) -> None:
        self.saved = getattr(self.owner, self.attribute)
        setattr(self.owner, self.attribute, self.value)

    def __exit__(self, *exc: object) -> None:
        setattr(self.owner, self.attribute, self.saved)


class _Functional:
    """torch.nn.functional with SDPA timed (`decode_step` calls it as `F.scaled_dot_product_attention`)."""

    def __init__(self, sections: Sections) -> None:
        self.scaled_dot_product_attention = sections.wrap(
            "attention (SDPA)", torch.nn.functional.scaled_dot_product_attention
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn.functional, name)


def weight_names(model: Any) -> dict[int, str]:
    """Each matmul weight of the serving copy (by tensor id) named by its kind: qkv, o, gate_up, down, head."""
    names: dict[int, str] = {id(model.lm_head.weight): "matmul lm_head"}
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        fused = getattr(attn, "art_qkv", None)
        for weight, kind in (
            (fused[0] if fused is not None else attn.q_proj.weight, "qkv"),
            (attn.o_proj.weight, "o_proj"),
            (mlp.art_gate_up[0] if hasattr(mlp, "art_gate_up") else mlp.gate_proj.weight, "gate_up"),
            (mlp.down_proj.weight, "down_proj"),
        ):
            names[id(weight)] = f"matmul {kind}"
    return names


def timed_sections(batch: DecodeBatch, sections: Sections) -> list[Patched]:
    """The patches that put timers around the parts of the real decode path (restored on exit)."""
    names = weight_names(batch.model)
    cache_layer = type(batch.cache.layers[0])
    return [
        Patched(
            lean, "_linear", sections.wrap(lambda x, w, *a: names.get(id(w), "matmul other"), lean._linear)
        ),
        Patched(
            lean, "_apply", sections.wrap(lambda m, *a: names.get(id(m.weight), "matmul other"), lean._apply)
        ),
        Patched(lean, "_norm", sections.wrap("norms", lean._norm)),
        Patched(lean, "rotate", sections.wrap("rotary", lean.rotate)),
        Patched(lean, "_mlp", sections.wrap("mlp activation", lean._mlp)),
        Patched(lean, "F", _Functional(sections)),
        Patched(lean, "matmul_attention", sections.wrap("attention (matmuls)", lean.matmul_attention)),
        Patched(cache_layer, "update", sections.wrap("attention (KV append)", cache_layer.update)),
        Patched(RowConstraint, "mask_", sections.wrap("grammar masks", RowConstraint.mask_)),
        Patched(DecodeBatch, "step", sections.wrap("sampling", DecodeBatch.step)),
    ]


def make_batch(loaded: Any, model: Any, rows: int, constrained: bool, max_new: int) -> DecodeBatch:
    tokenizer = loaded.tokenizer
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_new)
    grammar = json_schema_grammar(SCHEMA) if constrained else None
    vocab = int(model.get_input_embeddings().num_embeddings)
    stops = frozenset({int(tokenizer.eos_token_id)}) if tokenizer.eos_token_id is not None else frozenset()
    states = []
    for i in range(rows):
        chat = [{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]} ({i})."}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        constraint = RowConstraint(grammar, tokenizer, vocab) if grammar is not None else None
        gen = torch.Generator().manual_seed(i)
        states.append(RowState(None, i, ids, params, None, max_new, gen, stops, constraint=constraint))
    return DecodeBatch(model, tokenizer, states, use_adapter_names=False)


def decode(batch: DecodeBatch, logits: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step as `DecodeBatch.run` takes it: sample, grow the mask, forward the new tokens."""
    next_ids = batch.step(logits)
    batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
    last = last + 1
    return batch.forward(next_ids[:, None], last[:, None]), last


def run_steps(batch: DecodeBatch, steps: int, warmup: int, each: Callable[[int], Any]) -> list[float]:
    """Prefill, `warmup` steps, then `steps` timed steps; `each(i)` is a context around step i."""
    logits = batch.prefill()
    last = batch.positions[:, -1]
    times = []
    for i in range(warmup + steps):
        with each(i):
            started = time.perf_counter()
            logits, last = decode(batch, logits, last)
            if i >= warmup:
                times.append(time.perf_counter() - started)
    return times


@contextmanager
def nothing(_: int) -> Iterator[None]:
    yield


def python_overhead_share(batch: DecodeBatch, steps: int, warmup: int) -> float:
    """Share of a step's wall time outside top-level torch ops (torch.profiler on the plain path)."""
    from torch.profiler import ProfilerActivity, profile

    logits = batch.prefill()
    last = batch.positions[:, -1]
    for _ in range(warmup):
        logits, last = decode(batch, logits, last)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            logits, last = decode(batch, logits, last)
        wall_us = (time.perf_counter() - started) * 1e6
    top = [
        e for e in prof.events() if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU
    ]
    inside = sum(e.time_range.elapsed_us() for e in top)
    return max(0.0, 1.0 - inside / wall_us)


def memory_bandwidth_gb_s(mib: int = 512, repeats: int = 5) -> float:
    """Bytes moved per second by a large tensor copy (read + write), best of `repeats`."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_seconds(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / best / 1e9


def matmul_gflop_s(dtype: torch.dtype, n: int = 1024, repeats: int = 10) -> float:
    """The best rate of `repeats` n^3 matmuls after a warm-up: the best, because on a shared or
    virtualised machine a few of them run slow (3 repeats once measured half the usual rate, and the
    floor with it)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    return 2 * n**3 / min(_seconds(lambda: a @ b) for _ in range(repeats)) / 1e9


def _seconds(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def step_work(model: Any, rows: int, context: int) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step: every weight once (the tied head once; the embedding
    reads only its rows), the KV cache of `context` positions per row, 2 FLOPs per weight per row
    and the attention's two products."""
    config = model.config
    seen: set[int] = set()
    weight_bytes = matmul_params = 0
    embed = model.get_input_embeddings().weight
    for param in dict(model.named_parameters(remove_duplicate=False)).values():
        if id(param) in seen or (param is embed and model.lm_head.weight is not embed):
            continue
        seen.add(id(param))
        weight_bytes += param.numel() * param.element_size()
        if param.dim() == 2:
            matmul_params += param.numel()
    head_dim = config.hidden_size // config.num_attention_heads
    layers, element = config.num_hidden_layers, embed.element_size()
    kv_bytes = rows * context * layers * 2 * config.num_key_value_heads * head_dim * element
    attention_flops = 2 * 2 * rows * context * layers * config.num_attention_heads * head_dim
    return weight_bytes + kv_bytes, 2 * rows * matmul_params + attention_flops


def weight_stream(model: Any, rows: int, bandwidth: float, rounds: int = 4) -> dict[str, float] | None:
    """How much of streaming a matmul's weight from memory the matmul hides behind its compute.

    The MLP's gate/up matmul (the step's largest per layer) at `rows` rows, two ways: one layer's
    weight over and over (it stays in cache), and every layer's in turn as the step does (each comes
    from memory). If the weight stream overlapped the compute, the two would take the same time; if
    it did not, they differ by the weight's bytes at the measured bandwidth. None when the model
    has no fused gate/up."""
    weights = [
        getattr(layer.mlp, lean.GATE_UP)[0]
        for layer in model.model.layers
        if hasattr(layer.mlp, lean.GATE_UP)
    ]
    if not weights:
        return None
    packs = getattr(model, lean.PACKED_WEIGHTS, None)
    x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype)
    calls = [lambda w=w: lean._linear(x, w, None, packs) for w in weights]  # the step's own matmul call
    for call in calls:
        call()
    cached = statistics.median(_seconds(calls[0]) for _ in range(10 * len(calls)))
    streamed = statistics.median(_seconds(call) for _ in range(rounds) for call in calls)
    nbytes = weights[0].numel() * weights[0].element_size()
    stream = nbytes / (bandwidth * 1e9)
    return {
        "mb": nbytes / 1e6,
        "cached_us": cached * 1e6,
        "streamed_us": streamed * 1e6,
        "stream_us": stream * 1e6,
        "overlap": min(1.0, max(0.0, 1.0 - (streamed - cached) / stream)),
    }


def profile_batch(
    loaded: Any, model: Any, rows: int, args: argparse.Namespace, bandwidth: float
) -> dict[str, Any]:
    budget = args.warmup + args.steps + 2
    plain = run_steps(make_batch(loaded, model, rows, False, budget), args.steps, args.warmup, nothing)
    sections = Sections()
    batch = make_batch(loaded, model, rows, False, budget)
    grammar_sections = Sections()
    constrained = make_batch(loaded, model, rows, True, budget)

    def timed(into: Sections, target: DecodeBatch) -> Callable[[int], Any]:
        @contextmanager
        def each(i: int) -> Iterator[None]:
            if i < args.warmup:  # warm-up steps run untimed
                yield
                return
            patches = timed_sections(target, into)
            for patch in patches:
                patch.__enter__()
            try:
                with into.time("other ops + Python"):
                    yield
            finally:
                for patch in reversed(patches):
                    patch.__exit__()

        return each

    patches_off = run_steps(batch, args.steps, args.warmup, timed(sections, batch))
    run_steps(constrained, args.steps, args.warmup, timed(grammar_sections, constrained))
    python = python_overhead_share(make_batch(loaded, model, rows, False, budget), args.steps, args.warmup)
    stream = weight_stream(model, rows, bandwidth)
    context = len(batch.rows[0].prompt_ids) + args.warmup + args.steps // 2
    step_s = statistics.median(plain)
    per_step = {k: v / args.steps for k, v in sections.own.items()}
    return {
        "rows": rows,
        "step_ms": step_s * 1e3,
        "sectioned_step_ms": statistics.median(patches_off) * 1e3,
        "sections_ms": {k: v * 1e3 for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])},
        "grammar_mask_ms": grammar_sections.own.get("grammar masks", 0.0) / args.steps * 1e3,
        "python_share": python,
        "context": context,
        "stream": stream,
    }


def report(result: dict[str, Any], model: Any, bandwidth: float, gflops: float, layers: int) -> float:
    rows, step_ms = result["rows"], result["step_ms"]
    nbytes, flops = step_work(model, rows, result["context"])
    memory_ms, compute_ms = nbytes / bandwidth / 1e6, flops / gflops / 1e6
    floor_ms = max(memory_ms, compute_ms)
    binds = "memory" if memory_ms >= compute_ms else "compute"
    print(
        f"\nbatch {rows}: step {step_ms:.2f} ms (median; {rows / step_ms * 1e3:.0f} tok/s), context ~{result['context']}; "
        f"floor {floor_ms:.2f} ms ({binds}: {nbytes / 1e6:.0f} MB -> {memory_ms:.2f} ms, "
        f"{flops / 1e9:.2f} GFLOP -> {compute_ms:.2f} ms); fraction of floor {floor_ms / step_ms:.2f}"
    )
    sectioned = result["sectioned_step_ms"]
    print(f"  sections (timed run, {sectioned:.2f} ms/step with timers; own time per step):")
    for name, ms in result["sections_ms"].items():
        per_layer = (
            f"  ({ms / layers * 1e3:.0f} us/layer)"
            if name.startswith("matmul") and "lm_head" not in name
            else ""
        )
        print(f"    {name:<24} {ms:7.3f} ms  {ms / sectioned:6.1%}{per_layer}")
    print(
        f"    {'grammar masks':<24} {result['grammar_mask_ms']:7.3f} ms  (every row JSON-constrained; "
        "free rows: none)"
    )
    print(
        f"  Python overhead (torch.profiler, plain path): {result['python_share']:.1%} of the step's wall time "
        "is outside torch ops"
    )
    stream = result["stream"]
    if stream is not None:
        print(
            f"  weight stream: gate_up ({stream['mb']:.1f} MB) at {rows} rows takes {stream['cached_us']:.0f} us "
            f"with its weight in cache, {stream['streamed_us']:.0f} us with each layer's from memory in turn "
            f"(reading it: {stream['stream_us']:.0f} us at the measured bandwidth): the matmul hides "
            f"{stream['overlap']:.0%} of its weight's stream behind its compute"
        )
    serial_ms = memory_ms + compute_ms
    print(
        f"  floor without that overlap (memory + compute, {serial_ms:.2f} ms): fraction {serial_ms / step_ms:.2f}"
    )
    return floor_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per batch")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
        help="serving copy dtype; auto: what the engine picks (bf16 where the CPU has native bf16)",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="the random test model (a quick check)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_header())
    loaded = load_model("tiny-random" if args.tiny else "smollm2-135m")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(args.dtype)
    if dtype is None:
        dtype = torch.bfloat16 if fast_bf16(torch.device("cpu")) else torch.float32
    model = MergedWeights(loaded.model, None, dtype).model
    bandwidth, gflops = memory_bandwidth_gb_s(64 if args.tiny else 512), matmul_gflop_s(dtype)
    packed = getattr(model, lean.PACKED_WEIGHTS, None) is not None
    print(
        f"model {loaded.name}: serving copy {str(dtype).removeprefix('torch.')} "
        f"({'oneDNN-packed' if packed else 'plain F.linear'}), {args.threads} threads, load average "
        f"{os.getloadavg()[0]:.1f}; memory bandwidth {bandwidth:.1f} GB/s (copy), matmul "
        f"{gflops:.1f} GFLOP/s (1024^3, {str(dtype).removeprefix('torch.')})"
    )
    layers = model.config.num_hidden_layers
    final: dict[str, float] = {}
    with torch.inference_mode():
        for rows in (int(b) for b in args.batches.split(",")):
            result = profile_batch(loaded, model, rows, args, bandwidth)
            floor_ms = report(result, model, bandwidth, gflops, layers)
            final = {
                "step_ms_b32" if rows == 32 else f"step_ms_b{rows}": round(result["step_ms"], 3),
                "floor_ms_b32" if rows == 32 else f"floor_ms_b{rows}": round(floor_ms, 3),
                "fraction_of_floor": round(floor_ms / result["step_ms"], 3),
            }
    print(json.dumps(final))


if __name__ == "__main__":
    main()
