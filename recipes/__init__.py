"""Experiment code run from the repository (not installed): ``python recipes/train.py``.

Layering (DESIGN.md section 2): recipes import lightning_onebit, never the other way round.
``conf/`` holds the Hydra config tree these modules read.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def optional_import(name: str) -> ModuleType:
    """Import a dependency of the recipes that the library itself does not need
    (scikit-learn, matplotlib), saying which extra installs it when it is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"the recipes need {name.split('.')[0]}: pip install -e '.[recipes]'") from exc
