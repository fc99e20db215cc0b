"""Which processes run a run, and how each ended (contract 8). ``records`` folds a process's records
(``started``, beats, ``ended``) into the one small document the store keeps per (run, rank), overwritten,
and says a run's processes as the API shows them; ``updates`` is the use case of a run update's
``process``. The findings they lead to are ``shared.findings.processes``'s."""
