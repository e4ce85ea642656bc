# make test: set up .venv (CPU torch under a constraint), run the linters and the suite with coverage.
# make demo: same set-up, then train the quickstart.
# make examples: same set-up, then train the eight canonical models in turn (about 3 minutes in all).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
WHEELS := $(wildcard /opt/wheels)

EXAMPLES := alexnet resnet18 fcn_segmentation ssd_detection birnn_sentiment textcnn_sentiment \
            translator logistic_regression

.PHONY: lint test demo examples bench clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PIP) install -q $(if $(WHEELS),--find-links $(WHEELS)) -c constraints.txt "torch==2.13.0"
	$(PIP) install -q $(if $(WHEELS),--find-links $(WHEELS)) -c constraints.txt -e ".[test,examples]"
	touch $(STAMP)

# Lint, format, types and import layers first: they take seconds and fail before the suite's minutes.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest --cov=fitforge --cov-report=term-missing tests

demo: $(STAMP)
	$(PY) examples/quickstart.py

examples: $(STAMP)
	set -e; for name in $(EXAMPLES); do echo "== $$name"; $(PY) examples/$$name.py; done

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .coverage build src/*.egg-info
