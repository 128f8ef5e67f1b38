"""Where the support matrix used to live: it moved beside the recipe vocabulary, calib.recipe.support (torch-free,
no upward import). This module re-exports its names for the callers not yet switched to that import; new code
imports calib.recipe.support.
"""

from __future__ import annotations

from calib.recipe.support import *  # noqa: F401,F403
from calib.recipe.support import __all__  # noqa: F401
