# `make test` and `make demo` work on a fresh machine with only Python 3.11+ and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

# two worker processes (pytest-xdist): 8 min 42 s against 11 min 4 s in one, on a 2-core machine
# (session 32); more would each compile the same kernels again and share the same cores
test: $(STAMP)
	$(PY) -m pytest --numprocesses=2

# compiled kernels are kept in the venv: a second `make demo` loads them (`make clean` drops them)
demo: $(STAMP)
	$(PY) examples/tree_listops.py --cpu-threads 1 --compilation-cache $(VENV)/kernel-cache

bench: $(STAMP)
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
