"""The sandbox for model-written SQL: every such query runs through :func:`run_query`, in a separate sandbox
process that is killed when a query outlives its time limit (even a single SQLite operation cannot hold a reward past
it), on a fresh read-only connection (URI ``mode=ro``) with an authorizer that allows reads and nothing else (no
writes, ATTACH, PRAGMA, extension loading), a progress-handler time limit, a value-size limit, a row cap and a cap on
the bytes a result holds. ``sqlglot`` rejects anything that is not a single query before SQLite sees it, and any
``printf`` / ``format`` whose width or precision could build a value of any size in one step (SQLite's printf
ignores the value-size limit). Results are cached in a byte-bounded cache.

Security-critical: kept apart from the SQL kit's rewards and data so that it can be read and reviewed on its own.
"""

from __future__ import annotations

import logging
import multiprocessing
import re
import sqlite3
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlglot
from sqlglot import exp

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_ROWS = 10_000
MAX_VALUE_BYTES = 10_000_000  # largest string or blob model SQL may build
MAX_RESULT_BYTES = 1_000_000  # largest result (all rows' values) a query may return
MAX_FORMAT_WIDTH = 1_000  # largest width or precision a printf / format conversion may ask for
CACHE_BYTES = 64_000_000  # the result cache's size; the least recently used results leave first
# a printf conversion: flags, width (digits or *), precision (. digits or .*), then the conversion letter
_CONVERSION = re.compile(r"%[-+ 0#,!]*(\*|\d+)?(?:\.(\*|\d*))?[a-zA-Z%]")

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
    return _check_formats(statements[0])


def _check_formats(query: exp.Expression) -> tuple[bool, str | None]:
    """Refuses a ``printf`` / ``format`` whose format is not a literal or asks for a width or precision from an
    argument (``*``) or above :data:`MAX_FORMAT_WIDTH`: SQLite builds such a value in one opcode, past its value-size
    limit (``printf('%.*c', 2000000000, 'x')`` is 2 GB)."""
    for node in query.find_all(exp.Anonymous, exp.Format):
        name = node.name.lower() if isinstance(node, exp.Anonymous) else "format"
        if name not in ("printf", "format"):
            continue
        pattern = node.expressions[0] if isinstance(node, exp.Anonymous) and node.expressions else node.this
        if not isinstance(pattern, exp.Literal) or not pattern.is_string:
            return False, f"{name}'s format must be a string literal in model-written SQL"
        for width, precision in _CONVERSION.findall(pattern.this):
            for value in (width, precision):
                if value == "*" or (value.isdigit() and int(value) > MAX_FORMAT_WIDTH):
                    return False, (
                        f"{name}'s format {pattern.this[:40]!r} asks for a width or precision "
                        f"{'from an argument (*)' if value == '*' else value} (at most {MAX_FORMAT_WIDTH}): one call "
                        "could build a value of any size"
                    )
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
    key = (str(db_path), sql, timeout_s, max_rows)
    cached = RESULTS.get(key)
    if cached is not None:
        return cached
    try:
        result = _uncached_query(*key)
    except QueryTimeout as timeout:
        return QueryResult(None, str(timeout))
    RESULTS.put(key, result)
    return result


def _uncached_query(db_path: str, sql: str, timeout_s: float, max_rows: int) -> QueryResult:
    ok, reason = check_single_query(sql)
    if not ok:
        return QueryResult(None, reason)
    if not Path(db_path).is_file():
        return QueryResult(None, f"database not found: {db_path}")
    return _WORKER.run(db_path, sql, timeout_s, max_rows)


def _row_bytes(row: tuple) -> int:
    """What one result row holds: its strings' and blobs' lengths, 8 per number or NULL, 8 for the row itself."""
    return sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in row) + 8


def result_bytes(result: QueryResult) -> int:
    """What a result holds: its rows (:func:`_row_bytes`) and its error text."""
    return sum(_row_bytes(row) for row in result.rows or ()) + len(result.error or "")


class ResultCache:
    """Least-recently-used query results, at most ``capacity`` bytes in all (:func:`result_bytes`); ``hits`` counts
    the lookups it answered."""

    def __init__(self, capacity: int):
        self.capacity, self.size, self.hits = capacity, 0, 0
        self._entries: OrderedDict[tuple, tuple[QueryResult, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> QueryResult | None:
        with self._lock:
            if key not in self._entries:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return self._entries[key][0]

    def put(self, key: tuple, result: QueryResult) -> None:
        size = result_bytes(result)
        with self._lock:
            if key in self._entries or size > self.capacity:
                return
            self._entries[key] = (result, size)
            self.size += size
            while self.size > self.capacity:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.size -= dropped


RESULTS = ResultCache(CACHE_BYTES)


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
        rows, size = [], 0
        for row in conn.execute(sql):  # row by row: a result past a cap is refused before it is all built
            rows.append(row)
            size += _row_bytes(row)
            if len(rows) > max_rows:
                return QueryResult(None, f"the result has more than {max_rows} rows")
            if size > MAX_RESULT_BYTES:
                return QueryResult(None, f"the result holds more than {MAX_RESULT_BYTES} bytes")
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
