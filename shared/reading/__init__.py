"""Reading back what was logged, at full resolution (contract 9): a run's stored events a page at a time
(``raw``), for ``GET .../rank-metrics`` and ``GET .../scalars?raw=1``, and through them ``im.Api``,
``instantml export`` and moving a run to another server."""
