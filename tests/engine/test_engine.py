"""TorchEngine and the sampler: batching invariance, exact logprobs, seeds, stops, adapters, pause."""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from art_core.engine.config import EngineConfig, GenerationRequest
from art_core.engine.errors import ContextLengthError, EngineClosedError, UnknownAdapterError
from art_core.engine.protocol import Completion
from art_core.engine.sampling import (
    SamplingParams,
    chosen_logprobs,
    find_stop,
    inverse_cdf,
    sample_next,
    sample_nucleus,
    top_p_filter,
)
from art_core.engine.torch.engine import TorchEngine
from art_core.models.loading import LoadedModel, load_model
from tests.tolerances import assert_close, assert_close_to_model, model_shape, model_tolerance

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
TEXTS = ["def add(a, b):", "import os\nimport sys\n", "x", "class Foo:\n    def __init__(self):", "return 1"]


@pytest.fixture
def engine(tiny_model: LoadedModel) -> Iterator[TorchEngine]:
    eng = TorchEngine(tiny_model.model, tiny_model.tokenizer)
    yield eng
    eng.close()


def prompts(tiny_model: LoadedModel) -> list[list[int]]:
    return [tiny_model.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


async def one(
    engine: TorchEngine, prompt: list[int], params: SamplingParams, adapter: str | None = None
) -> Completion:
    (completion,) = await engine.generate(GenerationRequest(prompt, params, adapter))
    return completion


def teacher_forced(model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log-softmax [len(completion), V] of a plain forward over prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


# -- sampler (pure) -------------------------------------------------------------------------------


def test_sample_next_greedy_and_seeded_rows_ignore_batch_composition() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    temps = torch.tensor([0.0, 1.0, 1.0, 0.7])
    top_ps = torch.tensor([1.0, 1.0, 0.9, 1.0])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)]
    batch = sample_next(logits, temps, top_ps, gens)
    assert batch[0] == logits[0].argmax()
    for i in range(4):
        alone = sample_next(
            logits[i : i + 1], temps[i : i + 1], top_ps[i : i + 1], [torch.Generator().manual_seed(i + 1)]
        )
        assert alone.item() == batch[i].item()


def test_sample_next_follows_the_distribution_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = [sample_next(logits, torch.tensor([1.0]), torch.tensor([1.0]), [gen]).item() for _ in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    nucleus = [
        sample_next(logits, torch.tensor([1.0]), torch.tensor([0.7]), [gen]).item() for _ in range(500)
    ]
    assert set(nucleus) == {0, 1}
    kept = top_p_filter(torch.tensor([[0.5, 0.3, 0.15, 0.05]]), torch.tensor([0.7]))
    assert torch.equal(kept, torch.tensor([[0.5, 0.3, 0.0, 0.0]]))


def test_sample_next_from_the_callers_probs_draws_the_same_tokens() -> None:
    """At temperature 1 the caller's softmax replaces the sampler's own: same draws."""
    torch.manual_seed(5)
    logits = torch.randn(64, 3000) * 4
    probs = torch.softmax(logits, dim=-1)
    for temps, top_ps in [
        (torch.ones(64), torch.ones(64)),
        (torch.ones(64), torch.full((64,), 0.8)),
        (torch.tensor([0.0, 1.0] * 32), torch.ones(64)),  # greedy rows among them
        (torch.tensor([0.5, 1.0] * 32), torch.ones(64)),  # other temperatures: the softmax path
    ]:
        draws = [
            sample_next(logits, temps, top_ps, [torch.Generator().manual_seed(i) for i in range(64)], p)
            for p in (None, probs)
        ]
        assert torch.equal(draws[0], draws[1])


@pytest.mark.parametrize("width", [5000, 49152, 256 * 7 + 3])  # ragged last block, whole blocks
def test_blocked_inverse_cdf_picks_the_column_of_one_full_cumsum(width: int) -> None:
    torch.manual_seed(width)
    probs = torch.softmax(torch.randn(64, width, dtype=torch.float64) * 3, dim=-1)
    probs[:8, 100:] = 0.0  # a grammar's mask: most blocks hold nothing
    uniforms = torch.rand(64, dtype=torch.float64)
    uniforms[:4] = torch.tensor([0.0, 0.9999999, 0.5, 0.999999])
    cdf = probs.cumsum(-1)
    naive = [int((cdf[i] <= uniforms[i] * cdf[i, -1]).sum()) for i in range(64)]
    picked = inverse_cdf(probs, uniforms)
    assert picked.tolist() == naive
    assert bool((probs.gather(1, picked[:, None]) > 0).all())


def test_inverse_cdf_never_picks_a_zero_when_rounding_overshoots() -> None:
    probs = torch.zeros(3, 4000)
    probs[0, 10], probs[1, 3999], probs[2, 700] = 1.0, 1.0, 1e-3
    picked = inverse_cdf(probs, torch.tensor([1.0, 1.0, 1.0]))  # u = 1: the target is the total
    assert picked.tolist() == [10, 3999, 700]
    small = inverse_cdf(probs[:, :50], torch.tensor([1.0, 1.0, 1.0]))  # the flat path
    assert small.tolist() == [10, 0, 0]  # rows 1 and 2 have nothing in their first 50 columns


def test_chosen_logprobs_equal_log_softmax_even_where_the_probability_underflows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 3000) * 3
    logits[0, 7] = -200.0  # exp underflows to 0 in float32: a token only a grammar would force
    probs = torch.softmax(logits, dim=-1)
    ids = torch.randint(0, 3000, (16,))
    ids[0] = 7
    expected = torch.log_softmax(logits, dim=-1).gather(1, ids[:, None])[:, 0]
    got = chosen_logprobs(logits, probs, ids)
    assert bool(torch.isfinite(got).all())
    assert_close(got, expected, dtype=torch.float32, length=3000)  # a softmax over 3000 logits


