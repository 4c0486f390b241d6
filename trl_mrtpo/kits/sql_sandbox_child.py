"""The SQL sandbox's child process: a fresh interpreter that runs model-written queries (the standard library only).

:mod:`trl_mrtpo.kits.sql_sandbox` starts it as ``python -I <this file> <memory limit>``, never by forking the
trainer: a fork would inherit the trainer's address space (gigabytes of model and CUDA mappings), and a memory limit
set after it would leave no room. The child bounds its own address space (``RLIMIT_AS``) before its first query, so a
query that builds a huge row fails with an error here instead of growing without bound.

Protocol: one JSON request per line on stdin (``db``, ``sql``, ``timeout_s``, ``max_rows``, ``max_bytes``); one JSON
reply per line on stdout: ``{"rows": [...], "error": null}``, ``{"rows": null, "error": "..."}`` or ``{"timeout":
"..."}``. Blobs travel as ``{"blob": "<hex>"}``. The checks that need ``sqlglot`` (one read-only query, safe printf
widths) run in the parent before a request is sent; this file is the second line of defence.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

MAX_VALUE_BYTES = 10_000_000  # largest string or blob model SQL may build
RESULT_TOO_LARGE = (
    "the result holds more than"  # how a result past its row or byte cap is refused (the caller reads it)
)

# Authorizer: reading is all model SQL may do. Functions are allowed except extension loading and blob makers.
_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer", "randomblob", "zeroblob"}


class QueryTimeout(Exception):
    """A query hit the time limit; kept out of the cache, since a busy machine can cause it."""


def timeout_message(timeout_s: float) -> str:
    return f"the query ran longer than {timeout_s:g} s and was stopped"


def _authorizer(action, arg1, arg2, db_name, trigger):
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS else sqlite3.SQLITE_DENY


def sandbox_connection(db_path: str | Path, deadline: float) -> sqlite3.Connection:
    """A fresh read-only connection that may only read, and that aborts any statement after ``deadline``
    (``time.monotonic()`` seconds)."""
    conn = sqlite3.connect(f"{Path(db_path).resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
    conn.set_authorizer(_authorizer)
    # Text that is not UTF-8 (latin-1 in some BIRD databases) is read, not refused: every undecodable byte maps to its
    # own surrogate, so distinct strings stay distinct and a reference and a prediction decode alike.
    conn.text_factory = lambda data: data.decode("utf-8", "surrogateescape")
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    # One opcode can allocate a huge value (randomblob(1e9)) before the progress handler runs again: cap sizes.
    if hasattr(conn, "setlimit"):  # Python >= 3.11
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    return conn


def row_bytes(row: tuple) -> int:
    """What one result row holds: its strings' and blobs' lengths, 8 per number or NULL, 8 for the row itself."""
    return sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in row) + 8


def _normalise(value: Any) -> Any:
    return round(value, 6) if isinstance(value, float) else value


def execute_query(db_path: str, sql: str, timeout_s: float, max_rows: int, max_bytes: int) -> dict:
    """Runs one checked query on a sandbox connection: ``{"rows": [...] | None, "error": str | None}``."""
    deadline = time.monotonic() + timeout_s
    try:
        conn = sandbox_connection(db_path, deadline)
    except sqlite3.Error as error:
        return {"rows": None, "error": f"cannot open database: {error}"}
    try:
        rows, size = [], 0
        for row in conn.execute(sql):  # row by row: a result past a cap is refused before it is all built
            rows.append(row)
            size += row_bytes(row)
            if len(rows) > max_rows:
                return {"rows": None, "error": f"{RESULT_TOO_LARGE} {max_rows} rows"}
            if size > max_bytes:
                return {"rows": None, "error": f"{RESULT_TOO_LARGE} {max_bytes} bytes"}
        return {"rows": [[_normalise(v) for v in row] for row in rows], "error": None}
    except sqlite3.OperationalError as error:
        if time.monotonic() > deadline:
            raise QueryTimeout(timeout_message(timeout_s)) from error
        if "out of memory" in str(error):  # SQLite's own allocation hit the address-space limit
            raise MemoryError from error
        return {"rows": None, "error": str(error)}
    except (sqlite3.Error, ValueError, OverflowError) as error:
        return {"rows": None, "error": str(error) or type(error).__name__}
    finally:
        conn.close()


def _encoded(value: Any) -> Any:
    return {"blob": value.hex()} if isinstance(value, bytes) else value


def _reply(request: dict, memory_limit: int) -> str:
    try:
        result = execute_query(
            request["db"], request["sql"], request["timeout_s"], request["max_rows"], request["max_bytes"]
        )
        if result["rows"] is not None:
            result["rows"] = [[_encoded(v) for v in row] for row in result["rows"]]
        return json.dumps(result)
    except QueryTimeout as timeout:
        return json.dumps({"timeout": str(timeout)})
    except MemoryError:
        message = f"the query needed more than the sandbox's {memory_limit >> 20} MiB of memory"
        return json.dumps({"rows": None, "error": message})


def serve(memory_limit: int) -> None:
    """Bounds this process's address space, then answers requests until stdin closes."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    for line in sys.stdin:
        sys.stdout.write(_reply(json.loads(line), memory_limit) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
