# Two entry points do all set-up: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
EXTRAS ?= dev

.PHONY: demo test lint format install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

# `make demo` installs only nnstat[demo] (no test, lint, HF or Lightning packages), with its own
# stamp; a venv that `make test` already set up holds everything the demo needs. --no-compile:
# byte-compiling every installed file (torch's thousands) costs more CPU than the demo itself;
# Python compiles what the demo imports on first use instead.
DEMO_STAMP := $(VENV)/.demo-installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

$(DEMO_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	test -f $(STAMP) || { echo "make demo: installing nnstat[demo] (torch CPU and the demo's packages) into $(VENV): about 2 minutes the first time"; \
	  $(BIN)/python -m pip install -q --no-compile -c constraints.txt -e ".[demo]"; }
	rm -f $(VENV)/.demo-installed-* && touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/nnstat demo

test: $(STAMP)
	WANDB_MODE=offline WANDB_SILENT=true $(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check nnstat integrations tests benchmarks examples
	$(BIN)/black --check nnstat integrations tests benchmarks examples

format: $(STAMP)
	$(BIN)/black nnstat integrations tests benchmarks examples
	$(BIN)/ruff check --fix nnstat integrations tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info
