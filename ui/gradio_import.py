"""Gradio imported without rewriting its type stubs: the one place that reaches into gradio's import.

Every gradio component class, as it is defined, reads its own source file and its .pyi stub, parses both and writes
the stub back where it differs (`gradio.component_meta.create_or_modify_pyi`). The stubs are for an editor's type
checker; the app never reads them. That work was about half of `import gradio` (cProfile: 6.7 of 15 s on this 2-core
machine under load), paid at every start of the app, and it writes into the user's site-packages. There is no switch
for it, so `skip_type_stubs` swaps that one function for a no-op as gradio's module defining it is loaded, before the
components are. Should a gradio release move or rename it, nothing is swapped and gradio imports as before.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

MODULE = "gradio.component_meta"
FUNCTION = "create_or_modify_pyi"


def _no_stubs(*args: object, **kwargs: object) -> None:
    return None


class _StubSkipper(importlib.abc.MetaPathFinder):
    """Finds only gradio's component_meta, through the path finder that would find it, with its loader wrapped;
    every other module is left to the finders after it."""

    def find_spec(self, name: str, path=None, target=None):  # noqa: ANN001, ANN201 - importlib's protocol
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            if callable(getattr(module, FUNCTION, None)):
                setattr(module, FUNCTION, _no_stubs)

        spec.loader.exec_module = exec_module  # this module's loader only: a loader is made per file found
        return spec


def skip_type_stubs() -> None:
    """Before gradio is first imported: its components are defined without rewriting their stubs. Once gradio is
    imported (or the skipper is already in place) there is nothing to do."""
    if MODULE in sys.modules or any(isinstance(f, _StubSkipper) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _StubSkipper())
