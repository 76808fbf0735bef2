"""shmask: sampling masks over POSIX shared memory, references over zmq."""

from setuptools import setup

setup(
    name="shmask",
    version="0.1.0",
    description="Move LLM sampling masks between processes through POSIX shared memory",
    python_requires=">=3.10",
    packages=["shmask", "shmask.kernels"],
    # kernels/ sits at the top level of the repository but imports as
    # shmask.kernels, so there is one namespace for users.
    package_dir={"shmask": "shmask", "shmask.kernels": "kernels"},
    setup_requires=["cffi>=1.15"],
    cffi_modules=["native/build.py:ffibuilder"],
    install_requires=[
        "cffi>=1.15",
        "numpy>=1.24",
        "posix_ipc>=1.1",
        "pyzmq>=25",
        "orjson>=3.9",
        "msgspec>=0.18",
        "rich>=13",
    ],
    extras_require={
        # torch==2.13.0 is the CPU build that lies on disk here; a looser pin
        # would pull a multi-GB CUDA build on a machine without it.
        "kernels": ["torch==2.13.0", "triton>=3.0"],
        # the HTTP front end example (examples/server.py), as SGLang serves
        "server": ["fastapi>=0.110", "uvicorn>=0.29"],
        "test": ["pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.90", "ruff>=0.5", "httpx>=0.27"],
    },
    entry_points={"console_scripts": ["shmask=shmask.cli:main"]},
)
