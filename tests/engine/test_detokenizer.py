"""`IncrementalDetokenizer`: one row's text from its ids, never a half character, cut at stop strings."""

from __future__ import annotations

import pytest
import torch

from art_core.engine.detokenizer import IncrementalDetokenizer, decode, held_prefix, settled_text
from art_core.engine.finish_reason import FinishReason
from art_core.engine.sampling import SamplingParams
from art_core.engine.torch.decoding import RowState
from art_core.models.loading import LoadedModel

TEXT = "Grüße, 世界! 🙂🙂 naïve café STOP after"


@pytest.fixture
def tok(tiny_model: LoadedModel) -> object:
    return tiny_model.tokenizer


def _fed(detokenizer: IncrementalDetokenizer, ids: list[int], step: int) -> list[str]:
    return [detokenizer.feed(ids[i : i + step]) for i in range(0, len(ids), step)]


@pytest.mark.parametrize("step", [1, 3])
def test_deltas_add_up_to_the_whole_decode_and_never_split_a_character(tok: object, step: int) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)  # type: ignore[attr-defined]
    assert any("\ufffd" in decode(tok, ids[:i]) for i in range(len(ids)))  # characters span tokens
    detokenizer = IncrementalDetokenizer(tok)
    deltas = _fed(detokenizer, ids, step)
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == TEXT  # nothing held without stops
    assert detokenizer.finish() == "" and detokenizer.text == decode(tok, ids) == TEXT
    assert detokenizer.finish() == ""  # idempotent
    with pytest.raises(RuntimeError, match="finished"):
        detokenizer.feed(ids[:1])


def test_a_trailing_half_character_comes_out_at_finish_as_a_whole_decode_has_it(tok: object) -> None:
    ids = tok.encode("café 世", add_special_tokens=False)[:-1]  # type: ignore[attr-defined]
    detokenizer = IncrementalDetokenizer(tok)
    assert detokenizer.feed(ids[:2]) == "caf" and detokenizer.feed(ids[2:]) == ""  # waits for the character
    assert "caf" + detokenizer.finish() == detokenizer.text == decode(tok, ids)
    assert detokenizer.text.endswith("\ufffd")


@pytest.mark.parametrize("step", [1, 2, 5])
def test_a_stop_string_ends_the_text_and_a_possible_one_is_held_back(tok: object, step: int) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)  # type: ignore[attr-defined]
    detokenizer = IncrementalDetokenizer(tok, ("STOP", "caf\u00e9 S!"))
    deltas = _fed(detokenizer, ids, step)
    final = TEXT[: TEXT.find("STOP")]
    assert detokenizer.stopped and detokenizer.text == final and "".join(deltas) == final
    assert all(not d.endswith("caf") for d in deltas[:-1])  # "caf..." could have been a stop string
    assert detokenizer.feed(ids) == "" and detokenizer.finish() == "" and detokenizer.text == final


def test_a_held_back_tail_that_never_became_a_stop_is_released_at_finish(tok: object) -> None:
    ids = tok.encode("Hello ST", add_special_tokens=False)  # type: ignore[attr-defined]
    detokenizer = IncrementalDetokenizer(tok, ("STOP",))
    assert "".join(_fed(detokenizer, ids, 1)) == "Hello "
    assert detokenizer.finish() == "ST" and not detokenizer.stopped and detokenizer.text == "Hello ST"


def test_a_stop_string_before_a_half_character_stops_at_once(tok: object) -> None:
    ids = tok.encode("END世", add_special_tokens=False)  # type: ignore[attr-defined]
    half = next(i for i in range(len(ids)) if decode(tok, ids[:i]).endswith("END\ufffd"))
    detokenizer = IncrementalDetokenizer(tok, ("END",))
    assert detokenizer.feed(ids[:half]) == "" and detokenizer.stopped and detokenizer.text == ""


def test_settled_text_is_pure() -> None:
    assert settled_text("caf\ufffd", ()) == "caf"
    assert settled_text("Hello EN", ("END",)) == "Hello "
    assert settled_text("Hello END more", ("END", "more")) == "Hello "
    assert (
        settled_text("Hello E", ("END", "Eh")) == "Hello "
        and settled_text("Hello Ex", ("END",)) == "Hello Ex"
    )
    assert held_prefix("abc", "bcd") == 2 and held_prefix("abc", "abc") == 0  # proper prefixes only


@pytest.mark.parametrize("stop", [(), ("STOP",)])
def test_a_row_ends_on_its_stop_string_and_gives_the_same_completion_when_asked_again(
    tok: object, stop: tuple[str, ...]
) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=len(ids), stop=stop)
    row = RowState(None, 0, [1], params, None, len(ids), torch.Generator(), frozenset())
    for token in ids:
        row.push(token, -1.0, [], tok)
        if row.finish_reason is not None:
            break
    first = row.completion(tok)
    assert first == row.completion(tok)  # the stream and the engine both ask
    if stop:
        assert first.finish_reason is FinishReason.STOP and first.text == TEXT[: TEXT.find("STOP")]
        assert decode(tok, first.token_ids).endswith("STOP")  # it ended on the token that completed it
    else:
        assert first.finish_reason is FinishReason.LENGTH and first.text == TEXT
