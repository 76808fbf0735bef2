"""Shared setup of tests/compat: the released engines' modules, imported as
they are, on a CPU-only machine.

A module that cannot be installed here (it would pull a CUDA build of torch)
is replaced in sys.modules by a stub, registered with `stub_module` so that
`STUBS` lists every stub and why (the integration guides repeat the list).
Stubs are installed at import of this file, before any test imports an
engine, and carry only the names the engines touch at import time; any
other attribute raises, so a stub can never stand in for real behaviour.
"""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types
from typing import Any

# name -> why it is stubbed (read by the guides' tests: every stub is documented)
STUBS: dict[str, str] = {}


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(f"{self.__name__}.{attr}: {self.__name__} is a tests/compat stub "
                             f"({STUBS.get(self.__name__.split('.')[0], '')})")


def stub_module(name: str, why: str, **attrs: Any) -> types.ModuleType:
    """Put a stub for `name` (and its parents) in sys.modules, unless the
    real module is importable; `attrs` are the only names it provides."""
    top = name.split(".")[0]
    if top not in STUBS:
        try:
            __import__(top)
            return sys.modules[name] if name in sys.modules else __import__(name)
        except ImportError:
            pass
    STUBS.setdefault(top, why)
    parent = None
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        dotted = ".".join(parts[:depth])
        module = sys.modules.get(dotted)
        if module is None:
            module = _StubModule(dotted)
            module.__path__ = []  # a package, so submodules can be stubbed under it
            # importlib.util.find_spec (transformers' availability probes) needs a spec
            module.__spec__ = importlib.machinery.ModuleSpec(dotted, None, is_package=True)
            sys.modules[dotted] = module
        if parent is not None:
            setattr(parent, parts[depth - 1], module)
        parent = module
    for key, value in attrs.items():
        setattr(parent, key, value)
    return parent


# ------------------------------------------------------------------ SGLang
# sglang.srt.managers.io_struct imports schedule_batch -> configs ->
# multimodal/internvl_utils, which imports torchvision at module level (its
# functions use it, nothing at import time but InterpolationMode). Every
# torchvision wheel on the registry requires a CUDA build of torch.
class _InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


_TORCHVISION_WHY = ("every torchvision wheel pins a CUDA torch build; SGLang's multimodal "
                    "helpers import it at module level but use it only when called")
# transformers asks importlib whether torchvision exists and, if so, imports
# its vision helpers; it caches the answer (lru_cache). Ask it before the
# stub exists, so it sees what a CPU install without torchvision is.
try:
    from transformers.utils.import_utils import is_torchvision_available

    is_torchvision_available()
except ImportError:
    pass
# configs/deepseek_ocr.py imports InterpolationMode from torchvision.transforms,
# multimodal/internvl_utils.py from torchvision.transforms.functional.
stub_module("torchvision.transforms.functional", _TORCHVISION_WHY,
            InterpolationMode=_InterpolationMode)
stub_module("torchvision.transforms", _TORCHVISION_WHY, InterpolationMode=_InterpolationMode)
