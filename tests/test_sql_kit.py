"""Text-to-SQL kit: rewards on real cases, fuzzed input, info blocks, the sandbox under attack, data adapters."""

import hashlib
import json
import shutil
import sqlite3
import time

import pytest
from hypothesis import given, settings

from tests.conftest import MALFORMED_COMPLETIONS
from trl_mrtpo.kits import sql
from trl_mrtpo.kits.sql import (
    build_demo_databases,
    extract_sql,
    load_spider_or_bird,
    make_sql_dataset,
    sql_error_block,
    sql_executable_reward,
    sql_execution_reward,
    sql_format_reward,
    sql_reference_block,
)
from trl_mrtpo.kits.sql_sandbox import run_query
from trl_mrtpo.kits.sql_sandbox_child import sandbox_connection


@pytest.fixture(scope="module")
def dbs(tmp_path_factory):
    return build_demo_databases(tmp_path_factory.mktemp("sqlkit"))


def fenced(query):
    return [{"role": "assistant", "content": f"Here it is:\n```sql\n{query}\n```"}]


def test_rewards_on_real_positive_and_negative_cases(dbs):
    shop = dbs["shop"]
    reference = "SELECT name FROM customers WHERE city = 'Lisbon'"
    completions = [
        fenced("SELECT name FROM customers WHERE city = 'Lisbon'"),  # right
        fenced("SELECT name FROM customers WHERE city = 'Lisbon' ORDER BY name DESC"),  # same multiset
        fenced("SELECT name FROM customers"),  # runs, wrong result
        fenced("SELECT nme FROM customers"),  # does not run
        [{"role": "assistant", "content": "SELECT name FROM customers"}],  # no fence
        fenced("SELECT 1; SELECT 2"),  # two statements
        fenced("DELETE FROM customers"),  # not a query
    ]
    n = len(completions)
    assert sql_format_reward(completions) == [1, 1, 1, 1, 0, 0, 0]
    assert sql_executable_reward(completions, db_path=[shop] * n) == [1, 1, 1, 0, 0, 0, 0]
    assert sql_execution_reward(completions, db_path=[shop] * n, query=[reference] * n) == [1, 1, 0, 0, 0, 0, 0]


def test_order_matters_only_when_reference_is_ordered(dbs):
    ordered = "SELECT name FROM customers ORDER BY name"
    assert sql_execution_reward(
        [fenced("SELECT name FROM customers ORDER BY name DESC")], [dbs["shop"]], [ordered]
    ) == [0]
    assert sql_execution_reward([fenced("SELECT name FROM customers ORDER BY id")], [dbs["shop"]], [ordered]) == [1]
    # float results compare after rounding to 6 digits
    assert sql_execution_reward(
        [fenced("SELECT sum(amount) + 0.0000000001 FROM orders")], [dbs["shop"]], ["SELECT sum(amount) FROM orders"]
    ) == [1]


def test_extract_sql():
    assert extract_sql("```sql\nSELECT 1\n```") == "SELECT 1"
    assert extract_sql("```SQL SELECT 1```") == "SELECT 1"
    assert extract_sql("```sql\nSELECT 1\n``` and ```sql\nSELECT 2\n```") is None
    assert extract_sql("```sql\n\n```") is None
    assert extract_sql(None) is None


@settings(max_examples=200, deadline=None)
@given(MALFORMED_COMPLETIONS)
def test_malformed_completions_never_raise(dbs, junk):
    wrapped = [junk, fenced(junk if isinstance(junk, str) else "x")]
    for completion in wrapped:
        assert sql_format_reward([completion]) in ([0.0], [1.0])
        assert sql_executable_reward([completion], db_path=[dbs["shop"]]) in ([0.0], [1.0])
        assert sql_execution_reward([completion], db_path=[dbs["shop"]], query=["SELECT 1"]) in ([0.0], [1.0])


def test_info_blocks(dbs):
    row = {"db_path": dbs["shop"], "query": "SELECT count(*) FROM customers"}
    assert "no such column: nme" in sql_error_block(
        prompt="", completion="```sql\nSELECT nme FROM customers\n```", row=row, score=0.0
    )
    assert sql_error_block(prompt="", completion="```sql\nSELECT name FROM customers\n```", row=row, score=1.0) is None
    assert sql_error_block(prompt="", completion="no sql", row=row, score=0.0) is None
    assert "SELECT count(*) FROM customers" in sql_reference_block(prompt="", completion="", row=row, score=0.0)
    assert "```sql" in sql.sql_format_block(prompt="", completion="", row=row, score=0.0)


