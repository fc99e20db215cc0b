"""The tables' item layout, pure (strings and numbers in, items and expressions out; no client): where
each item lives (``keys``), items to and from domain types (``codecs``) and the expressions the store
sends (``expressions``). Unit-tested without a table (tests/unit/test_dynamodb_codecs.py)."""
