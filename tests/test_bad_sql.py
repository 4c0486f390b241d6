"""Bad SQL: the sandbox child is a fresh interpreter (no torch, no trl_mrtpo, never a fork of the trainer) whose memory
is bounded, so a model-written query that builds a huge row is refused with a message and the trainer lives; a
reference result over the default cap still scores correct predictions."""

import ast
import subprocess
import sys

import pytest
import torch

from trl_mrtpo.kits import sql_sandbox_child
from trl_mrtpo.kits.sql import build_demo_databases
from trl_mrtpo.kits.sql_sandbox import _WORKER, SANDBOX_MEMORY_BYTES, run_query

# one row of 60 values of ~10 MB each (every value under SQLite's value cap): ~1.2 GB built before any result cap
WIDE_ROW = (
    "WITH RECURSIVE r(s, n) AS (SELECT 'x', 0 UNION ALL SELECT s || s, n + 1 FROM r WHERE n < 22) SELECT "
    + ", ".join(f"s || s || substr(s, 1, 1600000) || '{i}'" for i in range(60))
    + " FROM r WHERE n = 22"
)


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    return build_demo_databases(tmp_path_factory.mktemp("sql"))["shop"]


def peak_resident_bytes(pid: int) -> int:
    status = open(f"/proc/{pid}/status").read()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def test_the_sandbox_child_imports_the_standard_library_only():
    """The child module, loaded as the sandbox loads it (by path, ``python -I``), leaves neither torch nor trl_mrtpo in
    ``sys.modules``; its own imports are all standard-library modules."""
    probe = (
        "import runpy, sys; runpy.run_path(sys.argv[1], run_name='probe'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'trl_mrtpo', 'sqlglot', 'numpy')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-I", "-c", probe, sql_sandbox_child.__file__], capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout
    tree = ast.parse(open(sql_sandbox_child.__file__).read())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0
    }
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_a_wide_row_of_large_values_is_refused_within_the_sandbox_memory(shop):
    """Started from a parent that holds 4 GiB more address space (a trainer with a model), the child still bounds
    itself to 1 GiB: the row is refused by name, the child's peak resident memory stays under 1 GiB, the parent
    lives and the next query is answered."""
    held = torch.empty(4 << 30, dtype=torch.uint8)  # address space a forked child would inherit
    _WORKER._stop()  # a child started now, with the parent this large
    result = run_query(shop, WIDE_ROW, timeout_s=30.0)
    assert result.rows is None and "more than the sandbox's 1024 MiB of memory" in result.error, result.error
    peak = peak_resident_bytes(_WORKER._process.pid)
    assert peak < SANDBOX_MEMORY_BYTES, peak
    print(f"sandbox child's peak resident memory after the wide row: {peak / 2**20:.0f} MiB")
    assert run_query(shop, "SELECT count(*) FROM customers").rows == ((4,),)
    assert "torch" not in open(f"/proc/{_WORKER._process.pid}/maps").read()
    del held


# ~1.3 MB of result (1,300 rows of 1,000 characters), past the 1 MB a prediction may return without a reference
LARGE_REFERENCE = "SELECT v FROM big"
# ~70 MB of result built in the query (10,000 rows of 7 KB): past what any prediction may be compared with
HUGE_REFERENCE = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 9990) SELECT "
    + " || ".join(["printf('%.1000c', 'x')"] * 7)
    + " || x FROM c"
)


@pytest.fixture(scope="module")
def spider(tmp_path_factory):
    """A Spider-like folder: one database with a table whose full contents are 1.3 MB, and three questions: one with
    a large reference result, one with a huge one, one small."""
    import json
    import sqlite3

    root = tmp_path_factory.mktemp("spider")
    folder = root / "database" / "big"
    folder.mkdir(parents=True)
    conn = sqlite3.connect(folder / "big.sqlite")
    conn.execute("CREATE TABLE big (id INTEGER, v TEXT)")
    conn.executemany("INSERT INTO big VALUES (?, ?)", [(i, f"{i:04d}" + "y" * 996) for i in range(1300)])
    conn.commit()
    conn.close()
    examples = [
        {"db_id": "big", "question": "All values?", "query": LARGE_REFERENCE},
        {"db_id": "big", "question": "A huge result?", "query": HUGE_REFERENCE},
        {"db_id": "big", "question": "How many?", "query": "SELECT count(*) FROM big"},
    ]
    (root / "dev.json").write_text(json.dumps(examples))
    return root, str(folder / "big.sqlite")


def fenced(query):
    return [{"role": "assistant", "content": f"```sql\n{query}\n```"}]


