"""The domain: what the functions do, with no HTTP and no Lambda types. A package per question, and at
the top the few facts every part shares.

- ``errors`` (the domain errors, each with its contract code), ``events`` (``RankEvent``,
  ``ScalarEvent``: the events as stored), ``severity`` (a finding's severities and their order),
  ``stats`` (the summary's statistics, pure numpy), ``rollups`` (the units of a summary and the blocks
  of its levels, pure numpy: what the summary computes and the stores keep), ``runs`` (a project's run
  records), ``tokens`` (API tokens, hashed);
- ``ingest/``: how is a write request read and stored? (strict JSON, the pydantic bodies, a request's
  events, the write use cases, the notes they leave on run records);
- ``summary/``: how is a Distributed summary made? (its query, decoding, rolling the levels up,
  the document, what it reads through the port, the wire form; ``run.log`` series);
- ``findings/``: what do the numbers say? (the plain-language rules, pure numpy);
- ``watch/``: who is told, and when? (a round of the watch, alert destinations, the webhook POST);
- ``store/``: where is it kept? (the port, and the DynamoDB and SQLite adapters).

Data flows one way: a function calls one package's use case, which reads and writes through the store
port (``tests/unit/test_layers.py``). Rooms kept for what comes next: ``processes/`` (process records and
liveness, contract 8) and ``reading/`` (raw reads and exports, contract 9).
"""