@pytest.mark.parametrize("scale", [0.1, 1.0, 5.0])  # flat (needs the full sort) to peaked (top-64 suffices)
def test_nucleus_candidates_match_a_full_sort(scale: float) -> None:
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 5000) * scale, dim=-1)
    top_ps = torch.tensor([0.1, 0.5, 0.9, 0.95, 0.99, 0.999])
    uniforms = torch.rand(6)
    values, ids = probs.sort(dim=-1, descending=True)
    kept = top_p_filter(values, top_ps)
    cdf = kept.cumsum(-1)
    naive = [ids[i, int((cdf[i] <= uniforms[i] * cdf[i, -1]).sum())].item() for i in range(6)]
    assert sample_nucleus(probs, top_ps, uniforms).tolist() == naive


def test_growing_cache_layer_equals_concatenation() -> None:
    from transformers.cache_utils import DynamicLayer

    from art_core.engine.torch.kv_cache import GrowingLayer

    torch.manual_seed(0)
    grow, plain = GrowingLayer(room=2), DynamicLayer()  # room 2: many reallocations
    for step, width in enumerate([5, 1, 1, 3, 1, 1, 70, 1]):
        k, v = torch.randn(4, 2, width, 8), torch.randn(4, 2, width, 8)
        got, want = grow.update(k, v), plain.update(k, v)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        if step in (2, 5):  # drop a row, repeat another (a prefill shared by two rows)
            keep = torch.tensor([0, 2, 2, 3])
            grow.batch_select_indices(keep)
            plain.batch_select_indices(keep)
    assert grow.get_seq_length() == plain.get_seq_length() == 83


def test_sampling_params_validation() -> None:
    for bad in [
        dict(n=0),
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(max_tokens=0),
        dict(top_logprobs=21),
        dict(stop=("",)),
    ]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    assert SamplingParams(stop="END").stop == ("END",)  # type: ignore[arg-type]
    assert find_stop("abc END x STOP", ("STOP", "END")) == 4


# -- engine -------------------------------------------------------------------------------------


async def test_batched_greedy_equals_alone_and_concurrent_calls_share_batches(
    tiny_model: LoadedModel, engine: TorchEngine
) -> None:
    ps = prompts(tiny_model)
    alone = [await one(engine, p, GREEDY) for p in ps]
    before = engine.stats().batches
    varied = [
        SamplingParams(temperature=0.0, max_tokens=2 + 2 * i) for i in range(len(ps))
    ]  # rows end at different steps
    together = await asyncio.gather(
        *[one(engine, p, GREEDY) for p in ps], *[one(engine, p, v) for p, v in zip(ps, varied, strict=True)]
    )
    assert engine.stats().batches - before < 2 * len(ps)
    assert [c.token_ids for c in together[: len(ps)]] == [c.token_ids for c in alone]
    for c, a, v in zip(together[len(ps) :], alone, varied, strict=True):
        assert a.token_ids[: len(c.token_ids)] == c.token_ids and len(c.token_ids) <= v.max_tokens
    assert engine.stats().max_batch_rows > 1


