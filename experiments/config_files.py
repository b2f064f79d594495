"""The experiment config files, `configs/<name>.py`, by name: for scripts and tests that pick a recipe by name
(the entrypoints take `--config=configs/<name>.py` through ml_collections instead)."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

import ml_collections

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"


def load_module(name: str) -> ModuleType:
    """The module of configs/<name>.py (its `get_config` and whatever presets it names)."""
    path = CONFIG_DIR / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"no config file {path}")
    spec = importlib.util.spec_from_file_location(f"configs.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(name: str, *preset) -> ml_collections.ConfigDict:
    """configs/<name>.py's `get_config(*preset)`."""
    return load_module(name).get_config(*preset)
