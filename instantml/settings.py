"""The environment variables the client reads, and its defaults, defined once (contract 2)."""

#: The API's URL and the project's token (``im.init``, ``instantml sync``, the background uploader).
API_URL_ENV = "INSTANTML_API_URL"
API_KEY_ENV = "INSTANTML_API_KEY"
#: Where spool and offline modes write, and where ``instantml sync`` reads.
SPOOL_DIR_ENV = "INSTANTML_SPOOL_DIR"
DEFAULT_SPOOL_DIR = ".instantml/spool"
#: A run id every process of a job sees (else the launcher's job id: ``instantml.run.RUN_ID_VARIABLES``).
RUN_ID_ENV = "INSTANTML_RUN_ID"
#: The project of a trainer integration that is not given one.
PROJECT_ENV = "INSTANTML_PROJECT"
#: How long a process ended by a signal or an exception waits for what it logged to be sent (contract 8).
END_FLUSH_ENV = "INSTANTML_END_FLUSH_S"
DEFAULT_END_FLUSH_S = 5.0
#: Liveness beats (contract 8): a process silent past max(this, 5 x its step interval) beats with its main
#: thread's stack, then once per this many seconds while it stays silent. ``INSTANTML_STACKS=0``: no stacks.
BEAT_ENV = "INSTANTML_BEAT_S"
DEFAULT_BEAT_S = 30.0
STACKS_ENV = "INSTANTML_STACKS"
#: System metrics (contract 2): seconds between samples on the monitor thread; ``0`` turns them off.
SYSTEM_INTERVAL_ENV = "INSTANTML_SYSTEM_INTERVAL_S"
DEFAULT_SYSTEM_INTERVAL_S = 10.0
