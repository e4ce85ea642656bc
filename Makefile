# make test: set up .venv (CPU torch under a constraint), run the linters and the suite with coverage.
# make test-fast: same set-up, then the tests not marked integration: none starts a process or a
#                 server (tests/conftest.py fails one that does), trains the examples, runs the docs
#                 or the benchmarks; about a minute on 2 cores, the inner loop. CI runs make test.
# make demo: same set-up, then train the quickstart.
# make examples: same set-up, then train the eight canonical models in turn (about 3 minutes in all).
# make fashion-mnist: same set-up, install Debian's Fashion-MNIST if it can, then train on it (~12 min).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
WHEELS := $(wildcard /opt/wheels)

EXAMPLES := alexnet resnet18 fcn_segmentation ssd_detection birnn_sentiment textcnn_sentiment \
            translator logistic_regression

.PHONY: lint test test-fast demo examples fashion-mnist bench clean

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
	OMP_NUM_THREADS=1 $(PY) -m pytest --cov=fitforge --cov-report=term-missing --durations=30 tests

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not integration" -p no:cacheprovider tests

demo: $(STAMP)
	$(PY) examples/quickstart.py

examples: $(STAMP)
	set -e; for name in $(EXAMPLES); do echo "== $$name"; $(PY) examples/$$name.py; done

# The real data set: Debian's dataset-fashion-mnist puts the four IDX files in FMNIST_DIR. Installed
# only by root with apt-get, and only when a file is missing; otherwise the example says how to get them.
FMNIST_DIR   ?= /usr/share/datasets/fashion-mnist
FMNIST_FILES := train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz \
                t10k-labels-idx1-ubyte.gz

fashion-mnist: $(STAMP)
	@missing=0; for f in $(FMNIST_FILES); do [ -f $(FMNIST_DIR)/$$f ] || missing=1; done; \
	if [ $$missing = 0 ]; then echo "Fashion-MNIST: found in $(FMNIST_DIR)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y dataset-fashion-mnist || { apt-get update && apt-get install -y dataset-fashion-mnist; }; \
	else echo "Fashion-MNIST: not in $(FMNIST_DIR), and no root with apt-get to install it: skipped"; fi
	$(PY) examples/fashion_mnist.py --data-dir $(FMNIST_DIR)

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .coverage build src/*.egg-info
