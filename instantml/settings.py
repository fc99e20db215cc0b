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