# ---------------------------------------------------------------- sandbox under attack
ATTACKS = [
    "DROP TABLE customers",
    "DELETE FROM customers",
    "UPDATE customers SET name = 'x'",
    "INSERT INTO customers VALUES (9, 'Eve', 'Oslo')",
    "CREATE TABLE evil (x)",
    "CREATE INDEX i ON customers(name)",
    "CREATE VIEW v AS SELECT 1",
    "CREATE TRIGGER t AFTER INSERT ON customers BEGIN SELECT 1; END",
    "ALTER TABLE customers ADD COLUMN x",
    "ALTER TABLE customers RENAME TO c2",
    "REPLACE INTO customers VALUES (1, 'x', 'y')",
    "ATTACH DATABASE '/tmp/evil.sqlite' AS evil",
    "DETACH DATABASE main",
    "PRAGMA writable_schema = 1",
    "PRAGMA journal_mode = DELETE",
    "PRAGMA user_version = 7",
    "VACUUM",
    "VACUUM INTO '/tmp/copy.sqlite'",
    "REINDEX",
    "ANALYZE",
    "BEGIN; DELETE FROM customers; COMMIT",
    "SELECT 1; DROP TABLE customers",
    "SELECT * FROM customers; DELETE FROM orders",
    "SELECT load_extension('/tmp/evil.so')",
    "SELECT readfile('/etc/passwd')",
    "SELECT writefile('/tmp/x', 'y')",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c",
    "SELECT count(*) FROM customers a, customers b, customers c, customers d, customers e, customers f, "
    "customers g, customers h, customers i, customers j, customers k, customers l, customers m, customers n",
    "SELECT * FROM orders a, orders b, orders c, orders d, orders e, orders f, orders g, orders h ORDER BY random()",
    "SELECT randomblob(1000000000)",
    "SELECT zeroblob(2000000000)",
    "SELECT * FROM sqlite_master",  # harmless read: must be allowed, listed to show reads still work
    "INSERT INTO customers SELECT * FROM customers",
    "WITH x AS (SELECT 1) DELETE FROM customers",
    "SAVEPOINT a",
    # single-operation bombs: one SQLite opcode that runs for seconds, so the progress handler never fires
    "SELECT printf('%.*c', 2000000000, 'x')",
    "SELECT upper(printf('%.*c', 1999999999, 'a'))",
    "SELECT substr(printf('%.*c', 2000000000, 'x'), 1, 3)",
    "SELECT count(*) FROM customers WHERE name = printf('%.*c', 2000000000, 'x')",
]
SIZE_BOMBS = [  # (query, what the error names)
    ("SELECT printf('%.*c', 2000000000, 'x')", "width or precision from an argument"),
    ("SELECT printf('%2000000000c', 'x')", "width or precision 2000000000"),
    ("SELECT format('%.9999999s', name) FROM customers", "width or precision 9999999"),
    ("SELECT printf(name, 1) FROM customers", "format must be a string literal"),
    ("SELECT length(printf('%.*c', 20000000, 'x'))", "from an argument"),
    ("SELECT zeroblob(2000000000)", "not authorized"),
    ("SELECT " + "hex(" * 22 + "'abc'" + ")" * 22, "too big"),  # 3 x 2^22 bytes
    ("SELECT " + "replace(" * 24 + "'x'" + ", 'x', 'xx')" * 24, "too big"),  # 2^24 bytes
    (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 100000) "
        "SELECT group_concat(printf('%.900c', 'x')) FROM c",
        "too big",
    ),
    (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 5000) "
        "SELECT printf('%.900c', 'x') FROM c",
        "more than 1000000 bytes",
    ),
]


def file_digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_sandbox_blocks_every_attack(dbs):
    path = dbs["shop"]
    before = file_digest(path)
    limit = 1.0
    for attack in ATTACKS:
        started = time.monotonic()
        result = run_query(path, attack, timeout_s=limit)
        elapsed = time.monotonic() - started
        assert elapsed < limit + 1.0, f"{attack!r} ran {elapsed:.2f} s"
        if attack != "SELECT * FROM sqlite_master":
            assert result.rows is None and result.error, f"{attack!r} was not stopped: {result}"
    assert file_digest(path) == before
    assert run_query(path, "SELECT count(*) FROM customers").rows == ((4,),)


