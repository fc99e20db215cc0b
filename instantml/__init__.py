"""InstantML: per-rank metrics from distributed training jobs, for the Distributed tab.

>>> import instantml as im
>>> run = im.init(project="distributed-job", config={"lr": 3e-4})
>>> run.log_rank_metrics({"train/loss": 0.12}, step=100, rank=0, world_size=8, weight=1024)
>>> run.log({"train/loss": 0.11, "lr": 3e-4}, step=100)  # the run's own scalars, from rank 0
>>> run.finish()
"""

from instantml.limits import LimitError
from instantml.run import Run, init

__version__ = "0.1.0"
__all__ = ["LimitError", "Run", "__version__", "init"]
