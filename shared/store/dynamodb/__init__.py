"""The metrics table: one DynamoDB item per rank event, written with a conditional put.

Item layout (the key attribute names are the template's ``MetricsTable`` key schema; a test checks):

- ``pk`` = ``{project}#{run_id}#{shard:02x}`` with ``shard = rank % SHARDS`` (16). A run's writes
  spread over 16 partitions: 512 ranks x 2 events/s = 1,024 events/s is 64 write units/s per shard,
  far below the 1,000 write units/s of one partition, even though each shard's sort key grows with
  the step (which stops DynamoDB from splitting it further). A reader enumerates the 16 shards of a
  run without any index. 16 keeps the summary at 16 parallel queries; a run would need more than
  15,000 events/s before one shard saturates.
- ``sk`` = ``{step:016d}#{event_id}``: a step window is a key-range query (``BETWEEN``) on each shard,
  steps sort numerically, and late or out-of-order steps are just items with a smaller sort key.
- ``v`` (binary): little-endian float64 ``[weight, time, value_0, value_1, ...]``. Binary keeps NaN and
  Infinity (DynamoDB numbers cannot) and full float64 precision, and a run decodes with one
  ``numpy.frombuffer`` per item, no Python work per value.
- ``k``: the metric keys joined by newlines (keys cannot hold control characters).
- ``r``, ``ws``, ``lr``: rank, world size, local rank. ``h``: a 16-byte digest of the payload.

Idempotency without a second write: the put is conditional (``attribute_not_exists``) and asks for the
old item on failure (``ReturnValuesOnConditionCheckFailure=ALL_OLD``, no read to pay for). Equal
digests mean a replay (``duplicate``), different ones a reused id (``idempotency_key_reused``). A
typical event (2 keys: about 170 bytes; 20 keys of 20 characters: about 680 bytes) is one write unit
(``benchmarks/ingest.py`` prints these), and a replay costs one more (a failed conditional write is
billed like a write).

The trade-off of that choice: the id is unique per (run, shard, step), not per run. The same id sent
again with another step, or with a rank in another shard, is a different item and is stored as a
second event rather than refused with 422. Catching it would need an id item written next to every
event (2 write units per event, or 4 in a transaction: $0.625 or $1.875 more per million events on
top of the $0.625 a write unit per event costs, about $0.8 to $1.0 per million events all-in at 512 ranks:
``benchmarks/aws_model.py``) only to catch a client bug:
the client draws
128-bit random ids per call and replays resend the same body, so a genuine retry always lands on the
same item. Such a stray event counts like any other event at its own (step, rank); where two events
share a (step, rank, key), the later ``time`` wins (contract 6).

Rollups (``shared.rollups``) live in the same table as the events (its ``pk``/``sk`` schema), under
partition keys that start with ``@`` (no project name can, so they never meet an event's partition):

- block item: ``pk`` = ``@rollup#{project}#{run_id}``, ``sk`` = ``{block:016d}``; ``h`` =
  ``BlockHeader.packed()`` (first and last step, distinct steps, world size, events read, and per rank
  steps reported, first and last step when some rank missed a step), ``k`` = the block's keys joined
  by newlines, ``n`` = events read.
- key item: ``pk`` = ``@rollup#{project}#{run_id}#{key}``, ``sk`` = ``{block:016d}``; ``vz`` = that key's
  sums over the block per rank (``rollups.pack_key_units``: 24 bytes a rank, 12 KB at 512 ranks),
  zlib-compressed (about 4 KB at 512 ranks: a third of the write and read units; items written before
  hold them plain in ``v``), ``n``. A store keeps the sums it read (``SumsCache``) and reads again only
  the blocks whose header says they were rolled up from more events since.
- progress item: ``pk`` = ``@rollup#{project}#{run_id}``, ``sk`` = ``~progress``: ``f`` = every block up
  to this one has been rolled up (or had no events when it was looked at).

Every put is conditional on ``n`` (or ``f``) growing: events are only ever added, so a rollup
that read more events is the newer one, and two rollers racing on one block leave the newer result.

Only the rollup function writes here: its policy allows ``dynamodb:PutItem`` on the table with the
condition ``dynamodb:LeadingKeys`` like ``@rollup#*`` (template.yaml), so it can never change an event.

Scalars (``run.log``, ``ScalarStore``) are items of the same table in one partition per run,
``pk`` = ``@scalars#{project}#{run_id}``, with the events' sort key and attributes and the same
conditional put. A run logs about one scalar event per step, far below a partition's limit; the ``@``
keeps them out of the rollup stream (``event_of_key``), and the runs function may query only these
partitions (``dynamodb:LeadingKeys`` like ``@scalars#*``).

The runs table (``RunStore``), keys ``project`` and ``run_id``; every item of a run is in the run's own
partition, ``project`` = ``{project}#{run_id}`` (``run_partition``: no key is shared by a project's runs;
runs recorded before that layout are read in the project's partition). A run has four kinds of item:

- its own item (``run_id``): ``created``, ``last_event``, ``finished``, ``findings``, ``findings_at``
  (and the watch's attributes below). An item exists only once ``last_event`` is set (every update that
  makes one sets it). Both indexes hold it, so it must stay small and rarely written: a note writes it
  only for a newer time, and the ingest holds a note's time back up to ``run_time_resolution_s`` (1 s)
  when its step part is new (``shared.ingest.activity.ActivityNotes``): about one write a second per ingest
  instance, however many ranks report, and the update's condition leaves out a time within that second
  of the recorded one, so about one a second however many instances note the run. The index
  ``by_project`` (``listing_shard``, ``last_event``) lists a project's runs newest first, over
  ``LISTING_SHARDS`` shards queried in parallel; ``by_activity`` (``project``, ``last_event``) those
  recorded before.
- its config (``{run_id}#config``, ``config``: JSON text up to 64 KiB), written by run updates only:
  DynamoDB bills a write by the whole item, and a config on the run's item was paid on every note (a
  64 KiB config: 64 write units per note).
- its rank groups (``{run_id}#s00`` .. ``#s15``: ranks 0-31, 32-63, ...; ``#s-`` for a step noted
  without ranks): for each rank, ``s{rank}`` (its last step) and ``w{rank}`` (its world size there).
  A rank's note only grows its own two attributes, so the ranks of a group never contend (one
  conditional update applies, whatever the others did). The record's last step is the largest rank
  step, its ranks those whose last step it is: the same record one item would hold, while 512 ranks'
  notes spread over 16 items of at most a few hundred bytes that no index holds (a 512-rank number set
  on the run's item was 1.4 KB, paid on every write of it and again in both indexes).

- its processes (``{run_id}$p000``..: contract 8), one per rank, each written conditional on the
  version it read.

No run id holds ``#``, which sorts before every character one may hold, so a run's items are one key
range (``[run_id, run_id#\U0010ffff]``): ``get_run`` is one query, ``list_runs`` and ``watched_runs``
a query per index shard and one small query per run listed. Each field that "only grows" is a conditional
``UpdateItem`` (an update expression cannot take a maximum), so updates are idempotent and commute; a
failed condition returns the item as it was, and the store remembers what it saw, so a note usually
sends only the write that applies, and none for what is recorded already.

The watch (contract 7) adds to a run's own item ``received`` (the server's clock when an update of its
time last applied) and ``watch_shard`` (``w0``..``w3``, a hash of its keys), both set inside the
activity updates, so the index ``by_received`` (``watch_shard``, ``received``) lists every project's
recent runs in ``WATCH_SHARDS`` queries; and ``watch`` (the watch's state: zlib-compressed JSON,
binary) and ``headline``, written by the watch alone. A project's webhooks are one item of the alerts
table (``project``, ``webhooks``: JSON text); the alerts a round decides go to the alerts queue (SQS).

The package, one job a file. Pure, no client: ``keys`` (where each item lives), ``codecs`` (items to
and from domain types) and ``expressions`` (the expressions sent). Then ``base`` (the tables and their
clients), ``errors`` (failures as 429 or 503), one part of ``DynamoStore`` per port (``events``,
``rollups`` with its ``sums_cache``, ``runs`` and ``watch`` over ``run_table``, ``alerts``), and
``tokens`` (``DynamoTokenStore``, the tokens table).
"""

