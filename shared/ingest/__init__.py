"""Reading and storing a write request (contract 3.3, 3.4, 6): its body as strict JSON (``json_body``),
its fields (``bodies``, pydantic, from the limits), its events (``parse``, with the digest that tells a
retry from a reused id), and the write use cases (``writes``: one event or a batch, stored through the
port and noted on the run's record)."""