async def test_logprobs_equal_a_teacher_forced_forward(tiny_model: LoadedModel, engine: TorchEngine) -> None:
    ps = prompts(tiny_model)
    # sampled at T=0.7 and top-p 0.9, yet the reported logprobs are the raw ones (T=1, full vocabulary)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, seed=7, top_logprobs=3)
    results = await asyncio.gather(*[one(engine, p, params) for p in ps])
    for prompt, c in zip(ps, results, strict=True):
        ref = teacher_forced(tiny_model.model, prompt, c.token_ids)
        picked = ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert_close_to_model(torch.tensor(c.logprobs), picked, tiny_model.model, torch.float32)
        values, ids = ref.topk(3, dim=-1)
        assert [[i for i, _ in top] for top in c.top_logprobs] == ids.tolist()
        top = torch.tensor([[lp for _, lp in top] for top in c.top_logprobs])
        assert_close_to_model(top, values, tiny_model.model, torch.float32)
        for lp, (token, alternatives) in zip(
            c.logprobs, zip(c.token_ids, c.top_logprobs, strict=True), strict=True
        ):
            assert all(value == lp for i, value in alternatives if i == token)  # one value, not two roundings


async def test_completions_of_one_prompt_share_its_prefill(
    tiny_model: LoadedModel, engine: TorchEngine
) -> None:
    ps = prompts(tiny_model)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=11, n=4)
    shared, other = await asyncio.gather(
        engine.generate(GenerationRequest(ps[3], params)), one(engine, ps[0], GREEDY)
    )  # one batch: 4 rows with one prompt (one prefill, copied) and 1 row with another
    assert len({tuple(c.token_ids) for c in shared}) > 1
    for c in shared:
        ref = teacher_forced(tiny_model.model, ps[3], c.token_ids)
        picked = ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert_close_to_model(torch.tensor(c.logprobs), picked, tiny_model.model, torch.float32)
    assert other.token_ids == (await one(engine, ps[0], GREEDY)).token_ids


async def test_seed_reproducible_in_any_batch_and_n(tiny_model: LoadedModel, engine: TorchEngine) -> None:
    ps = prompts(tiny_model)
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=123, n=3)
    (first,) = await asyncio.gather(engine.generate(GenerationRequest(ps[0], seeded)))
    crowd = await asyncio.gather(
        *[one(engine, p, SamplingParams(max_tokens=20)) for p in ps[1:]],
        engine.generate(GenerationRequest(ps[0], seeded)),
    )
    again = crowd[-1]
    assert isinstance(again, list) and len(first) == len(again) == 3
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) > 1  # the n samples differ from each other
    other = await engine.generate(
        GenerationRequest(ps[0], SamplingParams(temperature=1.0, max_tokens=16, seed=124))
    )
    assert other[0].token_ids != first[0].token_ids


async def test_n_larger_than_the_batch_flows_through_it(tiny_model: LoadedModel, engine: TorchEngine) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5, n=5)
    small = TorchEngine(tiny_model.model, tiny_model.tokenizer, EngineConfig(max_batch_size=2))
    try:
        split = await small.generate(GenerationRequest(prompts(tiny_model)[2], params))
        # Rows beyond the batch size join the running batch as earlier rows finish.
        assert small.stats().batches == 1 and small.stats().max_batch_rows == 2
    finally:
        small.close()
    whole = await engine.generate(GenerationRequest(prompts(tiny_model)[2], params))
    assert [c.token_ids for c in split] == [c.token_ids for c in whole]


async def test_top_p_tiny_is_greedy(tiny_model: LoadedModel, engine: TorchEngine) -> None:
    for p in prompts(tiny_model)[:3]:
        nucleus = await one(engine, p, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12))
        assert nucleus.token_ids == (await one(engine, p, GREEDY)).token_ids


async def test_max_tokens_stop_ids_and_stop_strings(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    engine = TorchEngine(tiny_model.model, tok, EngineConfig(stop_on_eos=False))
    try:
        prompt = prompts(tiny_model)[0]
        full = await one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40))
        assert len(full.token_ids) == 40 and full.finish_reason == "length"
        assert full.text == tok.decode(
            full.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

        stop_id = full.token_ids[5]
        cut = full.token_ids.index(stop_id) + 1
        by_id = await one(
            engine, prompt, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(stop_id,))
        )
        assert by_id.token_ids == full.token_ids[:cut] and by_id.finish_reason == "stop"
        assert by_id.text == tok.decode(full.token_ids[: cut - 1], skip_special_tokens=False)

        start = len(full.text) // 2
        stop = next(
            full.text[i : i + 2] for i in range(start, len(full.text)) if full.text[i : i + 2].strip()
        )
        by_str = await one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)))
        assert by_str.finish_reason == "stop" and by_str.text == full.text[: full.text.find(stop)]
        assert by_str.token_ids == full.token_ids[: len(by_str.token_ids)]
        assert stop in tok.decode(by_str.token_ids) and stop not in tok.decode(by_str.token_ids[:-1])
    finally:
        engine.close()


