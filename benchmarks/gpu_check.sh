#!/usr/bin/env bash
# What `make gpu-check` runs on a CUDA machine: the GPU tests, then the decode benchmark.
# Results (logs, JSON, markdown) go to $1, or $GPU_RESULTS_DIR, or benchmarks/results/gpu.
# Wheels in .whl/ (e.g. flashinfer, see benchmarks/GPU.md) are installed offline into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-${GPU_RESULTS_DIR:-benchmarks/results/gpu}}"
mkdir -p "$RESULTS"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"

# The gRPC stubs are generated at install time and git-ignored: build them here when missing, or
# when carried ones do not import (their gencode pins protobuf/grpcio minimum runtime versions); that
# needs grpcio-tools. Otherwise carry src/tgi_vlm/pb from a machine with the same protobuf and grpcio.
if [ ! -f src/tgi_vlm/pb/generate_pb2.py ] || ! "$PY" -c "import tgi_vlm.pb" 2>/dev/null; then
    "$PY" -c "import runpy; runpy.run_path('setup.py', run_name='stubs')['generate_stubs']()" \
        || { echo "gRPC stubs missing or unimportable, and grpcio-tools unavailable:" >&2;
             "$PY" -c "import tgi_vlm.pb" >&2; exit 2; }
fi

"$PY" - <<'PY' 2>&1 | tee "$RESULTS/environment.txt"
import importlib.util, torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("transformers", transformers.__version__)
print("flashinfer", "installed" if importlib.util.find_spec("flashinfer") else "missing")
PY

status=0
"$PY" -m pytest -m gpu tests/gpu -v -p no:cacheprovider 2>&1 | tee "$RESULTS/pytest-gpu.log" || status=$?
"$PY" benchmarks/gpu_bench.py --out "$RESULTS" 2>&1 | tee "$RESULTS/gpu_bench.log" || status=$?
exit "$status"
