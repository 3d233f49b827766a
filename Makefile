# `make test` and `make demo` work on a fresh machine with only Python 3.11+ and pip.
# The newest Python the machine has, 3.13 or 3.12, else python3: jax 0.11 and later need Python
# 3.12+, and with jax 0.12 the suite took 10.5 min against 13.6 with 3.11's jax 0.10.2 (session
# 70). pyenv's interpreters count even where its shims refuse them (global version 3.11). One
# that cannot make a venv or reach PyPI over TLS (built without ssl) is passed over.
PYENV_PYTHONS = $$(pyenv root 2>/dev/null)/versions/3.13*/bin/python3 \
	$$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3
PYTHON ?= $(shell for p in python3.13 python3.12 $(PYENV_PYTHONS) python3; do \
	"$$p" -c 'import ssl, venv' 2>/dev/null && { echo "$$p"; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
UV := uv==0.13.9

.PHONY: test demo bench setup clean constraints

# PYTHON expanded once: each expansion runs the interpreter search above again.
# uv (pip-installed into the venv) installs the same versions as pip from PyPI in half the time
# (20 s against 40 on a fresh machine, session 72); --compile-bytecode writes the .pyc files
# that pip writes, or every process would compile jax's sources on import. pip is the fallback.
# constraints.txt pins every version to those the suite last passed with (see its header).
$(STAMP): pyproject.toml constraints.txt
	@py="$(PYTHON)"; echo "make: creating $(VENV) with $$py ($$("$$py" --version))"; \
	"$$py" -m venv $(VENV)
	$(PY) -m pip install --quiet $(UV) && $(VENV)/bin/uv pip install --quiet --compile-bytecode \
		--python $(PY) -c constraints.txt -e ".[test]" || { \
		echo "make: uv failed; installing with pip"; \
		$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"; }
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

# the newest versions on PyPI now, for Python 3.11 and later (the header's comment kept); run
# `make clean test` after it, and commit constraints.txt only if the suite passes
constraints: $(STAMP)
	$(PY) -m pip install --quiet $(UV)
	{ grep '^#' constraints.txt; $(VENV)/bin/uv pip compile pyproject.toml --extra test \
		--universal --python-version 3.11 --no-header --no-annotate; } > constraints.new
	mv constraints.new constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
