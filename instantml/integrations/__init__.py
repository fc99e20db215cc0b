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


#: The per-rank keys both trainer integrations log, so that their runs read alike in the Distributed tab
#: (the findings judge ``system/...time`` keys as time: a rank's own slowness, not noise).
LOSS = "train/loss"  # this rank's own loss, before any cross-rank reduction
GRAD_NORM = "optimizer/grad_norm"
DATA_TIME = "system/data_time"  # seconds this rank spent fetching and collating its batch
STEP_TIME = "system/step_time"  # seconds of this rank's whole step, data included
#: Each rank event's weight is the number of samples (or, for language models, tokens) in the rank's batch.
