"""What pyproject.toml cannot say: the cffi-built native core and its
limited-API (abi3) wheel tag. All metadata lives in pyproject.toml."""

from setuptools import setup

setup(
    # native/build.py's ffibuilder compiles shmask._native (cffi API mode). cffi
    # builds it against the stable ABI (Py_LIMITED_API, an .abi3.so) on CPython.
    cffi_modules=["native/build.py:ffibuilder"],
    # ...so one wheel serves every CPython >= 3.10: cp310-abi3.
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
