"""Alerts: a project's webhooks (``AlertStore``, the ``alert_hooks`` table) and the outbox of alerts
to send (``shared.watch.alerts.Outbox``, the ``outbox`` table, filled by ``shared.store.sqlite.watch``)."""

from __future__ import annotations

from shared.store.port import LastDelivery, PendingDelivery, Webhook
from shared.store.sqlite.codecs import pending_delivery, webhooks_from_text, webhooks_text
from shared.store.sqlite.database import SqliteDatabase


class Alerts:
    """The webhooks and the outbox of ``SqliteStore``; its ``__init__`` sets ``db``."""

    db: SqliteDatabase

    def due_deliveries(self, now: float, limit: int) -> list[PendingDelivery]:
        with self.db.errors("reading the alerts to send"):
            rows = self.db.connection().execute(
                "SELECT id, project, url, payload, created, attempts FROM outbox"
                " WHERE dead = 0 AND next_at <= ? ORDER BY next_at LIMIT ?",
                (now, limit),
            )
            return [pending_delivery(r) for r in rows]

    def pending_deliveries(self) -> int:
        with self.db.errors("counting the alerts to send"):
            (n,) = self.db.connection().execute("SELECT count(*) FROM outbox WHERE dead = 0").fetchone()
        return int(n)

    def delivery_done(self, delivery_id: str) -> None:
        with self.db.write("recording a sent alert") as conn:
            conn.execute("DELETE FROM outbox WHERE id = ?", (delivery_id,))

    def delivery_failed(self, delivery_id: str, error: str, next_at: float | None) -> None:
        """Try again at ``next_at``; None gives up (the row stays, marked dead, for a person to see)."""
        with self.db.write("recording a failed alert") as conn:
            conn.execute(
                "UPDATE outbox SET attempts = attempts + 1, last_error = ?, next_at = coalesce(?, next_at),"
                " dead = ? WHERE id = ?",
                (error[:500], next_at, next_at is None, delivery_id),
            )

    def get_webhooks(self, project: str) -> list[Webhook]:
        with self.db.errors("reading the project's alerts"):
            row = (
                self.db.connection()
                .execute("SELECT webhooks FROM alert_hooks WHERE project = ?", (project,))
                .fetchone()
            )
        return [] if row is None else webhooks_from_text(row[0])

    def put_webhooks(self, project: str, webhooks: list[Webhook]) -> None:
        text = webhooks_text(webhooks)
        with self.db.write("saving the project's alerts") as conn:
            conn.execute(
                "INSERT INTO alert_hooks (project, webhooks) VALUES (?, ?)"
                " ON CONFLICT (project) DO UPDATE SET webhooks = excluded.webhooks",
                (project, text),
            )

    def delete_webhooks(self, project: str) -> bool:
        with self.db.write("removing the project's alerts") as conn:
            conn.execute("DELETE FROM webhook_deliveries WHERE project = ?", (project,))
            return conn.execute("DELETE FROM alert_hooks WHERE project = ?", (project,)).rowcount > 0

    def note_delivery(self, project: str, url: str, last: LastDelivery) -> None:
        with self.db.write("noting how an alert's delivery went") as conn:
            conn.execute(
                "INSERT INTO webhook_deliveries (project, url, state, reason, at)"
                " SELECT ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM alert_hooks WHERE project = ?)"
                " ON CONFLICT (project, url) DO UPDATE SET"
                " state = excluded.state, reason = excluded.reason, at = excluded.at",
                (project, url, last.state, (last.reason or "")[:500] or None, last.at, project),
            )

    def last_deliveries(self, project: str) -> dict[str, LastDelivery]:
        listed = {hook.url for hook in self.get_webhooks(project)}  # a webhook no longer listed: not read
        with self.db.errors("reading the project's deliveries"):
            rows = self.db.connection().execute(
                "SELECT url, state, reason, at FROM webhook_deliveries WHERE project = ?", (project,)
            )
            return {url: LastDelivery(state, reason, at) for url, state, reason, at in rows if url in listed}
