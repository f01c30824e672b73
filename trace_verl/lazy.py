"""Run a callback once a module has been imported, without importing it.

verl imports every plugin on `import verl` in each of its processes (vLLM workers included). Importing
verl's Megatron engine there would pull Megatron-Core and all of verl's engines into processes that
never train; instead the TRACE engine is registered right after verl itself imports the module that
defines (and registers) `MegatronEngineWithLMHead`.
"""

import importlib.abc
import importlib.util
import sys


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding us again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_callback(module):
            exec_module(module)
            callback(module)

        spec.loader.exec_module = exec_then_callback
        return spec


def after_import(name: str, callback) -> None:
    """`callback(module)` right after `name` is imported (now, if it already is)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    sys.meta_path.insert(0, _AfterImport(name, callback))
