"""The sandbox for model-written SQL: every such query runs through :func:`run_query`, in a sandbox child process
(:mod:`trl_mrtpo.kits.sql_sandbox_child`): a fresh interpreter started with ``subprocess`` (never a fork of the
trainer), whose address space is bounded (1 GiB) and which is killed when a query outlives its time limit (even a
single SQLite operation cannot hold a reward past it). Each query gets a fresh read-only connection (URI ``mode=ro``)
with an authorizer that allows reads and nothing else (no writes, ATTACH, PRAGMA, extension loading), a
progress-handler time limit, a value-size limit, a row cap and a cap on the bytes a result holds. ``sqlglot`` rejects
anything that is not a single query before SQLite sees it, and any ``printf`` / ``format`` whose width or precision
could build a value of any size in one step (SQLite's printf ignores the value-size limit). Results are cached in a
byte-bounded cache.

Security-critical: kept apart from the SQL kit's rewards and data so that it can be read and reviewed on its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import sqlglot
from sqlglot import exp
from sqlglot.tokens import TokenType

from . import sql_sandbox_child
from .sql_sandbox_child import QueryTimeout, row_bytes, timeout_message

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_ROWS = 10_000
MAX_RESULT_BYTES = 1_000_000  # largest result (all rows' values) a query may return, unless its reference is larger
MAX_REFERENCE_RESULT_BYTES = 64_000_000  # largest result a reference query may return (and a prediction of it)
MAX_REFERENCE_ROWS = 1_000_000  # most rows a reference query may return (and a prediction of it)
MAX_FORMAT_WIDTH = 1_000  # largest width or precision a printf / format conversion may ask for
CACHE_BYTES = 64_000_000  # the result cache's size; the least recently used results leave first
SANDBOX_MEMORY_BYTES = 1 << 30  # the sandbox child's address space
# a printf conversion: flags, width (digits or *), precision (. digits or .*), then the conversion letter
_CONVERSION = re.compile(r"%[-+ 0#,!]*(\*|\d+)?(?:\.(\*|\d*))?[a-zA-Z%]")


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


def statement_text(sql: str) -> str:
    """``sql`` without what follows its last token: final semicolons, whitespace and comments. SQLite reads
    ``SELECT id FROM t; -- the ids`` as one statement, and so do the rewards; Python's ``sqlite3`` refuses a second
    ``;``. Text sqlglot cannot tokenise is returned as it is (the check then names the problem)."""
    try:
        with _quiet_sqlglot():
            tokens = [t for t in sqlglot.tokenize(sql, read="sqlite") if t.token_type != TokenType.SEMICOLON]
    except Exception:
        return sql
    return sql[: tokens[-1].end + 1] if tokens else sql


def check_single_query(sql: str) -> tuple[bool, str | None]:
    """``(is_one_read_only_query, reason_if_not)``, using sqlglot's SQLite dialect; a final semicolon and comments
    after it belong to the statement (:func:`statement_text`)."""
    try:
        with _quiet_sqlglot():
            statements = [s for s in sqlglot.parse(statement_text(sql), read="sqlite") if s is not None]
    except Exception as error:  # sqlglot raises several error types on garbage
        return False, f"could not parse the SQL: {str(error).splitlines()[0][:200]}"
    if len(statements) != 1:
        return False, f"expected exactly one statement, found {len(statements)}"
    if not isinstance(statements[0], (exp.Query, exp.Values)):  # a bare VALUES list reads like a SELECT
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


def run_query(
    db_path: str,
    sql: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_rows: int = DEFAULT_MAX_ROWS,
    max_bytes: int = MAX_RESULT_BYTES,
) -> QueryResult:
    """Run one model-written query in the sandbox. Never raises for bad SQL; the error text is SQLite's own.

    ``max_bytes`` caps what the result holds (:func:`result_bytes`). Results are cached per (database, query,
    limits): the database is opened read-only, so a query's result cannot change while training runs. Time-outs are
    not cached.
    """
    key = (str(db_path), statement_text(sql), timeout_s, max_rows, max_bytes)
    cached = RESULTS.get(key)
    if cached is not None:
        return cached
    try:
        result = _uncached_query(*key)
    except QueryTimeout as timeout:
        return QueryResult(None, str(timeout))
    RESULTS.put(key, result)
    return result


def _uncached_query(db_path: str, sql: str, timeout_s: float, max_rows: int, max_bytes: int) -> QueryResult:
    ok, reason = check_single_query(sql)
    if not ok:
        return QueryResult(None, reason)
    if not Path(db_path).is_file():
        return QueryResult(None, f"database not found: {db_path}")
    result = _WORKER.run(db_path, sql, timeout_s, max_rows, max_bytes)
    return result if result.rows is None else replace(result, ordered=_is_ordered(sql))


def result_bytes(result: QueryResult) -> int:
    """What a result holds: its rows (:func:`~trl_mrtpo.kits.sql_sandbox_child.row_bytes`) and its error text."""
    return sum(row_bytes(row) for row in result.rows or ()) + len(result.error or "")


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


class _SandboxWorker:
    """The sandbox child (:mod:`~trl_mrtpo.kits.sql_sandbox_child`), started on the first query and reused.

    One SQLite operation can run for seconds without returning to the progress handler (``printf('%.*c',
    2000000000, 'x')`` builds a 2 GB string in one opcode), so the parent waits at most ``timeout_s`` plus a short
    grace and then kills the child (a fresh one serves the next query). Ordinary long queries are still stopped by
    the child's own progress handler, which keeps the child alive.
    """

    GRACE_S = 0.3

    def __init__(self, memory_bytes: int = SANDBOX_MEMORY_BYTES):
        self.memory_bytes = memory_bytes
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        # -I: no user site, no environment variables, not even the script's folder on sys.path: the standard library
        command = [sys.executable, "-I", sql_sandbox_child.__file__, str(self.memory_bytes)]
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0
        )

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process.stdin.close()
            self._process.stdout.close()
        self._process = None

    def _read_line(self, deadline: float) -> bytes | None:
        """The child's reply, or None when it is not complete by ``deadline``; EOFError when the child died."""
        stdout, chunks = self._process.stdout, []
        while True:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([stdout], [], [], wait)[0]:
                return None
            chunk = os.read(stdout.fileno(), 1 << 20)
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(chunks)

    def run(self, db_path: str, sql: str, timeout_s: float, max_rows: int, max_bytes: int) -> QueryResult:
        request = {"db": db_path, "sql": sql, "timeout_s": timeout_s, "max_rows": max_rows, "max_bytes": max_bytes}
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            try:
                self._process.stdin.write((json.dumps(request) + "\n").encode())
                line = self._read_line(time.monotonic() + timeout_s + self.GRACE_S)
            except (EOFError, BrokenPipeError):  # the child died: a failure, and a fresh child next time
                self._stop()
                return QueryResult(None, "the query crashed the SQL sandbox")
            if line is None:
                self._stop()
                raise QueryTimeout(timeout_message(timeout_s))
        reply = json.loads(line)
        if "timeout" in reply:
            raise QueryTimeout(reply["timeout"])
        if reply["rows"] is None:
            return QueryResult(None, reply["error"])
        return QueryResult(tuple(tuple(_decoded(v) for v in row) for row in reply["rows"]), None)


def _decoded(value):
    return bytes.fromhex(value["blob"]) if isinstance(value, dict) else value


_WORKER = _SandboxWorker()
