# Every target bootstraps .venv on a fresh machine (nothing preinstalled).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-compat faults serve bench lint clean

$(STAMP): setup.py pyproject.toml native/build.py native/shmask_core.c native/shmask_core.h native/shmask_layout.h
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=64" wheel "cffi>=1.15"
	# torch==2.13.0 is the CPU build that lies on disk here (no CUDA download).
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q --no-build-isolation -e ".[kernels,server,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/pipeline.py

test: $(STAMP)
	$(PY) -m pytest -q --ignore=tests/compat

# The released SGLang and vLLM packages, installed as they are (--no-deps),
# plus only the small dependencies their imported modules need.
COMPAT_STAMP := $(VENV)/.compat-stamp
$(COMPAT_STAMP): $(STAMP) tests/compat/requirements-deps.txt tests/compat/requirements-nodeps.txt
	$(PY) -m pip install -q -r tests/compat/requirements-deps.txt
	$(PY) -m pip install -q --no-deps -r tests/compat/requirements-nodeps.txt
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(PY) -m pytest -q tests/compat

# The whole fault matrix (the short version runs inside `make test`).
faults: $(STAMP)
	SHMASK_FAULTS_FULL=1 $(PY) -m pytest -q tests/faults

serve: $(STAMP)
	$(PY) examples/server.py

bench: $(STAMP)
	$(PY) benchmarks/run.py

lint: $(STAMP)
	$(PY) -m ruff check shmask kernels native tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info shmask/_native*.so native/_native.c