def test_a_correct_prediction_of_a_reference_result_over_1_mb_scores_1(spider):
    from trl_mrtpo.kits.sql import sql_error_block, sql_executable_reward, sql_execution_reward

    _, db = spider
    correct = fenced("SELECT v FROM big WHERE id >= 0")
    assert sql_execution_reward([correct], db_path=[db], query=[LARGE_REFERENCE]) == [1.0]
    assert sql_executable_reward([correct], db_path=[db], query=[LARGE_REFERENCE]) == [1.0]
    row = {"db_path": db, "query": LARGE_REFERENCE}
    assert sql_error_block(prompt=[], completion=correct[0]["content"], row=row, score=1.0) is None
    # a prediction past twice its reference's size is still refused by name
    doubled = fenced("SELECT v || v || v FROM big")
    assert sql_execution_reward([doubled], db_path=[db], query=[LARGE_REFERENCE]) == [0.0]
    block = sql_error_block(prompt=[], completion=doubled[0]["content"], row=row, score=0.0)
    assert "the result holds more than" in block


def test_a_reference_over_64_mb_is_refused_by_the_loader_and_excluded_by_the_evaluation(spider):
    from trl_mrtpo.kits import get_kit
    from trl_mrtpo.scripts.evaluation import evaluate_sql

    root, _ = spider
    with pytest.raises(
        ValueError, match=r"dev.json: 1 reference query\(ies\) cannot be scored against.*example 1.*64000000 bytes"
    ):
        get_kit("sql").loaders["spider"](str(root), "dev.json")
    answers = [fenced("SELECT v FROM big ORDER BY id")[0]["content"], fenced("SELECT 1")[0]["content"]]
    result = evaluate_sql(lambda prompts: answers[: len(prompts)], str(root), "dev.json")
    assert result.count == 2 and result.metrics["excluded_references"] == 1.0
    assert result.metrics["execution_accuracy"] == 0.5  # the large reference matched, the count did not
    assert {"question": "A huge result?", "excluded": "reference result too large"} in result.details


MANY_ROWS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 12000) SELECT x FROM c"


def test_a_reference_of_12000_rows_scores_itself_1_and_feeds_no_error_block(shop):
    """12,000 integers (96 KB) pass the default 10,000-row cap: the reference's own cap is lifted for rows as for
    bytes, and a prediction's cap scales with it."""
    from trl_mrtpo.kits.sql import sql_error_block, sql_execution_reward

    same = fenced("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 12000) SELECT x FROM c")
    assert sql_execution_reward([same], db_path=[shop], query=[MANY_ROWS]) == [1.0]
    row = {"db_path": shop, "query": MANY_ROWS}
    assert sql_error_block(prompt=[], completion=same[0]["content"], row=row, score=1.0) is None


@pytest.fixture
def latin1(tmp_path):
    """A table whose text was stored as latin-1 bytes (as some BIRD databases do): 'café' and 'cafë' differ in one
    byte that is not valid UTF-8."""
    import sqlite3

    path = tmp_path / "latin1.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (id INTEGER, name TEXT)")
    for i, name in enumerate(["café", "cafë", "plain"]):
        conn.execute("INSERT INTO t VALUES (?, CAST(? AS TEXT))", (i, name.encode("latin-1")))
    conn.commit()
    conn.close()
    return str(path)


def test_text_that_is_not_utf8_is_read_and_compared_byte_for_byte(latin1):
    from trl_mrtpo.kits.sql import sql_execution_reward

    reference = "SELECT name FROM t WHERE id = 0"
    assert run_query(latin1, reference).error is None
    assert sql_execution_reward([fenced(reference)], db_path=[latin1], query=[reference]) == [1.0]
    wrong = fenced("SELECT name FROM t WHERE id = 1")  # 'cafë': another string, not a decoding collision
    assert sql_execution_reward([wrong], db_path=[latin1], query=[reference]) == [0.0]


def test_a_broken_reference_is_none_with_one_warning_and_named_by_the_loader(shop, tmp_path):
    import json
    import shutil

    from trl_mrtpo.kits import get_kit
    from trl_mrtpo.kits.sql import sql_execution_reward, unusable_references

    broken = "SELECT nme FROM customers"
    prediction = fenced("SELECT name FROM customers")
    with pytest.warns(
        UserWarning, match=r"reference query fails on .*shop.*SELECT nme FROM customers.*no such column"
    ):
        assert sql_execution_reward([prediction, prediction], db_path=[shop] * 2, query=[broken] * 2) == [None, None]
    rows = [{"db_path": shop, "query": "SELECT name FROM customers"}, {"db_path": shop, "query": broken}]
    rows.append({"db_path": shop, "query": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c "
                 "LIMIT 1000001) SELECT x FROM c"})  # fmt: skip
    reasons = unusable_references(rows)
    assert list(reasons) == [1, 2] and "no such column: nme" in reasons[1] and "1000000 rows" in reasons[2]
    root = tmp_path / "spider"
    (root / "database" / "shop").mkdir(parents=True)
    shutil.copy(shop, root / "database" / "shop" / "shop.sqlite")
    (root / "dev.json").write_text(json.dumps([{"db_id": "shop", "question": "Names?", "query": broken}]))
    with pytest.raises(ValueError, match=r"dev.json: 1 reference query\(ies\) cannot be scored against.*example 0"):
        get_kit("sql").loaders["spider"](str(root), "dev.json")


