"""InstantML: per-rank metrics from distributed training jobs, for the Distributed tab.

>>> import instantml as im
>>> run = im.init(project="distributed-job", config={"lr": 3e-4})
>>> run.log_rank_metrics({"train/loss": 0.12}, step=100, rank=0, world_size=8, weight=1024)
>>> run.log({"train/loss": 0.11, "lr": 3e-4}, step=100)  # the run's own scalars, from rank 0
>>> run.finish()
>>> im.Api().run("distributed-job", run.run_id).rank_metrics().to_pandas()  # read back (contract 9)
"""

from typing import TYPE_CHECKING

from instantml.limits import LimitError
from instantml.run import Run, init

if TYPE_CHECKING:  # (imported on first use: see __getattr__)
    from instantml.api import Api

__version__ = "0.1.0"
__all__ = ["Api", "LimitError", "Run", "__version__", "init"]


def __getattr__(name: str) -> object:
    # ``im.Api`` (reading back) is imported when first used: a training process never loads it.
    if name == "Api":
        from instantml.api import Api

        return Api
    raise AttributeError(f"module 'instantml' has no attribute {name!r}")
