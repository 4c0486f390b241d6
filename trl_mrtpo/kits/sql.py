"""Text-to-SQL kit: rewards, info blocks, a sandbox for model-written SQL, Spider/BIRD and built-in data.

Rewards (0/1 each, TRL reward-function signature; dataset columns ``db_path`` and ``query``):

- :func:`sql_format_reward`: exactly one ```` ```sql ```` fenced block holding exactly one read-only query.
- :func:`sql_executable_reward`: that query runs without error on the sample's SQLite database.
- :func:`sql_execution_reward`: its result equals the reference query's (multiset of rows; row order counts only
  when the reference has a top-level ORDER BY).

Info blocks (appended): :func:`sql_format_block` (the format rule), :func:`sql_error_block` (the response's own
SQLite error, none when it ran), :func:`sql_reference_block` (the reference query).

Model-written SQL only ever runs through :func:`~trl_mrtpo.kits.sql_sandbox.run_query` (``sql_sandbox``: a
separate, killable, read-only, time- and size-bounded process; ``sqlglot`` refuses anything but one query first).
"""

from __future__ import annotations

import json
import re
import sqlite3
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from ..utils import completion_text
from . import Kit, Spans
from .sql_sandbox import (
    DEFAULT_MAX_ROWS,
    MAX_REFERENCE_RESULT_BYTES,
    MAX_REFERENCE_ROWS,
    MAX_RESULT_BYTES,
    QueryResult,
    check_single_query,
    result_bytes,
    run_query,
)

