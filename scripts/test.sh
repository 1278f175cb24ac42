#!/usr/bin/env bash
# Install the suite with its dev extras (CPU torch) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 LITELLM_LOCAL_MODEL_COST_MAP=True TOKENIZERS_PARALLELISM=false
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
python -m pytest -q "$@"
