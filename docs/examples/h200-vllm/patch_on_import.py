"""What the device hooks (profile_peak/, graph_snapshot/) share: a function run on a module right after Python
imports it. Each hook is a ``sitecustomize`` that every process imports at start, vLLM's engine included; it puts
this folder on ``sys.path`` and calls :func:`install` with vLLM's module and its patch."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``target`` is imported, it lets the regular finders load it and runs ``patch``
    on the loaded module, once."""

    def __init__(self, target: str, patch: Callable[[ModuleType], None]) -> None:
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            self.patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(target: str, patch: Callable[[ModuleType], None]) -> None:
    sys.meta_path.insert(0, PatchOnImport(target, patch))
