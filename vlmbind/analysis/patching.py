"""The patching engine moved to :mod:`vlmbind.patching`; this name stays for code that imports it from here."""

from ..patching import *  # noqa: F401,F403
from ..patching import (  # noqa: F401  (names that ``*`` leaves out)
    DEFAULT_MEMORY_BUDGET,
    METHOD_FUNCTIONS,
    PatchTask,
    attribution_diffs,
    exact_diffs,
    naive_diffs,
    prefix_end,
)
