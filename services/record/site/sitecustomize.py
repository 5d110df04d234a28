"""On `PYTHONPATH` under `rankscope record`: every Python process started there records
once it imports `mlx.core` or `torch.distributed` (the hooks and their pipe load from this
package by path, so the program's interpreter needs nothing of rankscope's); then the
`sitecustomize` this one hides runs."""

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
    """A module of the recorder (`pipe`, `rank`, `hook`, ...), loaded once under its
    package name: a hook's import of its siblings finds them there, rankscope installed or
    not."""
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


def _hook(name: str) -> ModuleType:
    """A framework's recorder (`hook`, `torch_hook`), what it builds on loaded first."""
    _load("pipe")
    _load("rank")
    return _load(name)


class _After(importlib.abc.MetaPathFinder):
    """Finds a framework's module (`mlx.core`, `torch.distributed`) as the others would,
    and installs its recorder (`hook`) once it loaded."""

    def __init__(self, name: str, hook: str) -> None:
        self.name, self.hook = name, hook

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module
        hook = self.hook

        def exec_module(module: ModuleType) -> None:
            loader_exec(module)
            _hook(hook).install(module)

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
    sys.meta_path[:0] = [_After("mlx.core", "hook"), _After("torch.distributed", "torch_hook")]
    _load("pipe").note_child_exits()
_chain()
