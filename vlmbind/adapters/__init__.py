"""Family adapters; importing this package imports every module in it, which registers every family: a new family's
adapter is registered by its own file, with no line to add here."""

import importlib as _importlib
import pkgutil as _pkgutil

from .base import ADAPTERS, ModelAdapter, adapter_class_for_config, register_adapter, supported_families

__all__ = ["ADAPTERS", "ModelAdapter", "adapter_class_for_config", "register_adapter", "supported_families"]

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