async def test_the_models_eos_ends_a_row_and_is_kept_in_token_ids(tiny_model: LoadedModel) -> None:
    prompt = prompts(tiny_model)[1]
    plain = TorchEngine(tiny_model.model, tiny_model.tokenizer, EngineConfig(stop_on_eos=False))
    try:
        full = await one(plain, prompt, SamplingParams(temperature=0.0, max_tokens=20))
    finally:
        plain.close()
    model = copy.deepcopy(tiny_model.model)
    model.generation_config.eos_token_id = [tiny_model.tokenizer.eos_token_id, full.token_ids[4]]
    engine = TorchEngine(model, tiny_model.tokenizer)  # stop_on_eos: ends on the generation config's eos ids
    try:
        c = await one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=20))
        end = full.token_ids.index(full.token_ids[4]) + 1
        assert c.finish_reason == "stop" and c.token_ids == full.token_ids[:end]
        assert c.text == tiny_model.tokenizer.decode(full.token_ids[: end - 1], skip_special_tokens=False)
    finally:
        engine.close()


async def test_context_length(tiny_model: LoadedModel) -> None:
    engine = TorchEngine(
        tiny_model.model, tiny_model.tokenizer, EngineConfig(max_context=32, stop_on_eos=False)
    )
    try:
        with pytest.raises(ContextLengthError, match="32"):
            await one(engine, [5] * 32, GREEDY)
        capped = await one(engine, [5] * 29, SamplingParams(temperature=0.0, max_tokens=100))
        assert len(capped.token_ids) == 3 and capped.finish_reason == "length"
    finally:
        engine.close()


async def test_pause_holds_requests_until_resume(tiny_model: LoadedModel, engine: TorchEngine) -> None:
    ps = prompts(tiny_model)
    engine.pause()
    tasks = [asyncio.create_task(one(engine, p, GREEDY)) for p in ps]
    await asyncio.sleep(0.3)
    assert not any(t.done() for t in tasks) and engine.stats().batches == 0
    engine.resume()
    done = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    assert len(done) == len(ps) and engine.stats().batches >= 1


async def test_worker_error_reaches_the_caller_and_the_engine_recovers(
    tiny_model: LoadedModel, engine: TorchEngine
) -> None:
    def fail_once(*_: Any) -> None:
        handle.remove()
        raise RuntimeError("injected failure")

    # on the embedding: every forward runs it, transformers' and the engine's own steps alike
    handle = tiny_model.model.get_input_embeddings().register_forward_pre_hook(fail_once)
    with pytest.raises(RuntimeError, match="injected failure"):
        await asyncio.wait_for(one(engine, prompts(tiny_model)[0], GREEDY), timeout=60)
    assert len((await one(engine, prompts(tiny_model)[0], GREEDY)).token_ids) > 0
    with pytest.raises(UnknownAdapterError, match="not loaded"):
        await one(engine, prompts(tiny_model)[0], GREEDY, adapter="nope")
    with pytest.raises(ValueError, match="token ids"):  # rejected up front: it would fail its whole batch
        await one(engine, [len(tiny_model.tokenizer) + 5], GREEDY)


async def test_a_cancelled_request_is_dropped_and_others_still_run(
    tiny_model: LoadedModel, engine: TorchEngine
) -> None:
    engine.pause()
    doomed = asyncio.create_task(one(engine, prompts(tiny_model)[0], GREEDY))
    kept = asyncio.create_task(one(engine, prompts(tiny_model)[1], GREEDY))
    await asyncio.sleep(0.05)
    doomed.cancel()
    await asyncio.sleep(0.05)
    engine.resume()
    assert len((await asyncio.wait_for(kept, timeout=60)).token_ids) > 0
    assert doomed.cancelled() and engine.stats().rows == 1


async def test_close_fails_waiting_requests(tiny_model: LoadedModel) -> None:
    engine = TorchEngine(tiny_model.model, tiny_model.tokenizer)
    engine.pause()
    task = asyncio.create_task(one(engine, prompts(tiny_model)[0], GREEDY))
    await asyncio.sleep(0.05)
    engine.close()
    with pytest.raises(EngineClosedError):
        await asyncio.wait_for(task, timeout=10)
    with pytest.raises(EngineClosedError):
        await one(engine, prompts(tiny_model)[0], GREEDY)


# -- adapters -----------------------------------------------------------------------------------


