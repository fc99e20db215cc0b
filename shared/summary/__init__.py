"""Making a run's Distributed summary (contract 5): the query (``query``), stored events to arrays and
units (``decoding``), the levels of rollups kept up as events arrive (``rolling``; the blocks themselves,
which the stores keep too, are ``shared.rollups``), the document from units (``document``, pure numpy),
what a summary reads through the port (``reads``), and its form on the wire (``wire``). ``run.log``
series are binned the same way (``scalars``)."""
