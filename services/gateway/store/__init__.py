"""Organizations, API keys and usage records behind one interface; SQLite or Postgres underneath."""

from services.gateway.store.base import ApiKey, Organization, Store, UsageRecord, UsageSummary
from services.gateway.store.factory import open_store

__all__ = ["ApiKey", "Organization", "Store", "UsageRecord", "UsageSummary", "open_store"]
