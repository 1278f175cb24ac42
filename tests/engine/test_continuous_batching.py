"""Continuous batching: rows that join a running batch decode exactly as they would alone."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from art_core.engine.config import EngineConfig, GenerationRequest
from art_core.engine.sampling import SamplingParams
from art_core.engine.torch.decoding import MIN_DROPPED_COLUMNS, DecodeBatch, RowState, shared_prompt_length
from art_core.engine.torch.engine import TorchEngine
from art_core.engine.torch.kv_cache import drop_leading_columns, growing_cache, join_caches
from art_core.models.loading import LoadedModel
from tests.helpers_models import record_prefills
from tests.tolerances import assert_close_to_model

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def _row(prompt: list[int], params: SamplingParams = GREEDY, seed: int = 0) -> RowState:
    return RowState(
        None, 0, prompt, params, None, params.max_tokens, torch.Generator().manual_seed(seed), frozenset()
    )


def _prompt(tiny_model: LoadedModel, length: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 1000 + 5 for i in range(length)]


def _alone(tiny_model: LoadedModel, prompt: list[int], params: SamplingParams = GREEDY) -> RowState:
    row = _row(prompt, params)
    with torch.inference_mode():
        DecodeBatch(tiny_model.model, tiny_model.tokenizer, [row], use_adapter_names=False).run(0.25)
    return row


def test_rows_sharing_a_prompt_prefix_prefill_it_once_and_decode_as_alone(tiny_model: LoadedModel) -> None:
    prefix = _prompt(tiny_model, 20, 9)
    first = [_row(prefix + _prompt(tiny_model, n, n)) for n in (3, 11, 1, 11)]  # 3 lengths; a duplicate
    later = {2: [_row(prefix + _prompt(tiny_model, 5, 6)), _row(prefix + [42])]}  # joiners share it too
    assert shared_prompt_length(first) == 20 and shared_prompt_length(later[2]) == 20
    assert shared_prompt_length([first[0], _row(_prompt(tiny_model, 30))]) == 0  # nothing in common
    calls, finished = [0], []

    def admit(room: int) -> list[RowState]:
        calls[0] += 1
        return later.pop(calls[0], [])

    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        prefills = record_prefills(patch)
        batch = DecodeBatch(tiny_model.model, tiny_model.tokenizer, first, use_adapter_names=False)
        batch.run(0.25, admit=admit, finished=finished.extend, max_rows=8)
    # the prefix once per prefill (batch 1), then each distinct prompt's own tokens only
    assert prefills == [(1, 20), (3, 11), (1, 20), (2, 5)]
    assert len(finished) == 6
    for row in finished:
        solo = _alone(tiny_model, row.prompt_ids)
        assert row.token_ids == solo.token_ids, "a row sharing its prefix sampled other tokens than alone"
        assert_close_to_model(
            torch.tensor(row.logprobs), torch.tensor(solo.logprobs), tiny_model.model, torch.float32
        )


def test_rows_joining_shorter_and_longer_caches_decode_as_alone(tiny_model: LoadedModel) -> None:
    first = [_row(_prompt(tiny_model, 12)), _row(_prompt(tiny_model, 9, 3))]
    # After 3 steps the cache is 12 + 3 = 15 long: a 4-token prompt joins left-padded, a 30-token
    # prompt makes the running rows left-padded instead.
    later = {
        3: [_row(_prompt(tiny_model, 4, 1))],
        5: [_row(_prompt(tiny_model, 30, 2)), _row(_prompt(tiny_model, 6, 4))],
    }
    calls, finished = [0], []

    def admit(room: int) -> list[RowState]:
        calls[0] += 1
        rows = later.pop(calls[0], [])
        assert len(rows) <= room
        return rows

    with torch.inference_mode():
        batch = DecodeBatch(tiny_model.model, tiny_model.tokenizer, first, use_adapter_names=False)
        batch.run(0.25, admit=admit, finished=finished.extend, max_rows=8)
    every = first + [r for r in finished if r not in first]
    assert len(finished) == 5 and {id(r) for r in finished} == {id(r) for r in every}
    for row in every:
        solo = _alone(tiny_model, row.prompt_ids)
        assert row.token_ids == solo.token_ids, "a joined row sampled other tokens than alone"
        assert_close_to_model(
            torch.tensor(row.logprobs), torch.tensor(solo.logprobs), tiny_model.model, torch.float32
        )
        assert row.finish_reason == solo.finish_reason == "length"


def test_a_batch_that_never_empties_keeps_the_width_its_rows_need(tiny_model: LoadedModel) -> None:
    # A steady flow: a new row joins at every one of 300 steps and each leaves after 4 tokens, so
    # the batch never empties. Without dropping the columns that left rows used, its cache would
    # grow one column a step (~300 wide); its rows need at most 16 + 4.
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = [_row(_prompt(tiny_model, 16, 1), params), _row(_prompt(tiny_model, 9, 2), params)]
    calls, finished, widths = [0], [], []

    def admit(room: int) -> list[RowState]:
        calls[0] += 1
        if calls[0] > 300:
            return []
        return [_row(_prompt(tiny_model, 5 + calls[0] % 12, calls[0]), params)]

    def done(rows: list[RowState]) -> None:
        finished.extend(rows)
        widths.append(batch.cache.get_seq_length())
        assert batch.mask.shape[1] == widths[-1]  # the mask and the cache drop the same columns

    with torch.inference_mode():
        batch = DecodeBatch(tiny_model.model, tiny_model.tokenizer, first, use_adapter_names=False)
        batch.run(0.25, admit=admit, finished=done, max_rows=8)
    assert len(finished) == 302
    assert max(widths) <= 2 * (16 + 4) + MIN_DROPPED_COLUMNS, f"the cache grew to {max(widths)} columns"
    for row in finished[::25] + finished[-3:]:
        solo = _alone(tiny_model, row.prompt_ids, params)
        assert row.token_ids == solo.token_ids, "a row in the trimmed batch sampled other tokens than alone"
        assert_close_to_model(
            torch.tensor(row.logprobs), torch.tensor(solo.logprobs), tiny_model.model, torch.float32
        )


def test_drop_leading_columns_keeps_the_rest_and_room_to_grow() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=8)
    cache = growing_cache(config, room=4)
    keys = torch.randn(2, 2, 7, 4)
    cache.layers[0].update(keys, keys + 1)
    drop_leading_columns(cache, 5)
    assert torch.equal(cache.layers[0].keys, keys[..., 5:, :]) and torch.equal(
        cache.layers[0].values, keys[..., 5:, :] + 1
    )
    cache.layers[0].update(torch.ones(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    assert cache.layers[0].keys.shape == (2, 2, 3, 4) and torch.equal(
        cache.layers[0].keys[..., 2, :], torch.ones(2, 2, 4)
    )
    with pytest.raises(ValueError, match="cannot drop 4 of 3"):
        drop_leading_columns(cache, 4)


def test_join_caches_pads_on_the_left() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=8)
    a, b = growing_cache(config, room=4), growing_cache(config, room=4)
    ka, kb = torch.randn(2, 2, 5, 4), torch.randn(1, 2, 3, 4)
    a.layers[0].update(ka, ka + 1)
    b.layers[0].update(kb, kb + 1)
    assert join_caches(a, b) == 5
    keys, values = a.layers[0].keys, a.layers[0].values
    assert keys.shape == (3, 2, 5, 4)
    assert torch.equal(keys[:2], ka) and torch.equal(values[:2], ka + 1)
    assert torch.equal(keys[2, :, 2:], kb[0]) and torch.equal(values[2, :, 2:], kb[0] + 1)
    assert not keys[2, :, :2].any()  # padding is zeros (masked out), never garbage
    a.layers[0].update(torch.ones(3, 2, 1, 4), torch.ones(3, 2, 1, 4))  # still grows in place
    assert a.layers[0].keys.shape == (3, 2, 6, 4)


async def test_a_request_arriving_mid_batch_joins_it(tiny_model: LoadedModel) -> None:
    engine = TorchEngine(tiny_model.model, tiny_model.tokenizer, EngineConfig(stop_on_eos=False))
    try:
        long = SamplingParams(temperature=1.0, max_tokens=400, seed=1)
        short = SamplingParams(temperature=1.0, max_tokens=12, seed=2)
        ids = _prompt(tiny_model, 8)
        stream = engine.generate_stream(GenerationRequest(ids, long))
        await stream.__anext__()  # the long request is decoding
        joined = await engine.generate(GenerationRequest(_prompt(tiny_model, 20, 1), short))
        assert engine.stats().rows == 1, "the short request should finish while the long one decodes"
        async for _ in stream:
            pass
        assert engine.stats().batches == 1 and engine.stats().max_batch_rows == 2
        alone = await engine.generate(GenerationRequest(_prompt(tiny_model, 20, 1), short))
        assert joined[0].token_ids == alone[0].token_ids
        assert_close_to_model(
            torch.tensor(joined[0].logprobs), torch.tensor(alone[0].logprobs), tiny_model.model, torch.float32
        )
    finally:
        engine.close()


async def test_pause_is_not_starved_by_a_steady_flow_of_requests(tiny_model: LoadedModel) -> None:
    engine = TorchEngine(tiny_model.model, tiny_model.tokenizer, EngineConfig(stop_on_eos=False))
    params = SamplingParams(temperature=1.0, max_tokens=30)
    stop = asyncio.Event()

    async def flow(offset: int) -> int:
        done = 0
        while not stop.is_set():
            await engine.generate(GenerationRequest(_prompt(tiny_model, 6, offset), params))
            done += 1
        return done

    try:
        workers = [asyncio.create_task(flow(i)) for i in range(4)]
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await asyncio.wait_for(asyncio.to_thread(engine.pause), timeout=20)
        waited = time.monotonic() - started
        finished_at_pause = engine.stats().rows
        await asyncio.sleep(0.2)
        assert engine.stats().rows == finished_at_pause, "rows decoded while paused"
        engine.resume()
        stop.set()
        done = await asyncio.wait_for(asyncio.gather(*workers), timeout=30)
        assert sum(done) >= 4 and waited < 20
    finally:
        stop.set()
        engine.close()


async def test_a_steady_flow_on_the_serving_copy_does_not_starve_other_rows(tiny_model: LoadedModel) -> None:
    """Rows of the other lane (base model, checkpoints: the peft path) get the next batch."""
    import copy

    from art_core.training.config import LoRAConfig
    from art_core.training.lora import attach_lora

    torch.manual_seed(0)
    peft = attach_lora(copy.deepcopy(tiny_model.model), LoRAConfig(r=4, alpha=8), adapter_name="live")
    engine = TorchEngine(
        peft, tiny_model.tokenizer, EngineConfig(stop_on_eos=False, serve_dtype=torch.float32)
    )
    assert engine.served_adapter == "live"
    params = SamplingParams(temperature=1.0, max_tokens=30)
    stop = asyncio.Event()

    async def flow(offset: int) -> None:
        while not stop.is_set():
            await engine.generate(GenerationRequest(_prompt(tiny_model, 6, offset), params, "live"))

    try:
        workers = [asyncio.create_task(flow(i)) for i in range(4)]
        await asyncio.sleep(0.3)
        base = GenerationRequest(_prompt(tiny_model, 5, 9), SamplingParams(temperature=0.0, max_tokens=5))
        (answer,) = await asyncio.wait_for(engine.generate(base), timeout=20)
        assert len(answer.token_ids) == 5 and not stop.is_set()
    finally:
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)
        engine.close()