from __future__ import annotations

from shared.store.dynamodb.alerts import AlertsMixin
from shared.store.dynamodb.base import PUT_CONCURRENCY
from shared.store.dynamodb.events import EventsMixin
from shared.store.dynamodb.layout.codecs import item_of, item_size, write_units
from shared.store.dynamodb.layout.expressions import RECEIVED_SET, RUN_ATTRIBUTES
from shared.store.dynamodb.layout.keys import (
    EXPIRES,
    LEGACY_RUNS_INDEX,
    LISTING_SHARDS,
    PARTITION_KEY,
    RETENTION_ENV,
    ROLLUP_PREFIX,
    RUNS_INDEX,
    SCALARS_PREFIX,
    SHARDS,
    SORT_KEY,
    WATCH_INDEX,
    block_sort_key,
    event_of_key,
    key_partition,
    listing_shard,
    partition_key,
    run_partition,
    scalar_partition,
    sort_key,
    watch_shard,
    watch_shards,
)
from shared.store.dynamodb.rollups import RollupsMixin
from shared.store.dynamodb.runs import RunsMixin
from shared.store.dynamodb.tokens import DynamoTokenStore
from shared.store.dynamodb.watch import WatchMixin

# What callers import from the package (the functions, the local stack, the tests, the benchmarks).
__all__ = [
    "EXPIRES",
    "LEGACY_RUNS_INDEX",
    "LISTING_SHARDS",
    "PARTITION_KEY",
    "PUT_CONCURRENCY",
    "RECEIVED_SET",
    "RETENTION_ENV",
    "ROLLUP_PREFIX",
    "RUNS_INDEX",
    "RUN_ATTRIBUTES",
    "SCALARS_PREFIX",
    "SHARDS",
    "SORT_KEY",
    "WATCH_INDEX",
    "DynamoStore",
    "DynamoTokenStore",
    "block_sort_key",
    "event_of_key",
    "item_of",
    "item_size",
    "key_partition",
    "listing_shard",
    "partition_key",
    "run_partition",
    "scalar_partition",
    "sort_key",
    "watch_shard",
    "watch_shards",
    "write_units",
]


class DynamoStore(EventsMixin, RunsMixin, WatchMixin, AlertsMixin, RollupsMixin):
    """The store port on DynamoDB (events, scalars and rollups in the metrics table, run records in the
    runs table). The boto3 client is created on first use (or injected)."""
