"""A LoRA adapter's checkpoint files in peft's layout, written without peft's walk on every save.

peft's `save_pretrained` walks the model's whole state dict to filter out the adapter, renders a
model card from a jinja template and serialises the tensors: for SmolLM2-135M's 420 LoRA tensors
~0.14 s a save, all of it Python holding the GIL. A trainer saves after every step, and the host
commits a step while the next step's rollouts run (their HTTP requests and the engine's decode
loop need the GIL too), so that time lands on the rollouts (docs/benchmarks.md, "`art demo`").

`AdapterFiles.save` runs peft's save the first time, learns from it which trainer parameter each
saved key holds and which other files it wrote (`adapter_config.json`, the model card), and from
then on writes the same files: the parameters under their keys with `safetensors`' `save_file` and
peft's metadata, the other files as peft wrote them (nothing in them changes while the adapter
trains). If the saved keys are not exactly the trainer's parameters, every save stays peft's.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import safetensors.numpy
import safetensors.torch
import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from torch import Tensor

ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""peft's adapter weights file in a checkpoint folder."""
PEFT_FILES = ("adapter_config.json", "README.md")
"""The other files peft's `save_pretrained` writes there (the config and the model card)."""


class AdapterFiles:
    """Writes one adapter's peft files into checkpoint folders (see the module docstring)."""

    def __init__(self, model: PeftModel, adapter_name: str, params: Sequence[tuple[str, Tensor]]) -> None:
        """`params`: the adapter's trainable (name, parameter) pairs, the tensors peft saves."""
        self._model, self._adapter_name, self._params = model, adapter_name, list(params)
        self._keys: list[tuple[str, Tensor]] | None = None
        """(saved key, parameter) for every tensor peft saves, once learned; None: not yet, or peft
        saves something that is not one of `params` (then every save is peft's)."""
        self._files: dict[str, bytes] = {}
        """The other files peft's save wrote, by name."""
        self._learned = False

    def save(self, directory: Path) -> None:
        """Write the adapter's files (weights, `adapter_config.json`, peft's model card) into `directory`."""
        if self._keys is None:
            peft_save(self._model, self._adapter_name, directory)
            if not self._learned:
                self._learn(directory)
            return
        directory.mkdir(parents=True, exist_ok=True)
        write_safetensors(
            {key: param.detach() for key, param in self._keys},
            directory / ADAPTER_WEIGHTS,
            metadata={"format": "pt"},
        )
        for name, data in self._files.items():
            (directory / name).write_bytes(data)

    def _learn(self, directory: Path) -> None:
        self._learned = True
        saved = get_peft_model_state_dict(self._model, adapter_name=self._adapter_name)
        by_storage = {param.data_ptr(): param for _, param in self._params}
        keys: list[tuple[str, Tensor]] = []
        for key, tensor in saved.items():
            param = by_storage.get(tensor.data_ptr())
            if param is None or param.shape != tensor.shape or param.dtype != tensor.dtype:
                return
            keys.append((key, param))
        if len({id(param) for _, param in keys}) != len(self._params) or len(keys) != len(self._params):
            return
        # Only peft's own files: the folder may hold others (an earlier save's optimizer state).
        files = [directory / name for name in PEFT_FILES if (directory / name).is_file()]
        if not any(path.name == "adapter_config.json" for path in files):
            return
        self._files = {path.name: path.read_bytes() for path in files}
        self._keys = keys


_NUMPY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)


def write_safetensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file(tensors, path, metadata)` for contiguous CPU tensors, the same bytes.

    Through safetensors' numpy writer where every dtype has a numpy twin: its torch writer spends
    ~35 us of Python a tensor (a checkpoint's optimizer state is 1,260 of them for SmolLM2's LoRA:
    ~60 ms, against ~20 ms this way).
    """
    if all(
        t.dtype in _NUMPY_DTYPES and t.device.type == "cpu" and t.is_contiguous() for t in tensors.values()
    ):
        safetensors.numpy.save_file({k: t.numpy() for k, t in tensors.items()}, str(path), metadata=metadata)
    else:
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def peft_save(model: Any, adapter_name: str, directory: Path) -> None:
    """peft's save_pretrained, with the files at the top of `directory` whatever the adapter's name."""
    model.save_pretrained(str(directory), selected_adapters=[adapter_name], safe_serialization=True)
    nested = directory / adapter_name
    if adapter_name != "default" and nested.is_dir():
        for item in nested.iterdir():
            item.replace(directory / item.name)
        shutil.rmtree(nested)
