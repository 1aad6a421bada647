"""Built-in passes, one file each. Importing this package imports every module in it, which
registers each pass through `@register_pass`."""

import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_info.name}")
