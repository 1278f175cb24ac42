"""The prefix cache: what it finds and keeps, and that decoding on cached prefixes equals decoding without."""

from __future__ import annotations

import pytest
import torch

from art_core.engine.sampling import SamplingParams
from art_core.engine.torch.decoding import DecodeBatch, RowState
from art_core.engine.torch.prefix_cache import BLOCK, PrefixCache, PrefixHit
from art_core.models.loading import LoadedModel
from tests.helpers_models import record_prefills
from tests.tolerances import assert_close_to_model

pytestmark = pytest.mark.isa  # float results depend on the CPU's kernels (see .ci/run)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, top_logprobs=2)


def _views(
    tokens: list[int], padding: int = 0
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Stand-in keys and values of `tokens` (2 layers, 1 head, dim 3) whose values name their token,
    after `padding` columns of padding (-1), as a batch row would hold them; and the column mask."""
    row = (
        torch.tensor([-1.0] * padding + tokens, dtype=torch.float32)[None, :, None]
        .expand(1, -1, 3)
        .contiguous()
    )
    mask = torch.tensor([0] * padding + [1] * len(tokens))
    return [(row, row + 0.5), (row * 2, row * 2 + 0.5)], mask


def _cached_tokens(cache: PrefixCache, hit: PrefixHit) -> list[int]:
    """The tokens a hit's keys name (checks every layer, keys and values, agrees)."""
    layers = cache.keys_values(hit)
    named = [keys[0, :, 0] / scale for (keys, _), scale in zip(layers, (1, 2), strict=True)]
    assert all(torch.equal(n, named[0]) for n in named)
    assert all(torch.equal(values, keys + 0.5) for keys, values in layers)
    return [int(t) for t in named[0].tolist()]


def _page_bytes(block: int) -> int:
    """Bytes of one arena page of `_views`' stand-ins: 2 layers x keys and values x 1 head x dim 3, float32."""
    return 2 * 2 * 1 * 3 * 4 * block


def test_lookup_finds_the_longest_cached_prefix_by_blocks_then_by_tokens() -> None:
    cache = PrefixCache(max_bytes=10**6, block=4)
    a = list(range(10, 20))
    cache.store(a, *_views(a, padding=3))
    for prompt, found in [
        (a[:7] + [99, 98], 7),  # two whole blocks, then token by token into the third
        (a, 9),  # the whole sequence: all but the prompt's last token
        (a + [5, 6], 10),  # longer than the entry
        (a[:3] + [99] * 6, 0),  # differs inside the first block: nothing is indexed
        ([1, 2], 0),
    ]:
        hit = cache.lookup(prompt)
        assert hit.length == found, prompt
        if found:  # the tokens in order, without the row's padding
            assert _cached_tokens(cache, hit) == a[:found] and len(hit.pages) == -(-found // 4)
    stats = cache.stats()
    assert (stats.lookups, stats.hit_tokens, stats.stored) == (5, 26, 1)


def test_a_hits_keys_and_values_are_the_stored_ones_whatever_the_row_held_around_them() -> None:
    cache = PrefixCache(max_bytes=10**6, block=4)
    torch.manual_seed(0)
    keys, values = torch.randn(2, 11, 5), torch.randn(2, 11, 5)  # 2 heads, 11 columns, dim 5
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1])  # a cached prefix, padding, the rest
    tokens = list(range(50, 58))
    cache.store(tokens, [(keys, values), (keys * 3, values - 1)], mask)
    hit = cache.lookup(tokens + [1])
    columns = mask.bool()
    assert hit.length == 8
    for (k, v), (want_k, want_v) in zip(
        cache.keys_values(hit), [(keys, values), (keys * 3, values - 1)], strict=True
    ):
        assert torch.equal(k, want_k[:, columns]) and torch.equal(v, want_v[:, columns])
    shorter = cache.lookup(tokens[:6])
    assert torch.equal(cache.keys_values(shorter)[1][0], (keys * 3)[:, columns][:, :5])


def test_store_skips_what_it_holds_drops_what_it_extends_and_evicts_the_least_recently_used() -> None:
    a, b, c = [list(range(start, start + 8)) for start in (0, 100, 200)]
    entry_bytes = 2 * _page_bytes(4)  # an 8-token entry takes two pages of 4
    cache = PrefixCache(max_bytes=2 * entry_bytes + _page_bytes(1), block=4)  # 4 pages and the padding slot
    cache.store(a[:6], *_views(a[:6]))
    cache.store(a, *_views(a))  # extends the first entry, which is dropped
    cache.store(a[:5], *_views(a[:5]))  # held whole by a
    cache.store([1, 2, 3], *_views([1, 2, 3]))  # shorter than a block: no lookup could find it
    stats = cache.stats()
    assert (stats.stored, stats.evicted, stats.bytes) == (2, 1, entry_bytes)
    assert cache.holds(a[:5]) and not cache.holds([1, 2, 3])
    cache.store(b, *_views(b))
    assert cache.lookup(a + [1]).length == 8  # a is now the most recently used
    cache.store(c, *_views(c))  # no page is free: b's are taken
    assert cache.stats().evicted == 2 and cache.stats().bytes == 2 * entry_bytes
    assert cache.lookup(b + [1]).length == 0 and cache.lookup(a + [1]).length == 8
    assert cache.lookup(c + [1]).length == 8 and _cached_tokens(cache, cache.lookup(c + [1])) == c
    cache.store(list(range(300, 320)), *_views(list(range(300, 320))))  # 5 pages: more than the arena
    assert cache.stats().stored == 4 and cache.lookup(a + [1]).length == 8
    with pytest.raises(ValueError, match="unmasked"):
        cache.store(a, *_views(a[:5]))


