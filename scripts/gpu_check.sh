#!/usr/bin/env bash
# GPU check of the vLLM engine: 3 GRPO steps of a small model through `art serve --engine vllm`
# (a subprocess; vLLM sleeps while each step trains and hot-loads its LoRA), driven with
# RemoteBackend and the OpenAI client; prints tokens/s and step time.
#
# For a machine with a CUDA GPU where torch and vLLM are already installed (no internet needed):
#   scripts/gpu_check.sh                 # exit 0: all checks passed; 1: a check failed; 124: over 10 min
#   scripts/gpu_check.sh --eager         # no CUDA graphs (faster start); other flags: scripts/gpu_check.py --help
#   scripts/gpu_check.sh --cpu           # the CPU dry run, e.g. with PYTHON=.venv-vllm/bin/python
# Env: PYTHON (default: python3), LIMIT_S (default 600).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LIMIT_S="${LIMIT_S:-600}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false LITELLM_LOCAL_MODEL_COST_MAP=True

"$PY" -P - <<'EOF' || exit 2
import importlib.util, sys
need = ["torch", "vllm", "transformers", "peft", "safetensors", "fastapi", "uvicorn", "openai", "pydantic", "httpx"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"[gpu_check] missing Python packages: {' '.join(missing)}. torch and vllm must be installed; "
             f"the others install with `pip install {' '.join(m for m in missing if m not in ('torch', 'vllm'))}`.")
import torch, vllm
print(f"[gpu_check] torch {torch.__version__} (CUDA: {torch.cuda.is_available()}), vllm {vllm.__version__}")
EOF

if ! "$PY" -P -c "import art_core" 2>/dev/null; then
    echo "[gpu_check] installing this package (pip install --no-deps --no-build-isolation -e .)"
    if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e .; then
        echo "[gpu_check] pip could not install it (offline, no setuptools?): using PYTHONPATH=$PWD instead"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi

started=$(date +%s)
set +e
timeout --signal=TERM --kill-after=20 "$LIMIT_S" "$PY" scripts/gpu_check.py "$@"
rc=$?
set -e
echo "[gpu_check] exit $rc after $(( $(date +%s) - started ))s (limit ${LIMIT_S}s)"
exit "$rc"