def test_sandbox_connection_refuses_writes_even_without_the_parser(dbs):
    """Defence in depth: SQL that slipped past sqlglot still cannot write, attach or set pragmas."""
    path = dbs["school"]
    before = file_digest(path)
    conn = sandbox_connection(path, time.monotonic() + 2)
    try:
        for statement in [
            "DELETE FROM students",
            "DROP TABLE students",
            "ATTACH ':memory:' AS m",
            "PRAGMA user_version = 3",
            "CREATE TABLE z (a)",
        ]:
            with pytest.raises(sqlite3.DatabaseError):
                conn.execute(statement)
        assert conn.execute("SELECT count(*) FROM students").fetchone() == (4,)
    finally:
        conn.close()
    assert file_digest(path) == before


def test_row_cap_and_missing_database(dbs, tmp_path):
    result = run_query(dbs["shop"], "SELECT * FROM orders a, orders b", max_rows=10)
    assert result.rows is None and "more than 10 rows" in result.error
    assert "database not found" in run_query(str(tmp_path / "none.sqlite"), "SELECT 1").error


# ---------------------------------------------------------------- data
def test_builtin_dataset_references_all_run(tmp_path):
    dataset = make_sql_dataset(tmp_path)
    assert len(dataset) == 12
    for row in dataset:
        assert "CREATE TABLE" in row["prompt"][0]["content"]
        assert run_query(row["db_path"], row["query"]).error is None
        # the reference is a perfect answer for all three rewards
        completion = fenced(row["query"])
        assert sql_execution_reward([completion], [row["db_path"]], [row["query"]]) == [1.0]


def test_spider_and_bird_adapters(tmp_path, dbs):
    spider = tmp_path / "spider"
    (spider / "database" / "shop").mkdir(parents=True)
    shutil.copy(dbs["shop"], spider / "database" / "shop" / "shop.sqlite")
    (spider / "dev.json").write_text(
        json.dumps([{"db_id": "shop", "question": "How many?", "query": "SELECT count(*) FROM customers"}])
    )
    rows = load_spider_or_bird(spider, "dev.json")
    assert (
        rows[0]["query"] == "SELECT count(*) FROM customers"
        and "CREATE TABLE customers" in rows[0]["prompt"][0]["content"]
    )

    bird = tmp_path / "bird"
    (bird / "dev" / "dev_databases" / "shop").mkdir(parents=True)
    shutil.copy(dbs["shop"], bird / "dev" / "dev_databases" / "shop" / "shop.sqlite")
    (bird / "dev" / "dev.json").write_text(
        json.dumps(
            [
                {
                    "db_id": "shop",
                    "question": "Total?",
                    "SQL": "SELECT sum(amount) FROM orders",
                    "evidence": "amount is in euros",
                }
            ]
        )
    )
    rows = load_spider_or_bird(bird, "dev/dev.json", database_dir="dev/dev_databases")
    assert rows[0]["query"] == "SELECT sum(amount) FROM orders"
    assert "External knowledge: amount is in euros" in rows[0]["prompt"][0]["content"]

    (spider / "bad.json").write_text(json.dumps([{"db_id": "nope", "question": "q", "query": "SELECT 1"}]))
    with pytest.raises(FileNotFoundError, match="example 0"):
        load_spider_or_bird(spider, "bad.json")


def test_timeouts_are_not_cached_but_results_are(dbs):
    from trl_mrtpo.kits.sql_sandbox import RESULTS

    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
    size = len(RESULTS)
    assert "longer than 0.2 s" in run_query(dbs["shop"], endless, timeout_s=0.2).error
    assert len(RESULTS) == size
    run_query(dbs["shop"], "SELECT 42")
    hits = RESULTS.hits
    assert run_query(dbs["shop"], "SELECT 42").rows == ((42,),)
    assert RESULTS.hits == hits + 1


