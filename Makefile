# Every target bootstraps .venv on a fresh machine (nothing preinstalled).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench lint clean

$(STAMP): setup.py pyproject.toml native/build.py native/shmask_core.c native/shmask_core.h native/shmask_layout.h
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=64" wheel "cffi>=1.15"
	# torch==2.13.0 is the CPU build that lies on disk here (no CUDA download).
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q --no-build-isolation -e ".[kernels,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/pipeline.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/run.py

lint: $(STAMP)
	$(PY) -m ruff check shmask kernels native tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info shmask/_native*.so native/_native.c
