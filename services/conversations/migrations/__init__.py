"""Versioned schema migrations, one folder of NNNN_name.sql files per dialect.

At start a store applies the versions missing from its conversations_schema_migrations table, in order, in one
transaction together with their schema_migrations rows and under a lock, so concurrent starts
apply every version exactly once and a failed migration leaves nothing half done.
Applied files are never edited: a change is a new file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def load(dialect: str) -> list[Migration]:
    """The migrations of one dialect ("sqlite" or "postgres") in version order."""
    migrations = []
    for path in (Path(__file__).parent / dialect).iterdir():
        match = _FILE.match(path.name)
        if match:
            migrations.append(Migration(int(match[1]), match[2], path.read_text()))
    migrations.sort(key=lambda m: m.version)
    versions = [m.version for m in migrations]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"{dialect} migrations: duplicate version in {versions}")
    return migrations


def pending(dialect: str, applied: set[int]) -> list[Migration]:
    return [m for m in load(dialect) if m.version not in applied]