@pytest.mark.parametrize("bomb,named", SIZE_BOMBS, ids=[f"bomb{i}" for i in range(len(SIZE_BOMBS))])
def test_size_bombs_are_refused_by_name_on_any_machine(dbs, bomb, named):
    """A query that builds or returns more than the sandbox's sizes is refused with an error naming why, long before
    a generous time limit: the outcome does not depend on how fast the machine builds it."""
    started = time.monotonic()
    result = run_query(dbs["shop"], bomb, timeout_s=30.0)
    assert time.monotonic() - started < 10.0
    assert result.rows is None and named in result.error, result.error
    completion = f"```sql\n{bomb}\n```"
    assert sql_executable_reward([completion], db_path=[dbs["shop"]]) == [0.0]


def test_an_operation_past_the_time_limit_kills_the_sandbox_child(dbs):
    """One SQLite opcode that runs for seconds (a 2 GB printf, past the parser here) never returns to the progress
    handler: the parent stops waiting at the limit, kills the child, and a fresh child serves the next query."""
    from trl_mrtpo.kits.sql_sandbox import _WORKER, QueryTimeout

    started = time.monotonic()
    with pytest.raises(QueryTimeout, match="longer than 0.05 s"):
        _WORKER.run(dbs["shop"], "SELECT printf('%.*c', 2000000000, 'x')", 0.05, 10, 1000)
    assert time.monotonic() - started < 1.0
    assert run_query(dbs["shop"], "SELECT count(*) FROM customers").rows == ((4,),)


def test_the_result_cache_holds_a_bounded_number_of_bytes():
    from trl_mrtpo.kits.sql_sandbox import CACHE_BYTES, RESULTS, QueryResult, ResultCache, result_bytes

    assert RESULTS.capacity == CACHE_BYTES
    cache = ResultCache(capacity=100)
    rows = [QueryResult((("x" * 30,),), None) for _ in range(5)]
    assert result_bytes(rows[0]) == 38
    for i, result in enumerate(rows):
        cache.put(("db", f"q{i}", 1.0, 10), result)
        assert cache.size <= 100
    assert len(cache) == 2 and cache.get(("db", "q0", 1.0, 10)) is None and cache.get(("db", "q4", 1.0, 10))
    cache.put(("db", "big", 1.0, 10), QueryResult((("x" * 200,),), None))  # larger than the whole cache
    assert cache.get(("db", "big", 1.0, 10)) is None and cache.size <= 100


def test_sqlglot_fallback_warnings_stay_out_of_the_log(dbs, caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        run_query(dbs["shop"], "VACUUM INTO '/tmp/copy.sqlite'")
    assert not [r for r in caplog.records if r.name.startswith("sqlglot")]


def test_error_boundary_points_at_what_sqlite_names(dbs):
    from trl_mrtpo.kits.sql import sql_error_boundary

    row = {"db_path": dbs["shop"]}
    for query, culprit in (("SELECT nme FROM customers", "nme"), ("SELECT name FROM custmers", "custmers")):
        (completion,) = fenced(query)
        text = completion["content"]
        end = sql_error_boundary(prompt=None, completion=[completion], row=row, score=0.0)
        assert text[:end].endswith(culprit) and text.index(culprit) + len(culprit) == end
    syntax = fenced("SELECT name FROM customers WHERE WHERE city = 1")
    end = sql_error_boundary(prompt=None, completion=syntax, row=row, score=0.0)
    assert syntax[0]["content"][:end].endswith("WHERE")
    # a query that runs, or text without a query, has no place to point at
    assert sql_error_boundary(prompt=None, completion=fenced("SELECT name FROM customers"), row=row, score=0.0) is None
    assert sql_error_boundary(prompt=None, completion="no sql here", row=row, score=0.0) is None


def test_a_bare_values_query_scores_0(dbs):
    """``VALUES ('a')`` is a read-only query in SQLite (it returns one row): the three SQL rewards score it as such
    (it was refused as "only queries are allowed, found VALUES"); what writes is still refused."""
    from trl_mrtpo.kits.sql_sandbox import check_single_query

    assert check_single_query("VALUES ('a'), ('b');") == (True, None)
    assert check_single_query("INSERT INTO customers VALUES (9, 'x', 'y')")[0] is False
    shop = dbs["shop"]
    completions = [fenced("VALUES ('Lisbon')"), fenced("VALUES (1, 2)")]
    assert sql_executable_reward(completions, db_path=[shop] * 2) == [1, 1]
    assert sql_execution_reward(completions, db_path=[shop] * 2, query=["SELECT 'Lisbon'"] * 2) == [1, 0]
    assert list(run_query(shop, "VALUES ('a')").rows) == [("a",)]
