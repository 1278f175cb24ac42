"""Training primitives in the spirit of Tinker: forward_backward, optim_step, save_state, load_state.

`Trainer` owns a peft model's LoRA adapter and an AdamW optimizer over its weights only. One
optimizer step (`train_step`) accumulates gradients over micro-batches whose losses are normalised
by the whole batch (`BatchTotals`), so the split into micro-batches does not change the update.

Log-probs come from the base transformer body's final hidden states and the output head, in
chunks (`token_logprobs`), so full-vocabulary logits for a whole micro-batch never exist at once,
and only at the positions that are needed (trained tokens when training). The body's pass
(`training_forward`) runs a prefix common to a micro-batch's sequences (a group's prompt) once and
adds each LoRA update with one addmm; the update equals the plain computation up to float rounding.
Where the packed forward runs the model, a micro-batch holds whole groups (each group's prompt
runs once, and larger matmuls run closer to the CPU's rate); elsewhere micro-batches are formed
within each group. The body is never
gradient-checkpointed. The KL reference is the same model with the adapter disabled: no second
copy of the weights.

State is stored without pickle: the adapter with peft's `save_pretrained` (loadable as it is by
`PeftModel.from_pretrained` and vLLM), the optimizer and RNG states as safetensors, and the
optimizer's hyper-parameters and parameter names as JSON.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file
from torch import Tensor, nn

from art_core.models.allocator import HeapTrimmer
from art_core.training.adapter_files import ADAPTER_WEIGHTS, AdapterFiles, write_safetensors
from art_core.training.batch import (
    BatchTotals,
    PreparedBatch,
    TrainingExample,
    collate,
    group_micro_batches,
    micro_batches,
)
from art_core.training.bf16_base import Bf16BaseWeights
from art_core.training.config import TrainConfig
from art_core.training.distributed import (
    World,
    all_gather_json,
    all_reduce_gradients,
    assign_shares,
    broadcast_parameters,
)
from art_core.training.forward import has_dropout, hidden_states_at, shared_prefix_length, training_kernels
from art_core.training.logprobs import token_logprobs
from art_core.training.loss import LossBatch, compute_loss
from art_core.training.packed_forward import supports_packed_forward
from art_core.training.precision import matmul_precision

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"
STATE_FORMAT = 1

_SUMMED_METRICS = ("loss", "policy_loss", "kl_loss", "tokens", "sequences")
"""Metrics that add up across micro-batches; the others are token-weighted means."""


def decoder_and_head(model: PeftModel) -> tuple[nn.Module, nn.Module]:
    """The transformer body (ids -> final normed hidden states) and the output head of a causal LM."""
    base: Any = model.get_base_model()
    if getattr(base.config, "final_logit_softcapping", None) or getattr(base.config, "logit_scale", None):
        raise NotImplementedError(
            f"{type(base).__name__} transforms its logits (soft-capping or scaling); the chunked log-prob "
            "path does not support that yet"
        )
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    if decoder is base or head is None:
        raise TypeError(
            f"cannot find the decoder body and output head of {type(base).__name__}; expected a causal LM "
            "such as LlamaForCausalLM or Qwen2ForCausalLM"
        )
    return decoder, head


def _fused_adamw(params: list[nn.Parameter]) -> bool:
    """AdamW's fused kernel (one pass over all LoRA tensors instead of ~10 ops per tensor) where torch
    has one: float parameters on CPU or CUDA. The same update as the default implementation, to float
    rounding."""
    return all(
        p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16)
        for p in params
    )


class Trainer:
    """Owns one LoRA adapter of `model` and its optimizer; see the module docstring."""

    def __init__(
        self,
        model: PeftModel,
        *,
        pad_id: int,
        adapter_name: str = "default",
        config: TrainConfig,
        share_prefixes: bool = True,
        world: World | None = None,
        lockstep: bool = False,
        seed: int = 0,
    ) -> None:
        """`share_prefixes`: run a prefix common to a micro-batch's sequences once (same update up to
        float rounding); False computes every sequence in full. `seed`: the trainer's own RNG (LoRA
        dropout), kept apart from torch's global one (which unseeded sampling draws from), saved in
        every checkpoint and restored by `load_state`, so a resumed run draws what an uninterrupted
        one would.

        `world`: one of several data-parallel ranks (art_core.training.distributed; the process
        group must be joined): rank 0's LoRA weights are copied to every rank now, each
        `train_step` trains this rank's share of the micro-batches and sums the gradients over the
        ranks. `lockstep`: every rank runs as many forward/backward passes (a rank short of
        micro-batches runs one more at zero weight), which FSDP-sharded base layers need."""
        if adapter_name not in model.peft_config:
            raise ValueError(f"model has no adapter {adapter_name!r}; it has {sorted(model.peft_config)}")
        self.model = model
        self.pad_id = pad_id
        self.adapter_name = adapter_name
        self.config = config
        marker = f".{adapter_name}."
        named = [(n, p) for n, p in model.named_parameters() if "lora_" in n and marker in n]
        if not named:
            raise ValueError(f"adapter {adapter_name!r} has no LoRA weights to train")
        self.param_names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self._adapter_files = AdapterFiles(model, adapter_name, named)
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.learning_rate,
            betas=config.adam_betas,
            weight_decay=config.weight_decay,
            fused=_fused_adamw(self.params),
        )
        self._rng: dict[str, Tensor] = {"torch_cpu": torch.Generator().manual_seed(seed).get_state()}
        self._decoder, self._head = decoder_and_head(model)
        self._bf16_base = Bf16BaseWeights()
        """The "bf16" precision on CPU: bf16 copies of the frozen base weights (`training.bf16_base`)."""
        self._share_prefixes = share_prefixes and not has_dropout(model)
        """One dropout draw for a shared prefix would replace one per row, so dropout turns sharing off."""
        self.world = world if world is not None and world.world_size > 1 else None
        self.lockstep = lockstep
        self._heap = HeapTrimmer()
        if self.world is not None:
            broadcast_parameters(self.params, self.world)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @contextlib.contextmanager
    def _own_rng(self) -> Iterator[None]:
        """Run the block on the trainer's RNG state; torch's global state is left as it was."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        devices = list(range(torch.cuda.device_count())) if cuda else []
        with torch.random.fork_rng(devices=devices):
            _set_rng_state(self._rng)
            yield
            self._rng = _rng_state()

    @contextlib.contextmanager
    def _adapter_active(self) -> Iterator[None]:
        """Our adapter active and trainable; the previously active adapter comes back afterwards."""
        previous = self.model.active_adapter
        if previous != self.adapter_name:
            self.model.set_adapter(self.adapter_name)
        for param in self.params:
            param.requires_grad_(True)
        try:
            yield
        finally:
            if previous != self.adapter_name and isinstance(previous, str):
                self.model.set_adapter(previous)

    @contextlib.contextmanager
    def _training_mode(self) -> Iterator[None]:
        """Train mode with our adapter active; afterwards eval mode (for an inference engine sharing
        the model) and the previously active adapter."""
        self.model.train()
        try:
            with self._adapter_active():
                yield
        finally:
            self.model.eval()

    def shared_prefix_length(self, input_ids: Tensor, attention_mask: Tensor) -> int:
        """Leading tokens of a micro-batch that one forward pass computes for all its rows; 0 for none."""
        return shared_prefix_length(input_ids, attention_mask) if self._share_prefixes else 0

    def _logprobs(
        self, batch: dict[str, Tensor], positions: Tensor, entropy: list[float] | None = None
    ) -> tuple[Tensor, int]:
        """[B, T] float32 log-probs of the targets at `positions` (0 elsewhere) and the shared prefix.

        With an `entropy` list, the mean entropy of the predicted distribution over `positions` is
        appended to it (no gradient; the same chunks compute it, no extra forward pass).
        """
        ids, attention = batch["input_ids"], batch["attention_mask"]
        with training_kernels(self.model, self.adapter_name):
            prefix = self.shared_prefix_length(ids, attention)
            groups = batch.get("groups") if self._share_prefixes else None
            hidden, prefix = hidden_states_at(self._decoder, ids, attention, positions, prefix, groups)
        picked, per_token = token_logprobs(
            hidden[None],
            self._head,
            batch["targets"][positions][None],
            chunk_size=self.config.logprob_chunk_size,
            with_entropy=entropy is not None,
        )
        if entropy is not None and per_token is not None:
            entropy.append(float(per_token.mean()) if per_token.numel() else 0.0)
        logprobs = torch.zeros(positions.shape, dtype=picked.dtype, device=picked.device)
        return logprobs.masked_scatter(positions, picked[0]), prefix

    def _ref_logprobs(self, batch: dict[str, Tensor], positions: Tensor) -> Tensor | None:
        if self.config.loss.kl_coef <= 0:
            return None
        with self.model.disable_adapter(), torch.no_grad():
            return self._logprobs(batch, positions)[0]

    @torch.no_grad()
    def compute_logprobs(self, examples: list[TrainingExample]) -> Tensor:
        """[B, T] log-probs of each example's targets under the current adapter (eval mode, no grad).

        Rows are aligned with `collate(examples, pad_id)["targets"]`; padding positions hold 0.
        """
        batch = {key: value.to(self.device) for key, value in collate(examples, self.pad_id).items()}
        self.model.eval()
        with self._adapter_active():
            return self._logprobs(batch, batch["attention_mask"] > 0)[0]

    def forward_backward(
        self, examples: list[TrainingExample], *, totals: BatchTotals, weight: float = 1.0
    ) -> dict[str, float]:
        """Forward and backward one micro-batch; gradients add up in the LoRA weights' `.grad`.

        `weight` scales the loss before backward (0: the passes run, nothing is learnt)."""
        if not examples:
            raise ValueError("forward_backward needs at least one example")
        batch = {key: value.to(self.device) for key, value in collate(examples, self.pad_id).items()}
        positions = batch["mask"] > 0
        with (
            self._training_mode(),
            matmul_precision(self.config.matmul_precision, self.device) as precision,
            self._bf16_base.applied(self.model, self.adapter_name)
            if precision == "bf16" and self.device.type == "cpu"
            else contextlib.nullcontext(),
        ):
            ref = self._ref_logprobs(batch, positions)
            entropy: list[float] = []
            logprobs, prefix = self._logprobs(batch, positions, entropy)
            loss_batch = LossBatch(
                logprobs=logprobs,
                old_logprobs=logprobs.detach(),
                engine_logprobs=batch["engine_logprobs"],
                advantages=batch["advantages"],
                mask=batch["mask"],
                num_sequences=totals.num_sequences,
                num_tokens=totals.num_tokens,
                max_completion_tokens=totals.max_completion_tokens,
                ref_logprobs=ref,
            )
            output = compute_loss(loss_batch, self.config.loss)
            (output.loss * weight if weight != 1.0 else output.loss).backward()
        metrics = {key: float(value) for key, value in output.metrics.items()}
        metrics.update(loss=float(output.loss.detach()), sequences=float(len(examples)))
        metrics["shared_prefix_tokens"] = float(prefix)
        if entropy:
            metrics["entropy"] = entropy[0]
        metrics.update(_logprob_metrics(logprobs.detach(), batch))
        return metrics

    def optim_step(self, learning_rate: float) -> dict[str, float]:
        """Clip the gradient norm, take one AdamW step on the LoRA weights, zero the gradients.

        A non-finite gradient norm skips the update (logged, `optim_step_skipped` = 1) rather than
        writing NaN into the adapter.
        """
        for group in self.optimizer.param_groups:
            group.update(
                lr=learning_rate, betas=self.config.adam_betas, weight_decay=self.config.weight_decay
            )
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm))
        skipped = not math.isfinite(grad_norm)
        if skipped:
            logger.warning("gradient norm is %s; skipping this optimizer step", grad_norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "learning_rate": learning_rate, "optim_step_skipped": float(skipped)}

    def train_step(self, batch: PreparedBatch, config: TrainConfig | None = None) -> dict[str, float]:
        """forward_backward over the batch's micro-batches, then one optim_step.

        `config` replaces the trainer's config from now on (learning rate, loss, micro-batch size).
        Returns training metrics only (the batch's own counts are in `batch.metrics`); `trained` is 1
        when the weights were updated. An empty batch takes no step and returns `{"trained": 0.0}`
        (`batch.warnings` say why it is empty); a non-finite gradient gives `trained` 0 and
        `optim_step_skipped` 1.
        """
        if config is not None:
            self.config = config
        if not batch.examples:
            return {"trained": 0.0}
        totals = batch.normalisers(self.config.loss.normalise_over)
        chunks = self._micro_batches(batch.examples)
        try:
            with self._own_rng():
                parts = self._forward_backward_share(chunks, totals)
        except BaseException:
            self.optimizer.zero_grad(
                set_to_none=True
            )  # no half-accumulated gradient leaks into the next step
            raise
        if self.world is not None:
            all_reduce_gradients(self.params, self.world)
            parts = [part for rank_parts in all_gather_json(parts, self.world) for part in rank_parts]
        metrics = {**combine_metrics(parts), "micro_batches": float(len(parts))}
        metrics.update(self.optim_step(self.config.learning_rate))
        metrics["trained"] = 1.0 - metrics["optim_step_skipped"]
        # The step's activations are freed but glibc keeps them; give the heap back when it has
        # grown past one step's working set (docs/benchmarks.md, "Where `art demo`'s memory goes").
        self._heap.after_step()
        return metrics

    def _forward_backward_share(
        self, chunks: list[list[TrainingExample]], totals: BatchTotals
    ) -> list[dict[str, float]]:
        """forward_backward on this rank's share of `chunks` (all of them in one process); with
        `lockstep`, padded with zero-weight passes to the largest share's length."""
        if self.world is None:
            return [self.forward_backward(chunk, totals=totals) for chunk in chunks]
        shares = assign_shares(
            [sum(len(e.sequence) for e in chunk) for chunk in chunks], self.world.world_size
        )
        mine = [chunks[i] for i in shares[self.world.rank]]
        parts = [self.forward_backward(chunk, totals=totals) for chunk in mine]
        if self.lockstep:
            for _ in range(max(len(share) for share in shares) - len(mine)):
                self.forward_backward(chunks[0], totals=totals, weight=0.0)
        return parts

    def _micro_batches(self, examples: list[TrainingExample]) -> list[list[TrainingExample]]:
        """Micro-batches when prefixes can be shared: whole groups together (`group_micro_batches`)
        where the packed forward runs each group's prompt once, else `micro_batches` within each group."""
        if not self._share_prefixes:
            return micro_batches(examples, self.config.micro_batch_tokens)
        groups: dict[int, list[TrainingExample]] = {}
        for example in examples:
            groups.setdefault(example.group_index, []).append(example)
        if supports_packed_forward(self._decoder):
            return group_micro_batches(
                list(groups.values()), self.config.micro_batch_tokens, self.config.group_pack_tokens
            )
        return [
            chunk
            for group in groups.values()
            for chunk in micro_batches(group, self.config.micro_batch_tokens)
        ]

    def save_state(self, directory: Path) -> None:
        """Write adapter, optimizer and RNG state into `directory` (created if missing)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._adapter_files.save(directory)
        optimizer_state = self.optimizer.state_dict()
        tensors = {
            f"state.{index}.{key}": value.detach().cpu().contiguous()
            for index, entry in optimizer_state["state"].items()
            for key, value in entry.items()
        }
        write_safetensors(tensors, directory / OPTIMIZER_FILE)
        write_safetensors(self._rng, directory / RNG_FILE)
        state = {
            "format": STATE_FORMAT,
            "adapter_name": self.adapter_name,
            "param_names": self.param_names,
            "param_groups": [_json_safe_group(group) for group in optimizer_state["param_groups"]],
        }
        (directory / STATE_FILE).write_text(json.dumps(state, indent=1))

    def load_state(self, directory: Path) -> None:
        """Restore what `save_state` wrote: adapter weights, optimizer state (with step counts), RNG."""
        directory = Path(directory)
        state = json.loads((directory / STATE_FILE).read_text())
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{directory / STATE_FILE}: unsupported format {state.get('format')!r}")
        if state["param_names"] != self.param_names:
            raise ValueError(
                f"{directory} holds the state of a different adapter layout (LoRA rank/targets or base model "
                "differ); build the trainer with the same LoRAConfig and base model"
            )
        _load_adapter(self.model, self.adapter_name, directory / ADAPTER_WEIGHTS)
        self.optimizer.load_state_dict(_optimizer_state(load_file(str(directory / OPTIMIZER_FILE)), state))
        self._rng = load_file(str(directory / RNG_FILE))


def combine_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Merge micro-batch metrics: sums for losses and counts, token-weighted means for the rest."""
    total_tokens = sum(part.get("tokens", 0.0) for part in parts) or 1.0
    merged: dict[str, float] = {}
    for key in {key for part in parts for key in part}:
        values = [(part[key], part.get("tokens", 0.0)) for part in parts if key in part]
        if key in _SUMMED_METRICS:
            merged[key] = sum(value for value, _ in values)
        else:
            merged[key] = sum(value * weight for value, weight in values) / total_tokens
    return merged