@pytest.fixture
def peft_setup(tiny_model: LoadedModel, tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    """A private PeftModel copy with a random (non-zero) 'trainer' adapter saved to tmp_path."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False
    )
    torch.manual_seed(1)
    peft_model = get_peft_model(copy.deepcopy(tiny_model.model), config, adapter_name="trainer")
    peft_model.save_pretrained(str(tmp_path / "ckpt"), selected_adapters=["trainer"])
    yield peft_model, tmp_path / "ckpt" / "trainer"


async def plain_greedy(tiny_model: LoadedModel, ps: list[list[int]]) -> list[Completion]:
    """Greedy completions of the shared plain (adapter-free) model."""
    engine = TorchEngine(tiny_model.model, tiny_model.tokenizer)
    try:
        return [await one(engine, p, GREEDY) for p in ps]
    finally:
        engine.close()


def _trainable_names(model: Any) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


async def test_adapters_change_outputs_and_mix_in_one_batch(
    tiny_model: LoadedModel, peft_setup: tuple[Any, Path]
) -> None:
    peft_model, saved = peft_setup
    peft_model.train()
    trainable = _trainable_names(peft_model)
    engine = TorchEngine(peft_model, tiny_model.tokenizer)
    try:
        engine.add_adapter("agent@1", saved)
        assert set(engine.adapters()) == {"trainer", "agent@1"}
        assert peft_model.active_adapters == ["trainer"] and peft_model.training
        assert _trainable_names(peft_model) == trainable
        ps = prompts(tiny_model)
        base = [await one(engine, p, GREEDY) for p in ps]
        assert [c.token_ids for c in base] == [c.token_ids for c in await plain_greedy(tiny_model, ps)]
        tuned = [await one(engine, p, GREEDY, adapter="agent@1") for p in ps]
        assert any(b.token_ids != t.token_ids for b, t in zip(base, tuned, strict=True))
        mixed = await asyncio.gather(
            *[one(engine, p, GREEDY, adapter="agent@1" if i % 2 else None) for i, p in enumerate(ps)]
        )
        expected = [tuned[i] if i % 2 else base[i] for i in range(len(ps))]
        assert [c.token_ids for c in mixed] == [c.token_ids for c in expected]
        # A request returns as soon as its rows finish, possibly while its batch still runs in eval
        # mode; the modes are back once the batch is over, which pause() (what a trainer calls) waits for.
        with engine.paused():
            assert peft_model.training and peft_model.active_adapters == ["trainer"]
        with pytest.raises(ValueError, match="already loaded"):
            engine.add_adapter("agent@1", saved)
        with pytest.raises(ValueError, match="not added by this engine"):
            engine.remove_adapter("trainer")
        engine.remove_adapter("agent@1")
        assert engine.adapters() == ["trainer"]
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_adapter_logprobs_match_the_trainer_view(
    tiny_model: LoadedModel, peft_setup: tuple[Any, Path], dtype: torch.dtype
) -> None:
    peft_model, saved = peft_setup
    engine = TorchEngine(peft_model, tiny_model.tokenizer, EngineConfig(serve_dtype=dtype))
    try:
        assert engine.served_adapter == "trainer"  # the active adapter decodes on the merged copy
        assert engine.serving_model is not None and next(engine.serving_model.parameters()).dtype == dtype
        prompt = prompts(tiny_model)[3]
        c = await one(engine, prompt, SamplingParams(max_tokens=16, seed=3), adapter="trainer")
        peft_model.eval()  # the trainer's own forward with its active adapter
        picked = teacher_forced(peft_model, prompt, c.token_ids).gather(
            1, torch.tensor(c.token_ids)[:, None]
        )[:, 0]
        error = (torch.tensor(c.logprobs) - picked).abs()
        if dtype == torch.float32:  # exact up to float rounding
            assert error.max() <= model_tolerance(peft_model, dtype, scale=float(picked.abs().max()))
        else:  # the serving/trainer mismatch that importance sampling corrects (~0.03 mean on SmolLM2 too)
            assert error.mean() < 0.1 and error.max() < 0.3
    finally:
        engine.close()


async def test_adapter_added_while_paused_and_removed_while_queued(
    tiny_model: LoadedModel, peft_setup: tuple[Any, Path]
) -> None:
    _, saved = peft_setup
    engine = TorchEngine(
        copy.deepcopy(tiny_model.model), tiny_model.tokenizer
    )  # plain model: add_adapter wraps it
    try:
        with engine.paused():
            engine.add_adapter("a", saved)  # runs at once in this thread (no deadlock)
        engine.add_adapter("b", saved)  # runs on the worker
        assert engine.adapters() == ["a", "b"]
        prompt = prompts(tiny_model)[0]
        engine.pause()
        doomed = asyncio.create_task(one(engine, prompt, GREEDY, adapter="a"))
        fine = asyncio.create_task(one(engine, prompt, GREEDY, adapter="b"))
        await asyncio.sleep(0.05)
        engine.remove_adapter("a")  # while paused: at once; the queued request for "a" must fail alone
        engine.resume()
        with pytest.raises(UnknownAdapterError, match="removed"):
            await asyncio.wait_for(doomed, timeout=60)
        assert len((await asyncio.wait_for(fine, timeout=60)).token_ids) > 0
        with pytest.raises(ValueError, match="only adapter"):
            engine.remove_adapter("b")
    finally:
        engine.close()


# -- the merged serving copy ---------------------------------------------------------------------

EXACT = EngineConfig(serve_dtype=torch.float32)
"""A float32 serving copy: must reproduce the peft model to float rounding."""
WITH_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=10, top_logprobs=2)


def _scale_lora_b(model: Any, adapter: str, factor: float, through_data: bool = False) -> None:
    """A stand-in for a train step: change the adapter's lora_B weights in place."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name and f".{adapter}." in name:
                (param.data if through_data else param).mul_(factor)


async def _greedy(engine: TorchEngine, ps: list[list[int]], adapter: str | None) -> list[Completion]:
    return list(await asyncio.gather(*[one(engine, p, WITH_LOGPROBS, adapter) for p in ps]))


async def _assert_serves_the_trainer(
    engine: TorchEngine, peft_model: Any, tokenizer: Any, ps: list[list[int]]
) -> None:
    """The engine's greedy "trainer" completions are peft's own from the model's current weights."""
    _assert_same(
        await _greedy(engine, ps, "trainer"), await _peft_reference(peft_model, tokenizer, ps, "trainer")
    )


async def _peft_reference(
    model: Any, tokenizer: Any, ps: list[list[int]], adapter: str | None
) -> list[Completion]:
    """What peft's own per-row adapter path (no serving copy) samples from the model's current weights."""
    engine = TorchEngine(model, tokenizer, EngineConfig(merged_serving=False))
    try:
        return await _greedy(engine, ps, adapter)
    finally:
        engine.close()


def _assert_same(got: list[Completion], want: list[Completion], exact: bool = False) -> None:
    """The same tokens, and logprobs equal (`exact`) or equal up to the float32 rounding of two
    forwards of the tiny model."""
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    length, depth = model_shape(_tiny_model())
    for g, w in zip(got, want, strict=True):
        if exact:
            assert g.logprobs == w.logprobs
        else:
            assert_close(
                torch.tensor(g.logprobs),
                torch.tensor(w.logprobs),
                dtype=torch.float32,
                length=length,
                depth=depth,
            )


@functools.cache
def _tiny_model() -> Any:
    """The tiny test model, for its shape (the engine tests' tolerances derive from it)."""
    return load_model("tiny-random").model


async def test_merged_copy_reproduces_the_peft_model(
    tiny_model: LoadedModel, peft_setup: tuple[Any, Path]
) -> None:
    peft_model, _ = peft_setup
    ps = prompts(tiny_model)
    reference = await _peft_reference(peft_model, tiny_model.tokenizer, ps, "trainer")
    assert reference != await _peft_reference(
        peft_model, tiny_model.tokenizer, ps, None
    )  # the adapter matters
    exact = TorchEngine(peft_model, tiny_model.tokenizer, EXACT)
    fast = TorchEngine(peft_model, tiny_model.tokenizer, EngineConfig(serve_dtype=torch.bfloat16))
    try:
        _assert_same(await _greedy(exact, ps, "trainer"), reference)
        bf16 = await _greedy(fast, ps, "trainer")
    finally:
        exact.close()
        fast.close()
    assert (
        sum(b.token_ids[:3] == r.token_ids[:3] for b, r in zip(bf16, reference, strict=True)) >= len(ps) - 1
    )
    first = torch.tensor([b.logprobs[0] - r.logprobs[0] for b, r in zip(bf16, reference, strict=True)])
    assert first.abs().mean() < 0.1 and first.abs().max() < 0.3  # the first token has the same context


@pytest.mark.parametrize("through_data", [False, True])  # .data writes bypass torch's version counters
async def test_resume_serves_the_weights_trained_while_paused(
    tiny_model: LoadedModel, peft_setup: tuple[Any, Path], through_data: bool
) -> None:
    peft_model, _ = peft_setup
    ps = prompts(tiny_model)
    engine = TorchEngine(peft_model, tiny_model.tokenizer, EXACT)
    try:
        before = await _greedy(engine, ps, "trainer")
        merges, seconds = engine.stats().merges, engine.stats().merge_seconds
        with engine.paused():
            _scale_lora_b(peft_model, "trainer", -3.0, through_data)
        # merged by `resume` itself, on this thread, before it returned (no request has run since)
        assert engine.stats().merges == merges + 1
        assert engine.stats().merge_seconds > seconds  # the re-merge's time is counted
        after = await _greedy(engine, ps, "trainer")
        assert engine.stats().merges == merges + 1
    finally:
        engine.close()
    trained = await _peft_reference(peft_model, tiny_model.tokenizer, ps, "trainer")
    _assert_same(after, trained)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]


