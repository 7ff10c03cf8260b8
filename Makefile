# rlpipe: `make repro` runs the pipeline, `make test` runs the tests. Both set up the venv first.
# CPU torch is installed before anything else, so that nothing resolves a multi-GB CUDA build.
# On a GPU machine: make setup TORCH_SPEC="torch==2.14.0" (see README, "Scaling up").
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
ACTIVATE := . $(VENV)/bin/activate &&

.PHONY: setup repro test test-slow bench clean

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

bench: setup
	$(ACTIVATE) python -m benchmarks

clean:
	rm -rf runs mlruns mlflow.db