@pytest.mark.parametrize(
    "query",
    [
        "SELECT name FROM customers;",
        "SELECT name FROM customers; -- the names",
        "SELECT name FROM customers; /* the names */ ",
        "SELECT name FROM customers;;",
        "SELECT name FROM customers -- the names",
        "SELECT name\nFROM customers ;\n",
    ],
)
def test_correct_sql_with_a_final_semicolon_or_comment_scores_1_on_all_three_rewards(shop, query):
    """SQLite reads a final semicolon, and comments after it, as one statement; so do the rewards (the comment after
    `;` counted as a second statement, and the error block taught the policy away from correct SQL)."""
    from trl_mrtpo.kits.sql import (
        sql_error_block,
        sql_executable_reward,
        sql_execution_reward,
        sql_format_reward,
    )

    reference = "SELECT name FROM customers"
    completion = fenced(query)
    for reward in (sql_format_reward, sql_executable_reward, sql_execution_reward):
        assert reward([completion], db_path=[shop], query=[reference]) == [1.0], reward.__name__
    assert (
        sql_error_block(
            prompt=None, completion=completion[0]["content"], row={"db_path": shop, "query": reference}, score=1.0
        )
        is None
    )
    # a reference written that way is one statement too: it scores, and the loader keeps its row
    from trl_mrtpo.kits.sql import unusable_references

    assert sql_execution_reward([fenced(reference)], db_path=[shop], query=[query]) == [1.0]
    assert unusable_references([{"db_path": shop, "query": query}]) == {}
    assert sql_format_reward([fenced("SELECT 1; SELECT 2")]) == [0.0]  # two statements stay two


@pytest.mark.parametrize("reference", [None, "", "   "])
def test_an_empty_or_missing_reference_is_named_once_and_scored_none(shop, reference):
    from trl_mrtpo.kits.sql import sql_execution_reward, sql_reference_block, unusable_references

    prediction = fenced("SELECT name FROM customers")
    with pytest.warns(
        UserWarning, match=rf"reference query for .*shop.* is (missing|{reference!r}).*question 'Names\?'"
    ):
        scores = sql_execution_reward(
            [prediction] * 2, db_path=[shop] * 2, query=[reference] * 2, question=["Names?"] * 2
        )
    assert scores == [None, None]
    assert (
        sql_reference_block(prompt=None, completion="", row={"db_path": shop, "query": reference}, score=0.0) is None
    )
    assert unusable_references([{"db_path": shop, "query": reference}]) == {0: "no reference query"}


def test_a_reference_that_times_out_costs_its_limit_once(shop, monkeypatch):
    """Time-outs are not cached by the sandbox; a reference's outcome is kept, so the rewards and the error block
    wait for it once per run, not at every call."""
    from trl_mrtpo.kits import sql
    from trl_mrtpo.kits.sql_sandbox import QueryResult

    calls = []

    def timed_out(db, query, **limits):
        calls.append(query)
        return QueryResult(None, "the query took longer than 5 s") if "slow" in query else QueryResult(((1,),), None)

    monkeypatch.setattr(sql, "run_query", timed_out)
    slow = "SELECT 1 AS slow"
    prediction = fenced("SELECT 1")
    with pytest.warns(UserWarning, match="took longer than 5 s"):
        for _ in range(3):
            assert sql.sql_execution_reward([prediction], db_path=[shop], query=[slow]) == [None]
            sql.sql_executable_reward([prediction], db_path=[shop], query=[slow])
            sql.sql_error_block(
                prompt=None, completion=prediction[0]["content"], row={"db_path": shop, "query": slow}, score=0.0
            )
    assert calls.count(slow) == 1


def test_a_schema_with_a_latin1_byte_is_read_and_the_database_is_named_on_failure(tmp_path):
    import sqlite3

    from trl_mrtpo.kits.sql import database_schema

    path = tmp_path / "latin.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (name TEXT DEFAULT 'café')")
    conn.commit()
    conn.close()
    # the CREATE text's 'é' as one latin-1 byte, as some BIRD databases hold it (same length: the record stays valid)
    path.write_bytes(path.read_bytes().replace("'café')".encode(), b"'caf\xe9' )"))
    assert "DEFAULT 'caf\ufffd'" in database_schema(path)
    broken = tmp_path / "broken.sqlite"
    broken.write_bytes(b"not a database" * 100)
    with pytest.raises(ValueError, match=f"Cannot read the schema of {broken}"):
        database_schema(broken)
