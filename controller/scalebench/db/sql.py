"""Connections from the host to the guest's PostgreSQL (pg8000, pure Python)."""

from __future__ import annotations

from typing import Any

from .errors import DbTraceError


def connect(port: int, database: str, timeout: float = 30.0) -> Any:
    """A pg8000 connection to the guest through its 127.0.0.1 port forward."""
    try:
        import pg8000.native
    except ImportError as err:
        raise DbTraceError("the pg8000 package is missing (pip install pg8000)") from err
    return pg8000.native.Connection(
        "postgres", host="127.0.0.1", port=port, database=database, timeout=timeout
    )


def lost_connection() -> type[Exception]:
    """pg8000's error for a connection the server (or the way to it) closed."""
    from pg8000.exceptions import InterfaceError

    return InterfaceError


def q(conn: Any, sql: str, **params: Any) -> list[list[Any]]:
    """Run ``sql`` as a server-side prepared statement, prepared once per connection.

    Like a benchmark kit's prepared statements: the guest parses and plans
    each statement text once, not at every execution.
    """
    cache: dict[str, Any] = conn.__dict__.setdefault("_scalebench_prepared", {})
    statement = cache.get(sql)
    if statement is None:
        statement = cache[sql] = conn.prepare(sql)
    return statement.run(**params) or []
