"""The engine's plain records: what it is asked (`GenerationRequest`), how it batches (`EngineConfig`)
and what it counted (`EngineStats`).

Re-exported by `art_core.engine.torch.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from art_core.engine.grammar import Grammar
from art_core.engine.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete `params.n` times."""

    prompt_ids: list[int]
    """The rendered prompt's token ids."""
    params: SamplingParams
    """How to sample."""
    adapter: str | None = None
    """The peft adapter name to sample with; None = the base model."""
    grammar: Grammar | None = None
    """Constrained decoding (JSON schema, forced tool call); None = free text."""
    affinity: str | None = None
    """Which conversation the request belongs to (the server passes the rollout id, else the OpenAI
    `user` field): with several replicas (`engine.replicas`) requests of one key stay on one replica,
    where its prefix cache is. None: routed by the prompt's prefix. A single engine ignores it."""


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches."""

    max_batch_size: int = 32
    """Most rows (completions) decoded together; a request's n rows may span batches."""
    max_queued_rows: int = 2048
    """Admission control: most rows (a request counts its n) in the engine at once, queued or
    decoding, including those waiting while the engine is paused for training. A request that
    would go past it fails at once with `EngineOverloadedError` (HTTP 429 + Retry-After) instead
    of waiting without bound; one whose n alone is larger is an `InvalidRequestError` (400). 2048
    is 4x what 64 concurrent rollouts with n=8 hold; a queued row costs little memory (its
    sampler state; the prompt ids are shared by the request's rows)."""
    max_context: int | None = None
    """Prompt + completion token limit; None = the model config's `max_position_embeddings`."""
    stop_on_eos: bool = True
    """Also end rows on the model's eos ids (generation config and tokenizer), not only on stop_token_ids."""
    prune_fraction: float = 0.25
    """Drop finished rows from the running batch (a KV-cache copy) once they are this fraction of it."""
    prefix_cache_mib: int = 512
    """Memory for the prefix cache (MiB; 0 turns it off): the keys and values of recent prompts and
    completions of the served adapter, so a prompt that starts like one decoded before (an agent's
    next turn, a group's shared scenario) prefills only its new tokens. SmolLM2-135M in bfloat16
    holds ~23k tokens in 512 MiB. Emptied whenever the serving copy is re-merged."""
    batch_wait_s: float = 0.005
    """A new batch waits until no request has arrived for this long, so a burst of HTTP requests
    (they arrive ~1 ms apart as the server parses them) starts as one batch rather than one batch
    and a join (one more prefill forward, one more cache copy)."""
    batch_wait_max_s: float = 0.05
    """...but starts at most this long after the worker saw its first request."""
    merged_serving: bool = True
    """Decode the served adapter's rows on a serving copy: the weights with that adapter merged in,
    or the base weights plus its update unmerged (`serve_unmerged`); fast. False runs every row
    through the model as given (peft's per-row adapter path: slow, no extra memory)."""
    serve_adapter: str | None = None
    """The adapter merged into the serving copy: None = the peft model's active adapter when the engine
    starts (the trainer's), "__base__" = the base model (also what a plain model serves)."""
    serve_dtype: torch.dtype | str = "auto"
    """dtype of the serving copy. "auto": bfloat16 for a peft model where the hardware has fast bf16
    (CUDA, or a CPU with AMX or AVX512-BF16 where a bf16 matmul measures faster than float32:
    `hardware.cpu_bf16_pays`), else the model's dtype; a plain model is then served as
    it is (no copy). A dtype: always that one (a plain model in another dtype gets a cast copy). bf16
    logprobs differ from the fp32 trainer's (SmolLM2: ~0.03 nats on average, up to ~0.15), a mismatch
    the trainer's truncated importance sampling corrects; float32 reproduces peft's logprobs to ~1e-5."""
    serve_unmerged: bool | None = None
    """Serve the adapter unmerged: the trainer's own base weights (shared, not copied) plus the
    adapter's low-rank update in every adapted projection (`lora_serving.UnmergedWeights`), instead
    of a merged copy. Only where the serving dtype is the model's. None (auto): where the base
    weights are packed for decoding (`pack_weights`): a float32 model on a CPU where bf16 does not pay.
    There the packed copies take the merged copy's place in memory, and a train step merges the
    new update into them in place (float32 decode steps multiply by base + update as one packed
    matrix), with no second copy of the weights. True: whenever the dtype allows it; False:
    always a merged copy."""
    pack_weights: bool | Literal["head"] | None = None
    """Decode through oneDNN-packed copies of the serving copy's matmul weights (CPU only; one more
    copy of those weights in memory: ~540 MB for SmolLM2-135M in float32, half that in bf16). None:
    bf16 weights where oneDNN packs them, and float32 weights on a CPU where bf16 does not pay (where
    float32 is what "auto" serves: 1.3-1.5x a decode step on an AVX2-only AMD EPYC, see
    docs/benchmarks.md); float32 is not packed where bf16 is served (not measured there). True:
    pack whatever oneDNN packs; False: never. "head": the output head only (the largest matmul of a
    decode step, and one a LoRA step never re-merges, so it is packed once: 113 MB more for
    SmolLM2-135M in float32; what `art demo` does within its memory budget). An unmerged serving
    copy (`serve_unmerged`) packs every base weight for "head" as for None: its packs replace the
    merged copy rather than add to it."""

    adapt_threads: bool = False
    """Choose the decode loop's thread count by timing its own steps (`engine.torch.threads`): 1 or
    every usable CPU, whichever is faster now, re-checked every few hundred steps and when steps
    slow down. Under other work on the same cores fewer threads are often much faster (OpenMP's
    barriers wait for descheduled threads; docs/benchmarks.md). Off by default: a matmul's float
    rounding depends on its thread count, so with it on, the same seeded request can sample other
    tokens from one moment to the next, and seeded runs stop reproducing. False: torch's thread
    count as set."""

    def __post_init__(self) -> None:
        if self.serve_dtype != "auto" and not (
            isinstance(self.serve_dtype, torch.dtype) and self.serve_dtype.is_floating_point
        ):
            raise ValueError(
                f"serve_dtype must be 'auto' or a floating-point torch dtype such as torch.bfloat16, "
                f"got {self.serve_dtype!r}"
            )
        if (
            self.pack_weights is not None
            and not isinstance(self.pack_weights, bool)
            and self.pack_weights != "head"
        ):
            raise TypeError(
                f"pack_weights must be None (auto), True, False or 'head', got {self.pack_weights!r}"
            )
        if self.serve_unmerged is not None and not isinstance(self.serve_unmerged, bool):
            raise TypeError(f"serve_unmerged must be None (auto), True or False, got {self.serve_unmerged!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_queued_rows < 1:
            raise ValueError(f"max_queued_rows must be >= 1, got {self.max_queued_rows}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(
                f"max_context must be >= 2 (a prompt token and a new one), got {self.max_context}"
            )
        if self.prefix_cache_mib < 0:
            raise ValueError(
                f"prefix_cache_mib must be >= 0 (0 turns the cache off), got {self.prefix_cache_mib}"
            )
        if not 0 <= self.batch_wait_s <= 1:
            raise ValueError(f"batch_wait_s must be between 0 and 1 second, got {self.batch_wait_s}")
        if not 0 <= self.batch_wait_max_s <= 1:
            raise ValueError(f"batch_wait_max_s must be between 0 and 1 second, got {self.batch_wait_max_s}")
        if not 0 < self.prune_fraction <= 1:
            raise ValueError(f"prune_fraction must be in (0, 1], got {self.prune_fraction}")


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine started."""

    batches: int
    """Batches decoded."""
    rows: int
    """Completions decoded."""
    tokens: int
    """Tokens sampled."""
    max_batch_rows: int
    """Largest batch so far, in rows."""
    merges: int = 0
    """Times the serving copy was (re-)merged, including at construction; 0 without one."""
    merge_seconds: float = 0.0
    """Wall seconds those merges took, summed (on the engine's thread, which decodes nothing
    meanwhile); 0.0 without a serving copy."""
    aborted: int = 0
    """Rows ended early because their request was cancelled (a closed stream, a cancelled call)."""
    joins: int = 0
    """Times queued rows joined a running batch (continuous batching)."""
    joined_rows: int = 0
    """Rows that joined a running batch rather than starting one."""
    prompt_tokens: int = 0
    """Prompt tokens looked up in the prefix cache (the served adapter's distinct prompts)."""
    cached_prompt_tokens: int = 0
    """Of those, the tokens the prefix cache held, which their prefill skipped."""
    replicas_down: int = 0
    """Several replicas (`engine.replicas`): replicas not serving now, being rebuilt or down for good."""
    replica_restarts: int = 0
    """Several replicas: times a dead replica was rebuilt and rejoined."""
    replicas_lost: int = 0
    """Several replicas: replicas down for good (no factory, or every rebuild failed)."""
