"""A spy on one of capture's launchers, for tests that read what capture
hands a stage (its workspace, its settings) without another path to it
(pytest puts tests/ on sys.path)."""

from __future__ import annotations

import importlib

import pytest

capture_module = importlib.import_module("shmask.kernels.capture")


class LauncherSpy:
    """What capture hands one of its launchers: record(*args) a call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, record) -> None:
        self.calls: list = []
        real = getattr(capture_module, name)
        # a replayed plan calls no launcher (kernels/launch_plan.py)
        monkeypatch.setenv("SHMASK_KERNEL_PLANS", "0")

        def spy(*args, **kwargs):
            self.calls.append(record(*args))
            return real(*args, **kwargs)

        monkeypatch.setattr(capture_module, name, spy)