FORMAT_RULE = (
    "Format: answer with exactly one SQLite query inside a ```sql ... ``` code block, and nothing else in code."
)
_FENCE = re.compile(r"```sql[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_sql(text: str) -> str | None:
    """The query inside the only ```sql fence of ``text``; None if there is none or more than one."""
    if not isinstance(text, str):
        return None
    blocks = _FENCE.findall(text)
    if len(blocks) != 1 or not blocks[0].strip():
        return None
    return blocks[0].strip()


def same_result(predicted: QueryResult, reference: QueryResult) -> bool:
    """Execution match: multisets of rows, or row lists when the reference is ordered."""
    if predicted.rows is None or reference.rows is None:
        return False
    if reference.ordered:
        return predicted.rows == reference.rows
    return Counter(predicted.rows) == Counter(reference.rows)


def _per_sample(values: Any, n: int) -> list:
    return list(values) if isinstance(values, (list, tuple)) else [values] * n


def _query_of(completion: Any) -> str | None:
    sql = extract_sql(completion_text(completion))
    return sql if sql is not None and check_single_query(sql)[0] else None


def sql_format_reward(completions: list, **kwargs) -> list[float]:
    """1 when the completion holds exactly one ```sql fence with exactly one read-only query."""
    return [float(_query_of(c) is not None) for c in completions]


_FAILED_REFERENCES: dict[tuple[str, str], QueryResult] = {}  # a failing or timed-out reference's outcome, kept


def run_reference(db_path: str, reference: str) -> QueryResult:
    """The reference query's result, which may hold up to :data:`MAX_REFERENCE_ROWS` rows and
    :data:`MAX_REFERENCE_RESULT_BYTES` bytes. A failure or a time-out is kept for the process's life (the sandbox
    caches no time-out): a reference that times out costs its limit once, not at every reward and block."""
    key = (str(db_path), reference)
    if key not in _FAILED_REFERENCES:
        result = run_query(str(db_path), reference, max_rows=MAX_REFERENCE_ROWS, max_bytes=MAX_REFERENCE_RESULT_BYTES)
        if result.error is None:
            return result
        _FAILED_REFERENCES[key] = result
    return _FAILED_REFERENCES[key]


def run_prediction(db_path: str, sql: str, reference: str | None) -> tuple[QueryResult, QueryResult | None]:
    """A model-written query's result and its reference's (None without one). The prediction may hold twice the rows
    and bytes of the reference's result (at least the default caps, at most the reference's own), so a correct query
    for a large reference result is not refused for its size."""
    gold = run_reference(db_path, reference) if _has_text(reference) else None
    rows, size = DEFAULT_MAX_ROWS, MAX_RESULT_BYTES
    if gold is not None and gold.rows is not None:
        rows = min(max(2 * len(gold.rows), DEFAULT_MAX_ROWS), MAX_REFERENCE_ROWS)
        size = min(max(2 * result_bytes(gold), MAX_RESULT_BYTES), MAX_REFERENCE_RESULT_BYTES)
    return run_query(str(db_path), sql, max_rows=rows, max_bytes=size), gold


def _has_text(reference: Any) -> bool:
    return isinstance(reference, str) and bool(reference.strip())


_WARNED_REFERENCES: set[tuple[str, str]] = set()


def usable_reference(db: str, reference: Any, question: Any = None) -> QueryResult | None:
    """The reference's result when a prediction can be scored against it; None, with one warning per reference
    naming its database and query (and question), when it is empty, missing, fails or times out."""
    if _has_text(reference):
        gold = run_reference(db, reference)
        if gold.error is None:
            return gold
        problem = f"fails on {db}: {reference[:200]!r} ({gold.error})"
    else:
        problem = f"for {db} is {'missing' if reference is None else repr(reference)}"
    key = (str(db), str(reference))
    if key not in _WARNED_REFERENCES:
        _WARNED_REFERENCES.add(key)
        asked = f" (question {str(question)[:120]!r})" if question else ""
        warnings.warn(
            f"The reference query {problem}{asked}. Its rows score None (no advantage) until the dataset is fixed.",
            stacklevel=3,
        )
    return None


def sql_executable_reward(completions: list, db_path: list[str], query: list[str] | None = None, **kwargs):
    """1 when the query runs without error on the sample's database (0 when there is no well-formed query)."""
    n = len(completions)
    out = []
    for completion, db, reference in zip(completions, _per_sample(db_path, n), _per_sample(query, n)):
        sql = _query_of(completion)
        out.append(float(sql is not None and run_prediction(db, sql, reference)[0].error is None))
    return out


def sql_execution_reward(completions: list, db_path: list[str], query: list[str], **kwargs) -> list[float | None]:
    """1 when the query's result equals the reference query's result on the sample's database; None (with one
    warning per reference) when the reference is empty or missing, or cannot be run or is past its limits."""
    n = len(completions)
    out = []
    questions = _per_sample(kwargs.get("question"), n)
    for completion, db, reference, question in zip(
        completions, _per_sample(db_path, n), _per_sample(query, n), questions
    ):
        if usable_reference(str(db), reference, question) is None:
            out.append(None)
            continue
        sql = _query_of(completion)
        out.append(float(sql is not None and same_result(*run_prediction(db, sql, reference))))
    return out


def sql_format_block(*, prompt, completion, row, score) -> str:
    """The format requirement the format reward checks."""
    return FORMAT_RULE


def sql_error_block(*, prompt, completion, row, score) -> str | None:
    """The response's own SQLite error message; None when its query ran (or it has no query to run)."""
    sql = extract_sql(completion)
    if sql is None:
        return None
    error = run_prediction(row["db_path"], sql, row.get("query"))[0].error
    return None if error is None else f"Your SQL failed with this error: {error}"


_NAMED_PLACE = re.compile(r'near "([^"]+)"|no such (?:column|table|function): ([\w.]+)')
_PARSE_PLACE = re.compile(r"Line (\d+), Col: (\d+)")


def _error_offset(sql: str, error: str) -> int | None:
    """Where in ``sql`` an error points: the end of the name SQLite quotes, or the parser's line and column."""
    named = _NAMED_PLACE.search(error)
    if named is not None:
        name = named.group(1) or named.group(2)
        where = sql.find(name)
        return None if where < 0 else where + len(name)
    parsed = _PARSE_PLACE.search(error)
    if parsed is None:
        return None
    lines = sql.split("\n")
    line, column = int(parsed.group(1)), int(parsed.group(2))
    if not 1 <= line <= len(lines):
        return None
    return min(sum(len(text) + 1 for text in lines[: line - 1]) + column, len(sql))


def sql_error_boundary(*, prompt, completion, row, score) -> int | None:
    """Failure boundary of :func:`sql_executable_reward`: where the error points, SQLite's (``near "X"``, ``no such
    column: X``: the end of X's first occurrence) or the parser's (line and column); None when it names no place."""
    text = completion_text(completion)
    match = _FENCE.search(text)
    sql = extract_sql(text)
    if match is None or sql is None:
        return None
    offset = _error_offset(sql, run_prediction(row["db_path"], sql, row.get("query"))[0].error or "")
    if offset is None or offset < 1:
        return None
    return match.start(1) + match.group(1).index(sql) + offset


def sql_reference_block(*, prompt, completion, row, score) -> str | None:
    """The reference query the execution reward compares against (None for a row without one: its execution reward
    is None, so nothing is replayed)."""
    reference = row.get("query")
    return f"A correct query is:\n```sql\n{reference}\n```" if _has_text(reference) else None


# ---------------------------------------------------------------------------------------------------------------- data
def database_schema(db_path: str | Path) -> str:
    """The CREATE statements of a database, as written in its sqlite_master."""
    conn = sqlite3.connect(f"{Path(db_path).resolve().as_uri()}?mode=ro", uri=True)
    # a latin-1 byte in some BIRD schemas is read, not refused (as the sandbox reads it), and shown as U+FFFD in the
    # prompt: a lone surrogate would fail the tokenizer
    conn.text_factory = lambda data: data.decode("utf-8", "replace")
    try:
        rows = conn.execute("SELECT sql FROM sqlite_master WHERE type='table' AND sql IS NOT NULL").fetchall()
    except (sqlite3.Error, UnicodeDecodeError) as error:  # a damaged file; an undecodable schema error message
        raise ValueError(f"Cannot read the schema of {db_path}: {error}") from error
    finally:
        conn.close()
    return "\n".join(r[0].strip() + ";" for r in rows)


def sql_prompt(question: str, schema: str, evidence: str | None = None) -> list[dict[str, str]]:
    """The conversational prompt: schema, optional external knowledge (BIRD's evidence), question, format rule."""
    hint = f"\nExternal knowledge: {evidence}" if evidence else ""
    content = (
        f"Database schema:\n{schema}\n{hint}\nQuestion: {question}\n"
        "Write one SQLite query that answers the question, inside a ```sql code block."
    )
    return [{"role": "user", "content": content}]


def load_spider_or_bird(root: str | Path, split_file: str, database_dir: str = "database") -> list[dict]:
    """Rows from a local Spider or BIRD folder.

    Args:
        root: folder holding ``split_file`` and ``database_dir/<db_id>/<db_id>.sqlite``.
        split_file: e.g. ``train_spider.json`` / ``dev.json`` (Spider) or ``train/train.json`` (BIRD).
        database_dir: ``database`` (Spider), ``train/train_databases`` or ``dev/dev_databases`` (BIRD).

    Returns:
        rows with ``prompt``, ``query``, ``db_path`` and ``question``; Spider's ``query`` and BIRD's ``SQL`` keys
        are both read, BIRD's ``evidence`` goes into the prompt.
    """
    root = Path(root)
    examples = json.loads((root / split_file).read_text())
    schemas: dict[str, str] = {}
    rows = []
    for i, example in enumerate(examples):
        db_id = example.get("db_id")
        reference = example.get("query", example.get("SQL"))
        if not db_id or not reference or "question" not in example:
            raise ValueError(f"{split_file} example {i} lacks db_id, question or query/SQL")
        db_path = root / database_dir / db_id / f"{db_id}.sqlite"
        if db_id not in schemas:
            if not db_path.is_file():
                raise FileNotFoundError(f"{split_file} example {i}: database {db_path} does not exist")
            schemas[db_id] = database_schema(db_path)
        rows.append(
            {
                "prompt": sql_prompt(example["question"], schemas[db_id], example.get("evidence")),
                "question": example["question"],
                "query": reference,
                "db_path": str(db_path),
            }
        )
    return rows


_DEMO_TABLES = {
    "shop": [
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT)",
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), amount REAL, "
        "day TEXT)",
        "INSERT INTO customers VALUES (1,'Ana','Lisbon'),(2,'Ben','Paris'),(3,'Chen','Lisbon'),(4,'Dana','Rome')",
        "INSERT INTO orders VALUES (1,1,20.5,'2024-01-02'),(2,1,7.0,'2024-01-05'),(3,2,13.25,'2024-02-01'),"
        "(4,3,40.0,'2024-02-03'),(5,3,2.5,'2024-03-09')",
    ],
    "school": [
        "CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT, year INTEGER)",
        "CREATE TABLE courses (id INTEGER PRIMARY KEY, title TEXT, credits INTEGER)",
        "CREATE TABLE enrollments (student_id INTEGER, course_id INTEGER, grade INTEGER)",
        "INSERT INTO students VALUES (1,'Eva',1),(2,'Finn',2),(3,'Gul',2),(4,'Hugo',3)",
        "INSERT INTO courses VALUES (1,'Algebra',5),(2,'Biology',3),(3,'Chemistry',4)",
        "INSERT INTO enrollments VALUES (1,1,90),(1,2,75),(2,1,60),(3,3,88),(4,2,95),(4,3,70)",
    ],
}
_DEMO_QUESTIONS = [
    ("shop", "How many customers are there?", "SELECT count(*) FROM customers"),
    ("shop", "List the names of customers who live in Lisbon.", "SELECT name FROM customers WHERE city = 'Lisbon'"),
    ("shop", "What is the total amount of all orders?", "SELECT sum(amount) FROM orders"),
    (
        "shop",
        "Show each customer's name and their number of orders, most orders first.",
        "SELECT c.name, count(o.id) AS n FROM customers c LEFT JOIN orders o ON o.customer_id = c.id "
        "GROUP BY c.id ORDER BY n DESC, c.name",
    ),
    (
        "shop",
        "Which customers have never ordered?",
        "SELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders)",
    ),
    ("shop", "What is the largest single order amount?", "SELECT max(amount) FROM orders"),
    ("school", "How many students are in year 2?", "SELECT count(*) FROM students WHERE year = 2"),
    ("school", "List course titles with more than 3 credits.", "SELECT title FROM courses WHERE credits > 3"),
    (
        "school",
        "What is the average grade in Algebra?",
        "SELECT avg(e.grade) FROM enrollments e JOIN courses c ON c.id = e.course_id WHERE c.title = 'Algebra'",
    ),
    (
        "school",
        "Give the names of students enrolled in Biology.",
        "SELECT s.name FROM students s JOIN enrollments e ON e.student_id = s.id JOIN courses c ON c.id = e.course_id "
        "WHERE c.title = 'Biology'",
    ),
    (
        "school",
        "Which student has the highest grade?",
        "SELECT s.name FROM students s JOIN enrollments e ON e.student_id = s.id ORDER BY e.grade DESC LIMIT 1",
    ),
    (
        "school",
        "How many courses does each student take?",
        "SELECT student_id, count(*) FROM enrollments GROUP BY student_id",
    ),
]


