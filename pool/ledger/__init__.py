"""The migration ledger: the one owner of every migration fact (records,
tickets, intents, domains' hosts and sessions' bindings, vouching,
migration ids, the "rehomed" verdict), and, in a pool of several nodes,
what follows etcd's records.  See ``ledger.MigrationLedger``."""

from accelmig.pool.ledger.ledger import MigrationLedger
from accelmig.pool.ledger.record import LedgerRecord, RecordEvent

__all__ = ["MigrationLedger", "LedgerRecord", "RecordEvent"]
