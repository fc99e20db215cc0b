"""How a run's events reach the server, from the training process (contract 2, 4): HTTP and its retry
rules (``transport``), the spool's format and its writer (``spool``, ``spool_writer``), replaying a spool
(``replay_requests``, ``replay``), the uploader process (``background``), the in-process thread
(``uploader``) and where a run's events go (``sinks``). Nothing here is for users to import: the top of
``instantml`` is. The per-process monitor thread (process records, liveness beats and system sampling,
contract 8 and 2) gets a room of its own beside this one, ``monitor/``, and sends through here."""
