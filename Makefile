# Set-up and everyday commands. A fresh machine needs only Python 3.11 and pip:
#   make run    — install, build a tiny VLM, start a shard as TGI's launcher does, stream a request
#   make test   — install and run the CPU test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.14.1 + torchvision 0.29.1: torchvision gives every architecture's (fast) processor.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
MODEL_DIR ?= models/tiny-qwen2_vl
ARCH ?= qwen2_vl

.PHONY: install test lint run bench gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py proto/generate/v3/generate.proto
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -e '.[dev,vision]'
	touch $@

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

run: install
	@test -d $(MODEL_DIR) || $(VENV)/bin/tgi-vlm tiny-model --arch $(ARCH) $(MODEL_DIR)
	$(VENV)/bin/tgi-vlm generate $(MODEL_DIR) --demo

bench: install
	$(PY) benchmarks/engine_step.py

# No `install` dependency: the GPU machine brings its own torch and may have no package index.
gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) build src/*.egg-info src/tgi_vlm/pb/generate_pb2*
