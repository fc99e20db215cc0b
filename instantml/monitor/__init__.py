"""What a training process says about itself (contract 8): who it is when it starts, how it ended, and
where it is while it is silent. ``records`` builds the process records (pure); ``hooks`` chains the
signal handlers and exception hooks that record an end and flush before the process goes on ending as it
would have; ``thread`` is the monitor thread that beats while the main thread is silent. Records travel
as run updates through the run's sink (``instantml.upload``), in order with the events."""
