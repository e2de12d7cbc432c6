# rmflow: `make demo` runs the embedded demo, `make test` runs the tests. Both set up the
# environment first, from scratch: a virtualenv in .venv with rmflow (demo) and its test tools (test).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export JAX_PLATFORMS ?= cpu
export TRANSFORMERS_VERBOSITY ?= error

.PHONY: install demo test lint bench bench-trl clean

# The demo needs rmflow alone (no PyTorch, no Google Cloud client); the tests add those.
install: $(VENV)/.installed-demo

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/rmflow run rmflow/demo/workflow.yaml

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n 2 -q --durations=10

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/preprocess.py

bench-trl: $(VENV)/.installed-test
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/vs_trl.py --repeat 3

clean:
	rm -rf $(VENV) demo-output .pytest_cache