def build_demo_databases(folder: str | Path) -> dict[str, str]:
    """Create the built-in SQLite databases in ``folder`` (idempotent); returns ``{db_id: path}``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for db_id, statements in _DEMO_TABLES.items():
        path = folder / f"{db_id}.sqlite"
        if not path.is_file():
            partial = path.with_suffix(".partial")
            partial.unlink(missing_ok=True)
            conn = sqlite3.connect(partial)
            for statement in statements:
                conn.execute(statement)
            conn.commit()
            conn.close()
            partial.replace(path)
        paths[db_id] = str(path)
    return paths


def make_sql_dataset(folder: str | Path):
    """The built-in text-to-SQL set (12 questions over 2 small databases) as a ``datasets.Dataset``."""
    from datasets import Dataset

    paths = build_demo_databases(folder)
    schemas = {db_id: database_schema(path) for db_id, path in paths.items()}
    return Dataset.from_list(
        [
            {"prompt": sql_prompt(q, schemas[db]), "question": q, "query": ref, "db_path": paths[db]}
            for db, q, ref in _DEMO_QUESTIONS
        ]
    )


def builtin_sql_dataset(num_prompts: int = 0, seed: int = 0, cache_dir: str | None = None):
    """The built-in set (every example, whatever ``num_prompts``) shuffled by ``seed``; its databases are created in
    ``cache_dir`` (by default the trl-mrtpo cache folder)."""
    from . import cache_root

    return make_sql_dataset(cache_dir or cache_root() / "sql_data").shuffle(seed=seed)


def unusable_references(rows: list[dict]) -> dict[int, str]:
    """The rows whose reference query no prediction could be scored against, with why: it fails, or its result holds
    more than :data:`MAX_REFERENCE_ROWS` rows or :data:`MAX_REFERENCE_RESULT_BYTES` bytes (each is run once, in the
    sandbox; the results are cached for training)."""
    from tqdm.auto import tqdm

    reasons = {}
    for i, row in enumerate(tqdm(rows, desc="Running the reference queries", disable=len(rows) < 100)):
        reference = row.get("query")
        error = run_reference(row["db_path"], reference).error if _has_text(reference) else "no reference query"
        if error is not None:
            reasons[i] = error
    return reasons


def _published_loader(name: str):
    def load(data_path: str | None, data_split_file: str | None, database_dir: str = "database"):
        from datasets import Dataset

        if not data_path or not data_split_file:
            raise ValueError(f"data_loader={name} needs data_path and data_split_file")
        rows = load_spider_or_bird(data_path, data_split_file, database_dir)
        unusable = unusable_references(rows)
        if unusable:
            examples = "; ".join(
                f"example {i}: {rows[i]['query'][:200]!r} ({why})" for i, why in list(unusable.items())[:5]
            )
            raise ValueError(
                f"{data_split_file}: {len(unusable)} reference query(ies) cannot be scored against: they fail, or "
                f"their result holds more than {MAX_REFERENCE_ROWS} rows or {MAX_REFERENCE_RESULT_BYTES} bytes "
                f"({examples}); fix or remove these examples."
            )
        return Dataset.from_list(rows)

    return load


def sql_spans(row: dict, text: str) -> Spans:
    """The code fences (format) and the query inside them (execution)."""
    fences = [m.span() for m in re.finditer(r"```(?:sql)?", text, re.IGNORECASE)]
    bodies = [m.span(1) for m in _FENCE.finditer(text)]
    return {"sql_format_reward": ("code fences", fences), "sql_execution_reward": ("query body", bodies)}


KIT = Kit(
    name="sql",
    description="text-to-SQL: format, executable and execution-match rewards on SQLite",
    rewards=[sql_format_reward, sql_executable_reward, sql_execution_reward],
    info_blocks=[sql_format_block, sql_error_block, sql_reference_block],
    dataset=builtin_sql_dataset,
    spans=sql_spans,
    loaders={"spider": _published_loader("spider"), "bird": _published_loader("bird")},
    failure_boundaries=[None, sql_error_boundary, None],
    examples="sql.jsonl",
)
