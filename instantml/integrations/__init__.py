"""Integrations with training frameworks. Each module imports its framework, which the client itself
never needs: ``pip install "instantml[transformers]"`` or ``"instantml[lightning]"``."""

from __future__ import annotations


def require(module: str, extra: str) -> None:
    """Import ``module`` or raise an ``ImportError`` saying what to install."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"instantml.integrations.{extra} needs {module}: pip install 'instantml[{extra}]' ({exc})"
        ) from None
