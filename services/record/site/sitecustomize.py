"""On `PYTHONPATH` under `rankscope record`: every Python process started there records
once it imports `mlx.core` (the hook and its pipe load from this package by path, so the
program's interpreter needs nothing of rankscope's); then the `sitecustomize` this one
hides runs."""

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = "rankscope.services.record"


def _load(name: str) -> ModuleType:
    """A module of the recorder (`pipe`, `hook`), loaded once under its package name: the
    hook's import of its sibling finds it there, rankscope installed or not."""
    module = sys.modules.get(f"{_PACKAGE}.{name}")
    if module is None:
        path = os.path.join(os.path.dirname(_HERE), f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"{_PACKAGE}.{name}", path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def _hook() -> ModuleType:
    """The recorder, its pipe loaded first."""
    _load("pipe")
    return _load("hook")


class _AfterMlxCore(importlib.abc.MetaPathFinder):
    """Finds `mlx.core` as the others would, and installs the recorder once it loaded."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name != "mlx.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            loader_exec(module)
            _hook().install(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _chain() -> None:
    """Run the `sitecustomize` that would have run without this one."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    this = sys.modules.pop("sitecustomize")
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.path.insert(0, _HERE)
        sys.modules.setdefault("sitecustomize", this)  # the import of this one ends with it


if os.environ.get("RANKSCOPE_RECORD") == "1":
    sys.meta_path.insert(0, _AfterMlxCore())
    _load("pipe").note_child_exits()
_chain()