def _batch(
    sequences: list[list[int]], width: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """`_views` of several rows at once: a batch [B, 1 head, width, 3], each row left-padded."""
    rows = [_views(tokens, padding=width - len(tokens)) for tokens in sequences]
    layers = [
        tuple(torch.cat([row[0][layer][kind][None] for row in rows]) for kind in (0, 1)) for layer in (0, 1)
    ]
    return layers, torch.stack([mask for _, mask in rows])  # type: ignore[return-value]


def test_storing_rows_at_once_keeps_what_storing_them_in_turn_keeps() -> None:
    a, b, c, d = [list(range(start, start + n)) for start, n in ((0, 9), (100, 6), (200, 3), (300, 12))]
    layers, mask = _batch([a, b, c, d, a], width=12)
    together, in_turn = PrefixCache(max_bytes=10**6, block=4), PrefixCache(max_bytes=10**6, block=4)
    together.store_rows(layers, [0, 1, 2, 3, 4], [a, b, c, d, a], mask)  # c: too short; a again: held
    for tokens in (a, b, c, d, a):
        in_turn.store(tokens, *_views(tokens, padding=2))
    assert together.stats() == in_turn.stats() and together.stats().stored == 3
    for tokens in (a, b, d):
        assert _cached_tokens(together, together.lookup(tokens + [1])) == tokens
    # rows the call itself evicts are not written: their pages went to later rows
    small = PrefixCache(max_bytes=5 * _page_bytes(4) + _page_bytes(1), block=4)  # 5 pages
    layers, mask = _batch([a, b, d], width=12)
    small.store_rows(layers, [2, 0, 1], [d, a, b], mask)  # d: 3 pages; a: 3, evicting d; b: 2
    assert small.lookup(d + [1]).length == 0 and small.stats().evicted == 1
    assert (
        _cached_tokens(small, small.lookup(a + [1])) == a
        and _cached_tokens(small, small.lookup(b + [1])) == b
    )
    with pytest.raises(ValueError, match="unmasked"):  # a bad row: nothing of the call is stored
        small.store_rows(layers, [2, 0], [d, b], mask)
    assert small.lookup(d + [1]).length == 0 and small.stats().stored == 3


def test_the_arena_never_exceeds_its_budget_and_eviction_frees_its_pages() -> None:
    budget = 7 * _page_bytes(4) + _page_bytes(1) - 1  # one byte short of 7 pages and the padding slot
    cache = PrefixCache(max_bytes=budget, block=4)
    for k in range(40):  # 5 to 12 tokens: 2 or 3 pages each
        tokens = list(range(1000 * k, 1000 * k + 5 + k % 8))
        cache.store(tokens, *_views(tokens, padding=k % 3))
        stats = cache.stats()
        assert stats.bytes <= 6 * _page_bytes(4)
        arena = cache._arena
        assert arena is not None and arena.numel() * arena.element_size() <= budget
        held = [t for t in range(k + 1) if cache.holds(list(range(1000 * t, 1000 * t + 5 + t % 8)))]
        assert held[-1] == k and stats.bytes == sum(-(-(5 + t % 8) // 4) for t in held) * _page_bytes(4)
        for t in held:  # pages are never shared: every held entry still reads its own tokens
            tokens = list(range(1000 * t, 1000 * t + 5 + t % 8))
            assert _cached_tokens(cache, cache.lookup(tokens + [1])) == tokens
    assert cache.stats().evicted == 40 - len(held)
    cache.for_weights("other weights")
    assert cache.stats().bytes == 0 and len(cache._free) == 6


def test_a_new_weights_stamp_empties_the_cache() -> None:
    cache = PrefixCache(max_bytes=10**6, block=4)
    a = list(range(12))
    cache.for_weights(("copy", 1)).store(a, *_views(a))
    assert cache.for_weights(("copy", 1)).lookup(a).length == 11
    assert cache.for_weights(("copy", 2)).lookup(a).length == 0
    assert cache.stats().clears == 1 and cache.stats().bytes == 0


# -- decoding on cached prefixes ---------------------------------------------------------------


def _row(prompt: list[int], params: SamplingParams = GREEDY) -> RowState:
    return RowState(
        None, 0, prompt, params, None, params.max_tokens, torch.Generator().manual_seed(0), frozenset()
    )


def _decode(tiny_model: LoadedModel, prompts: list[list[int]], cache: PrefixCache | None) -> list[RowState]:
    rows = [_row(p) for p in prompts]
    with torch.inference_mode():
        DecodeBatch(tiny_model.model, tiny_model.tokenizer, rows, False, cache).run(0.25)
    return rows


def _assert_as_alone(tiny_model: LoadedModel, rows: list[RowState]) -> None:
    for row in rows:
        (solo,) = _decode(tiny_model, [row.prompt_ids], None)
        assert row.token_ids == solo.token_ids, "a row on a cached prefix sampled other tokens than alone"
        assert_close_to_model(
            torch.tensor(row.logprobs), torch.tensor(solo.logprobs), tiny_model.model, torch.float32
        )
        assert row.top == [] or all(
            [i for i, _ in mine] == [i for i, _ in theirs]
            for mine, theirs in zip(row.top, solo.top, strict=True)
        )


def test_an_agents_next_turn_prefills_only_its_new_tokens_and_decodes_as_alone(
    tiny_model: LoadedModel,
) -> None:
    cache = PrefixCache(max_bytes=2**26)
    system = [(5 * i) % 900 + 7 for i in range(24)]
    turn1 = [system + [300 + i, 301 + i, 302] for i in range(3)]
    first = _decode(tiny_model, [*turn1, turn1[0]], cache)  # a duplicate shares its prefill
    _assert_as_alone(tiny_model, first)
    # Turn 2: each conversation goes on from its prompt and completion (the completion's last token
    # was never fed back, so it is new), plus a conversation the cache has never seen.
    turn2 = [p + r.token_ids + [400 + i, 401] for i, (p, r) in enumerate(zip(turn1, first, strict=False))]
    fresh = [(11 * i) % 800 + 3 for i in range(30)]
    with pytest.MonkeyPatch.context() as patch:
        shapes = record_prefills(patch)
        second = _decode(tiny_model, [*turn2, fresh], cache)
    # conversations: prompt + 7 fed completion tokens cached; 3 new each. fresh: all 30 (not shared)
    assert shapes == [(4, 30)]
    assert cache.stats().hit_tokens == 3 * (len(turn1[0]) + 7)
    _assert_as_alone(tiny_model, second)


def test_a_batch_of_cached_prompts_prefills_with_one_decode_step(tiny_model: LoadedModel) -> None:
    cache = PrefixCache(max_bytes=2**26)
    prompts = [[(3 * i + k) % 700 + 9 for i in range(20 + 5 * k)] for k in range(3)]
    _decode(tiny_model, prompts, cache)
    with pytest.MonkeyPatch.context() as patch:
        shapes = record_prefills(patch)
        again = _decode(tiny_model, prompts, cache)
    assert shapes == []  # every prompt but its last token was cached
    _assert_as_alone(tiny_model, again)


def test_a_shared_system_prompt_beats_small_cache_hits(tiny_model: LoadedModel) -> None:
    """When running the rows' common prefix once saves more than the cache's hits, that is what runs."""
    cache = PrefixCache(max_bytes=2**26)
    system = [(5 * i) % 900 + 7 for i in range(40)]
    _decode(tiny_model, [[(13 * i) % 500 + 2 for i in range(20)]], cache)  # unrelated: no hits
    with pytest.MonkeyPatch.context() as patch:
        shapes = record_prefills(patch)
        rows = _decode(tiny_model, [system + [50 + i] * (i + 1) for i in range(4)], cache)
    assert shapes == [(1, 40), (4, 4)]
    _assert_as_alone(tiny_model, rows)


def test_rows_are_cached_one_by_one_even_when_their_batch_outweighs_the_budget(
    tiny_model: LoadedModel,
) -> None:
    """Each cached row has pages of its own: a budget of ~2.5 rows keeps the 2 most recent of 4
    rows that finished together (a copy of the batch, or a view of its buffers, would be evicted whole)."""
    config = tiny_model.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    prompts = [[(7 * i + 13 * k) % 600 + 5 for i in range(30)] for k in range(4)]
    pages = -(-(30 + GREEDY.max_tokens - 1) // BLOCK)
    page_bytes = BLOCK * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4  # float32
    cache = PrefixCache(max_bytes=int(2.5 * pages * page_bytes))
    rows = _decode(tiny_model, prompts, cache)
    finished = [row.prompt_ids + row.token_ids[:-1] for row in rows]
    found = [cache.lookup(sequence + [1]).length for sequence in finished]
    assert sorted(found) == [0, 0, len(finished[0]), len(finished[0])], found