async def test_a_resume_after_writing_nothing_re_merges_nothing_yet_sees_tracked_writes(
    tiny_model: LoadedModel, peft_setup: tuple[Any, Path]
) -> None:
    """`resume(rewritten=False)` (a train step that took no optimizer step) skips the re-merge that
    `resume()` forces; a write through torch made while paused is still seen by its version counters."""
    peft_model, _ = peft_setup
    ps = prompts(tiny_model)
    engine = TorchEngine(peft_model, tiny_model.tokenizer, EXACT)
    try:
        await _greedy(engine, ps, "trainer")
        merges, seconds = engine.stats().merges, engine.stats().merge_seconds
        engine.pause()
        engine.resume(rewritten=False)
        await _greedy(engine, ps, "trainer")
        assert (engine.stats().merges, engine.stats().merge_seconds) == (merges, seconds)
        engine.pause()
        engine.resume()  # the default forces the re-merge
        await _greedy(engine, ps, "trainer")
        assert engine.stats().merges == merges + 1
        engine.pause()
        _scale_lora_b(peft_model, "trainer", -3.0)  # through torch: its version counters tell
        engine.resume(rewritten=False)
        await _assert_serves_the_trainer(engine, peft_model, tiny_model.tokenizer, ps)
        assert engine.stats().merges == merges + 2
    finally:
        engine.close()


