"""The ``instantml`` command's subcommands that talk to a server (``instantml.cli`` parses the
arguments): ``sync`` (upload a spool), ``watching`` (``check`` and ``alerts``). Room kept for reading
back (``runs``, ``export``, contract 9)."""
