"""Watching live runs and telling a person (contract 7): a round of the watch (``rounds``: findings
kept on run records, which alerts open and resolve), a project's alert destinations (``alerts``), and
the POST of an alert to a webhook (``webhooks``). The findings themselves are ``shared.findings``."""