async def test_weight_changes_without_a_pause_are_seen(
    tiny_model: LoadedModel, peft_setup: tuple[Any, Path]
) -> None:
    peft_model, _ = peft_setup
    ps = prompts(tiny_model)
    engine = TorchEngine(peft_model, tiny_model.tokenizer, EXACT)
    try:
        await _greedy(engine, ps, "trainer")
        merges, seconds = engine.stats().merges, engine.stats().merge_seconds
        await _greedy(engine, ps, "trainer")
        assert engine.stats().merges == merges  # nothing changed: nothing re-merged
        assert engine.stats().merge_seconds == seconds
        _scale_lora_b(peft_model, "trainer", -3.0)  # through torch: its version counters tell
        await _assert_serves_the_trainer(engine, peft_model, tiny_model.tokenizer, ps)
        _scale_lora_b(peft_model, "trainer", 0.5, through_data=True)  # invisible: the caller says so
        engine.weights_updated()
        await _assert_serves_the_trainer(engine, peft_model, tiny_model.tokenizer, ps)
    finally:
        engine.close()


async def test_requests_after_a_weight_change_do_not_join_a_batch_on_the_old_weights(
    tiny_model: LoadedModel, peft_setup: tuple[Any, Path]
) -> None:
    """A train step without a pause while a batch runs: the running row keeps its weights, the
    request sent after the change waits for the next batch (re-merged) instead of joining."""
    peft_model, _ = peft_setup
    ps = prompts(tiny_model)
    engine = TorchEngine(peft_model, tiny_model.tokenizer, EXACT)
    try:
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        running = asyncio.create_task(one(engine, ps[0], long, "trainer"))
        while engine.stats().batches == 0:
            await asyncio.sleep(0.001)
        _scale_lora_b(peft_model, "trainer", -3.0)
        late = asyncio.create_task(one(engine, ps[1], WITH_LOGPROBS, "trainer"))
        await asyncio.sleep(0.05)  # it is queued while the first batch runs
        assert not running.done(), "the first batch ended before the late request: make it longer"
        await asyncio.gather(running, late)
        assert (engine.stats().batches, engine.stats().joins) == (2, 0)
        _assert_same(
            [late.result()], await _peft_reference(peft_model, tiny_model.tokenizer, ps[1:2], "trainer")
        )
    finally:
        engine.close()


