"""Family adapters; importing this package registers every family."""

from . import gemma3, llava, molmo2, qwen  # noqa: F401
from . import llava_next  # noqa: F401
from . import qwen3_vl  # noqa: F401
from . import paligemma  # noqa: F401
from . import idefics3  # noqa: F401
from . import mistral3  # noqa: F401
from . import internvl  # noqa: F401
from . import qwen3_5  # noqa: F401
from . import mllama  # noqa: F401
from .base import ADAPTERS, ModelAdapter, adapter_class_for_config, register_adapter, supported_families

__all__ = ["ADAPTERS", "ModelAdapter", "adapter_class_for_config", "register_adapter", "supported_families"]
