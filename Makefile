# rmflow: `make demo` runs the embedded demo, `make test` runs the tests. Both set up the
# environment first (a virtualenv in .venv with rmflow and its test tools), from scratch.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export JAX_PLATFORMS ?= cpu
export TRANSFORMERS_VERBOSITY ?= error

.PHONY: install demo test lint bench bench-trl clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: install
	$(BIN)/rmflow run rmflow/demo/workflow.yaml

test: install
	$(BIN)/python -m pytest -n 2 -q --durations=10

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python benchmarks/preprocess.py

bench-trl: install
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/vs_trl.py --repeat 3

clean:
	rm -rf $(VENV) demo-output .pytest_cache