async def test_prompts_seen_before_reuse_their_cache_until_the_adapter_changes(
    tiny_model: LoadedModel, peft_setup: tuple[Any, Path]
) -> None:
    peft_model, _ = peft_setup
    ps = [p * 16 for p in prompts(tiny_model)]  # at least one of the cache's 16-token blocks each
    engine = TorchEngine(peft_model, tiny_model.tokenizer, EXACT)
    try:
        first = await _greedy(engine, ps, "trainer")
        assert engine.stats().cached_prompt_tokens == 0
        _assert_same(await _greedy(engine, ps, "trainer"), first)
        stats = engine.stats()
        assert stats.cached_prompt_tokens == sum(len(p) - 1 for p in ps)  # all but each last token
        _scale_lora_b(peft_model, "trainer", -3.0)  # a train step: the cached keys are stale now
        await _assert_serves_the_trainer(engine, peft_model, tiny_model.tokenizer, ps)
        after = engine.stats()
        assert (
            after.prompt_tokens > stats.prompt_tokens
            and after.cached_prompt_tokens == stats.cached_prompt_tokens
        )
    finally:
        engine.close()


async def test_mixed_batch_rows_equal_their_solo_results(
    tiny_model: LoadedModel, peft_setup: tuple[Any, Path]
) -> None:
    peft_model, saved = peft_setup
    ps = prompts(tiny_model)
    engine = TorchEngine(peft_model, tiny_model.tokenizer, EXACT)
    try:
        engine.add_adapter("old", saved)  # a checkpoint, served through peft
        with engine.paused():
            _scale_lora_b(peft_model, "trainer", -3.0)  # the live adapter moved on since "old"
        targets: list[str | None] = ["trainer", None, "old"]
        solo = {t: [await one(engine, p, WITH_LOGPROBS, t) for p in ps] for t in targets}
        assert len({tuple(tuple(c.token_ids) for c in v) for v in solo.values()}) == 3  # all three differ
        batches = engine.stats().batches
        mixed = await asyncio.gather(*[one(engine, p, WITH_LOGPROBS, t) for t in targets for p in ps])
        assert engine.stats().batches == batches + 1  # one batch, decoded as two sub-batches
        _assert_same(list(mixed), [c for t in targets for c in solo[t]])
    finally:
        engine.close()
    _assert_same(solo["old"], await _peft_reference(peft_model, tiny_model.tokenizer, ps, "old"))
    _assert_same(solo[None], await _peft_reference(peft_model, tiny_model.tokenizer, ps, None))


async def test_an_adapter_that_cannot_be_merged_is_served_through_peft(tiny_model: LoadedModel) -> None:
    from peft import LoraConfig, get_peft_model

    from art_core.engine.torch.serving_weights import MergedWeights, UnsupportedAdapterError

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_bias=True, init_lora_weights=False)
    dora = get_peft_model(copy.deepcopy(tiny_model.model), config, adapter_name="live")
    with pytest.raises(UnsupportedAdapterError, match="lora_bias"):
        MergedWeights(dora, "live", torch.bfloat16)
    engine = TorchEngine(dora, tiny_model.tokenizer, EXACT)
    try:
        assert engine.serving_model is None and engine.stats().merges == 0
        ps = prompts(tiny_model)[:2]
        _assert_same(
            await _greedy(engine, ps, "live"), await _peft_reference(dora, tiny_model.tokenizer, ps, "live")
        )
    finally:
        engine.close()


async def test_a_plain_model_gets_a_cast_copy_only_when_asked(
    tiny_model: LoadedModel, peft_setup: tuple[Any, Path]
) -> None:
    _, saved = peft_setup
    as_is = TorchEngine(tiny_model.model, tiny_model.tokenizer)  # "auto": a plain model is served as it is
    assert as_is.serving_model is None
    as_is.close()
    model = copy.deepcopy(tiny_model.model)
    engine = TorchEngine(model, tiny_model.tokenizer, EngineConfig(serve_dtype=torch.bfloat16))
    try:
        assert engine.served_adapter is None and engine.serving_model is not None
        assert next(engine.serving_model.parameters()).dtype == torch.bfloat16
        assert next(model.parameters()).dtype == torch.float32  # the caller's model is untouched
        ps = prompts(tiny_model)
        base = await _greedy(engine, ps, None)
        exact = await _peft_reference(tiny_model.model, tiny_model.tokenizer, ps, None)
        assert all(abs(b.logprobs[0] - e.logprobs[0]) < 0.3 for b, e in zip(base, exact, strict=True))
        engine.add_adapter("a", saved)  # wraps the model in peft: base rows stay on the (same) copy
        merges = engine.stats().merges
        again = await _greedy(engine, ps, None)
        _assert_same(again, base, exact=True)
        assert engine.stats().merges == merges
        tuned = await _greedy(engine, ps, "a")
        assert [c.token_ids for c in tuned] != [c.token_ids for c in base]
    finally:
        engine.close()