def _logprob_metrics(logprobs: Tensor, batch: dict[str, Tensor]) -> dict[str, float]:
    """Mean trainer log-prob and mean |trainer - engine| log-prob over trained tokens (a mismatch check)."""
    mask = batch["mask"] > 0
    engine = batch["engine_logprobs"]
    known = mask & ~torch.isnan(engine)
    metrics = {"logprob_mean": float(logprobs[mask].mean()) if mask.any() else 0.0}
    if known.any():
        metrics["engine_logprob_abs_diff"] = float((logprobs[known] - engine[known]).abs().mean())
    return metrics


def _load_adapter(model: PeftModel, adapter_name: str, path: Path) -> None:
    weights = load_file(str(path))
    result: Any = set_peft_model_state_dict(model, weights, adapter_name=adapter_name)
    marker = f".{adapter_name}."
    missing = [key for key in result.missing_keys if "lora_" in key and marker in key]
    unexpected = [key for key in result.unexpected_keys if "lora_" in key]
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match adapter {adapter_name!r}: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


def _json_safe_group(group: dict[str, Any]) -> dict[str, Any]:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in group.items()}


def _optimizer_state(tensors: dict[str, Tensor], state: dict[str, Any]) -> dict[str, Any]:
    """Rebuild a torch optimizer state_dict from the flat safetensors keys and the JSON param groups."""
    per_param: dict[int, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        per_param.setdefault(int(index), {})[name] = value
    groups = [
        {
            key: tuple(value) if isinstance(value, list) and key != "params" else value
            for key, value in group.items()
        }
        for group in state["param_groups"]
    ]
    return {"state": per_param, "param_groups": groups}


def _rng_state() -> dict[str, Tensor]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda.{index}"] = cuda_state
    return tensors


def _set_rng_state(tensors: dict[str, Tensor]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = sorted(
        (key for key in tensors if key.startswith("torch_cuda.")), key=lambda k: int(k.split(".")[1])
    )
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[key] for key in cuda_states])
