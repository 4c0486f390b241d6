"""The sandbox for model-written SQL: every such query runs through :func:`run_query`, in a separate sandbox
process that is killed when a query outlives its time limit (even a single SQLite operation cannot hold a reward past
it), on a fresh read-only connection (URI ``mode=ro``) with an authorizer that allows reads and nothing else (no
writes, ATTACH, PRAGMA, extension loading), a progress-handler time limit, a value-size limit and a row cap.
``sqlglot`` rejects anything that is not a single query before SQLite sees it.

Security-critical: kept apart from the SQL kit's rewards and data so that it can be read and reviewed on its own.
"""

from __future__ import annotations

import logging
import multiprocessing
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import sqlglot
from sqlglot import exp

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_ROWS = 10_000
MAX_VALUE_BYTES = 10_000_000  # largest string or blob model SQL may build

# Authorizer: reading is all model SQL may do. Functions are allowed except extension loading.
_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer", "randomblob", "zeroblob"}


@dataclass(frozen=True)
class QueryResult:
    """Rows of a query, or the error that stopped it (exactly one of the two is set)."""

    rows: tuple[tuple, ...] | None
    error: str | None
    ordered: bool = False  # the query has a top-level ORDER BY


@contextmanager
def _quiet_sqlglot():
    """sqlglot warns once per query it parses as an opaque command ("contains unsupported syntax"); such a query
    is refused with a reason anyway, so the warning would only flood a training log."""
    sqlglot_logger = logging.getLogger("sqlglot")
    level = sqlglot_logger.level
    sqlglot_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        sqlglot_logger.setLevel(level)


def check_single_query(sql: str) -> tuple[bool, str | None]:
    """``(is_one_read_only_query, reason_if_not)``, using sqlglot's SQLite dialect."""
    try:
        with _quiet_sqlglot():
            statements = [s for s in sqlglot.parse(sql, read="sqlite") if s is not None]
    except Exception as error:  # sqlglot raises several error types on garbage
        return False, f"could not parse the SQL: {str(error).splitlines()[0][:200]}"
    if len(statements) != 1:
        return False, f"expected exactly one statement, found {len(statements)}"
    if not isinstance(statements[0], exp.Query):
        return False, f"only queries are allowed, found {statements[0].key.upper()}"
    return True, None


def _is_ordered(sql: str) -> bool:
    try:
        with _quiet_sqlglot():
            statement = sqlglot.parse_one(sql, read="sqlite")
    except Exception:
        return False
    return statement.args.get("order") is not None


def _authorizer(action, arg1, arg2, db_name, trigger):
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS else sqlite3.SQLITE_DENY


def _normalise(value: Any) -> Any:
    return round(value, 6) if isinstance(value, float) else value


class QueryTimeout(Exception):
    """A query hit the time limit; kept out of the cache, since a busy machine can cause it."""


def run_query(
    db_path: str, sql: str, timeout_s: float = DEFAULT_TIMEOUT_S, max_rows: int = DEFAULT_MAX_ROWS
) -> QueryResult:
    """Run one model-written query in the sandbox. Never raises for bad SQL; the error text is SQLite's own.

    Results are cached per (database, query, limits): the database is opened read-only, so a query's result cannot
    change while training runs. Time-outs are not cached.
    """
    try:
        return _cached_query(str(db_path), sql, timeout_s, max_rows)
    except QueryTimeout as timeout:
        return QueryResult(None, str(timeout))


@lru_cache(maxsize=8192)
def _cached_query(db_path: str, sql: str, timeout_s: float, max_rows: int) -> QueryResult:
    ok, reason = check_single_query(sql)
    if not ok:
        return QueryResult(None, reason)
    if not Path(db_path).is_file():
        return QueryResult(None, f"database not found: {db_path}")
    return _WORKER.run(db_path, sql, timeout_s, max_rows)


def _timeout_message(timeout_s: float) -> str:
    return f"the query ran longer than {timeout_s:g} s and was stopped"


class _SandboxWorker:
    """A long-lived child process that runs the queries, so that every query ends within its limit.

    One SQLite operation can run for seconds without returning to the progress handler (``printf('%.*c',
    2000000000, 'x')`` builds a 2 GB string in one opcode), so the parent waits at most ``timeout_s`` plus a short
    grace and then kills the child (a fresh one serves the next query). Ordinary long queries are still stopped by
    the child's own progress handler, which keeps the child alive.
    """

    GRACE_S = 0.3

    def __init__(self):
        self._process = None
        self._pipe = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_serve_queries, args=(child,), daemon=True)
        self._process.start()
        child.close()

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._pipe.close()
        self._process = self._pipe = None

    def run(self, db_path: str, sql: str, timeout_s: float, max_rows: int) -> QueryResult:
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self._start()
            self._pipe.send((db_path, sql, timeout_s, max_rows))
            if self._pipe.poll(timeout_s + self.GRACE_S):
                try:
                    status, payload = self._pipe.recv()
                except EOFError:  # the child died (e.g. out of memory): a failure, and a fresh child next time
                    self._stop()
                    return QueryResult(None, "the query crashed the SQL sandbox")
                if status == "timeout":
                    raise QueryTimeout(payload)
                return payload
            self._stop()
            raise QueryTimeout(_timeout_message(timeout_s))


def _serve_queries(pipe) -> None:
    """The sandbox child: run each request and send back ``("ok", QueryResult)`` or ``("timeout", message)``."""
    while True:
        try:
            request = pipe.recv()
        except EOFError:
            return
        try:
            pipe.send(("ok", _execute_query(*request)))
        except QueryTimeout as timeout:
            pipe.send(("timeout", str(timeout)))


_WORKER = _SandboxWorker()


def _execute_query(db_path: str, sql: str, timeout_s: float, max_rows: int) -> QueryResult:
    """Run one checked query on a sandbox connection (in the sandbox child)."""
    path = Path(db_path)
    deadline = time.monotonic() + timeout_s
    try:
        conn = sandbox_connection(path, deadline)
    except sqlite3.Error as error:
        return QueryResult(None, f"cannot open database: {error}")
    try:
        rows = conn.execute(sql).fetchmany(max_rows + 1)
        if len(rows) > max_rows:
            return QueryResult(None, f"the result has more than {max_rows} rows")
        return QueryResult(tuple(tuple(_normalise(v) for v in row) for row in rows), None, _is_ordered(sql))
    except sqlite3.OperationalError as error:
        if time.monotonic() > deadline:
            raise QueryTimeout(_timeout_message(timeout_s)) from error
        return QueryResult(None, str(error))
    except (sqlite3.Error, ValueError, OverflowError, MemoryError) as error:
        return QueryResult(None, str(error) or type(error).__name__)
    finally:
        conn.close()


def sandbox_connection(db_path: str | Path, deadline: float) -> sqlite3.Connection:
    """A fresh read-only connection that may only read, and that aborts any statement after ``deadline``
    (``time.monotonic()`` seconds). The second line of defence behind :func:`check_single_query`.
    """
    conn = sqlite3.connect(f"{Path(db_path).resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
    conn.set_authorizer(_authorizer)
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    # One opcode can allocate a huge value (randomblob(1e9)) before the progress handler runs again: cap sizes.
    if hasattr(conn, "setlimit"):  # Python >= 3.11
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    return conn
