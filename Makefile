# rmflow: `make demo` runs the embedded demo, `make test` runs the tests. Both set up the
# environment first, from scratch: a virtualenv in .venv with rmflow (demo) and its test tools (test).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export JAX_PLATFORMS ?= cpu
export TRANSFORMERS_VERBOSITY ?= error

.PHONY: install demo test test-airflow lint reference bench bench-trl clean wheel template-metadata template-constraints template-image template schedule score-template-metadata score-template-constraints score-template-image score-template

# The demo needs rmflow with both stages (rmflow[all]: no PyTorch, no Google Cloud client); the tests add those.
install: $(VENV)/.installed-demo

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[all]'
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[all,test]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/rmflow run rmflow/demo/workflow.yaml

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n 2 --dist loadscope -q --durations=30

# The Airflow DAG's test, in its own virtualenv (Airflow's pins would move the main one's).
test-airflow:
	$(PYTHON) -m venv .venv-airflow
	.venv-airflow/bin/pip install --quiet -e '.[all,airflow]' pytest
	RMFLOW_REQUIRE_AIRFLOW=1 AIRFLOW_HOME=$(CURDIR)/.venv-airflow/home .venv-airflow/bin/python -m pytest -q \
		-p no:cacheprovider tests/workflow/test_deploy.py

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

# The configuration reference, generated from the config dataclasses (the suite checks it is current).
reference: $(VENV)/.installed-test
	mkdir -p docs/reference
	$(BIN)/python -m rmflow.reference docs/reference/config.md

bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/preprocess.py

bench-trl: $(VENV)/.installed-test
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/vs_trl.py --vocab smollm2,bpe8k --steps 40 --modes pack --warm --repeat 3

clean:
	rm -rf $(VENV) demo-output .pytest_cache

# ---- Dataflow Flex Template (needs Docker, gcloud and a Google Cloud project; see README) ----
PROJECT ?= $(shell gcloud config get-value project 2>/dev/null)
REGION ?= europe-west4
BUCKET ?= $(PROJECT)-rmflow
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= $(REGION)-docker.pkg.dev/$(PROJECT)/rmflow/preprocess:$(VERSION)
TEMPLATE ?= gs://$(BUCKET)/templates/rmflow-preprocess.json
SCHEDULE ?= 0 2 * * *
INPUTS ?= gs://$(BUCKET)/raw/*.jsonl.gz
TOKENIZER ?= gs://$(BUCKET)/tokenizer
SERVICE_ACCOUNT ?= rmflow-scheduler@$(PROJECT).iam.gserviceaccount.com
# The scoring template: GPU=1 builds an image for NVIDIA L4 workers (g2-standard-4), GPU=0 for CPU workers.
GPU ?= 1
comma := ,
SCORE_IMAGE ?= $(REGION)-docker.pkg.dev/$(PROJECT)/rmflow/score$(if $(filter 1,$(GPU)),-gpu,):$(VERSION)
SCORE_TEMPLATE ?= gs://$(BUCKET)/templates/rmflow-score$(if $(filter 1,$(GPU)),-gpu,).json
SCORE_EXTRAS := all,gcp$(if $(filter 1,$(GPU)),$(comma)cuda,)
WORKER_ACCELERATOR ?= $(if $(filter 1,$(GPU)),type:nvidia-l4;count:1;install-nvidia-driver,)
WORKER_MACHINE_TYPE ?= $(if $(filter 1,$(GPU)),g2-standard-4,)

wheel: $(VENV)/.installed-test
	rm -rf build dist && $(BIN)/pip wheel --quiet --no-deps -w dist .  # build/: setuptools keeps moved files there

template-metadata: $(VENV)/.installed-demo
	$(BIN)/python -m rmflow.pipelines.template metadata > deploy/dataflow/metadata.json

template-constraints:
	rm -rf /tmp/rmflow-lock && $(PYTHON) -m venv /tmp/rmflow-lock
	/tmp/rmflow-lock/bin/pip install --quiet '.[preprocess,gcp]'
	( echo "# pip freeze of rmflow[preprocess,gcp], made by make template-constraints"; \
	  /tmp/rmflow-lock/bin/pip freeze --exclude rmflow ) > deploy/dataflow/constraints.txt

template-image: wheel
	docker build -f deploy/dataflow/Dockerfile --build-arg WORKER_IMAGE=$(IMAGE) -t $(IMAGE) .
	docker push $(IMAGE)

template: template-image template-metadata
	gcloud dataflow flex-template build $(TEMPLATE) --image $(IMAGE) --sdk-language PYTHON \
	    --metadata-file deploy/dataflow/metadata.json

score-template-metadata: $(VENV)/.installed-demo
	$(BIN)/python -m rmflow.scoring.template metadata > deploy/dataflow/score-metadata.json

score-template-constraints:
	rm -rf /tmp/rmflow-lock && $(PYTHON) -m venv /tmp/rmflow-lock
	/tmp/rmflow-lock/bin/pip install --quiet '.[all,gcp,cuda]'
	( echo "# pip freeze of rmflow[all,gcp,cuda], made by make score-template-constraints"; \
	  /tmp/rmflow-lock/bin/pip freeze --exclude rmflow ) > deploy/dataflow/score-constraints.txt

score-template-image: wheel
	docker build -f deploy/dataflow/Dockerfile --build-arg WORKER_IMAGE=$(SCORE_IMAGE) \
	    --build-arg EXTRAS=$(SCORE_EXTRAS) --build-arg CONSTRAINTS=deploy/dataflow/score-constraints.txt \
	    --build-arg TEMPLATE_MAIN=deploy/dataflow/score_main.py --build-arg 'WORKER_ACCELERATOR=$(WORKER_ACCELERATOR)' \
	    --build-arg WORKER_MACHINE_TYPE=$(WORKER_MACHINE_TYPE) -t $(SCORE_IMAGE) .
	docker push $(SCORE_IMAGE)

score-template: score-template-image score-template-metadata
	gcloud dataflow flex-template build $(SCORE_TEMPLATE) --image $(SCORE_IMAGE) --sdk-language PYTHON \
	    --metadata-file deploy/dataflow/score-metadata.json

schedule: $(VENV)/.installed-demo
	$(BIN)/python -m rmflow.pipelines.template launch-body --template $(TEMPLATE) --param inputs='$(INPUTS)' \
	    --param tokenizer=$(TOKENIZER) --param 'output=gs://$(BUCKET)/shards/{date}' \
	    --temp-location gs://$(BUCKET)/tmp --job-name rmflow-preprocess-nightly > /tmp/rmflow-launch.json
	gcloud scheduler jobs create http rmflow-preprocess-nightly --location $(REGION) \
	    --schedule '$(SCHEDULE)' --time-zone UTC --http-method POST \
	    --uri https://dataflow.googleapis.com/v1b3/projects/$(PROJECT)/locations/$(REGION)/flexTemplates:launch \
	    --oauth-service-account-email $(SERVICE_ACCOUNT) --headers Content-Type=application/json \
	    --message-body-from-file /tmp/rmflow-launch.json
