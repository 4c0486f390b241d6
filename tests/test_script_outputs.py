"""The package's scripts write only what they own: an output folder is new or empty (or holds only the script's own
files), a file there that trl-mrtpo did not write is refused before anything loads, naming it, unless --overwrite is
given, and even then nothing of another's is removed or resumed from. The sweep at the end lists every call in the
package and its benchmarks that removes or replaces a file, each with what makes the file its own."""

import ast
import hashlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its content's hash."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file()
    }


def users_folder(tmp_path: Path) -> Path:
    """A folder holding a user's files where the warm start once wrote its own: README.md, run/ with a checkpoint."""
    folder = tmp_path / "adapter"
    (folder / "run" / "checkpoint-10").mkdir(parents=True)
    (folder / "run" / "checkpoint-10" / "trainer_state.json").write_text('{"global_step": 10}')
    (folder / "README.md").write_text("# my notes\n")
    return folder


def refused(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err


def test_the_warm_start_refuses_a_folder_it_did_not_write_naming_what_is_there(tmp_path, capsys):
    from trl_mrtpo.scripts.agent_warm_start import main

    folder = users_folder(tmp_path)
    before = snapshot(folder)
    message = refused(capsys, main, ["--output", str(folder)])
    assert "README.md, run, which this script did not write" in message and "--overwrite" in message
    assert snapshot(folder) == before


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--epochs", "0"], "--epochs must be > 0, got 0.0: the adapter would be written untrained"),
        (["--demonstrations", "-3"], "--demonstrations must be an integer >= 1, got -3"),
    ],
)
def test_the_warm_start_refuses_arguments_that_train_nothing(tmp_path, capsys, flags, message):
    from trl_mrtpo.scripts.agent_warm_start import main

    assert message in refused(capsys, main, ["--output", str(tmp_path / "new"), *flags])
    assert not (tmp_path / "new").exists()


def test_the_warm_start_resumes_only_from_its_own_marked_folder(tmp_path):
    from trl_mrtpo.outputs import OutputRefused
    from trl_mrtpo.scripts.agent_warm_start import WORK, WORK_MARKER, work_folder

    arguments = {"demonstrations": 2, "epochs": 1.0, "seed": 0}
    foreign = tmp_path / "foreign"
    (foreign / WORK / "checkpoint-10").mkdir(parents=True)
    with pytest.raises(OutputRefused, match=f"{WORK} exists but was not made by this script"):
        work_folder(foreign, arguments, overwrite=True)  # --overwrite writes beside others' files, never uses them
    assert (foreign / WORK / "checkpoint-10").is_dir()
    own = tmp_path / "own"
    work = work_folder(own, arguments, overwrite=False)
    (work / "checkpoint-10").mkdir()
    assert work_folder(own, arguments, overwrite=False) == work and (work / "checkpoint-10").is_dir()  # resumed
    assert not (work_folder(own, {**arguments, "seed": 1}, overwrite=False) / "checkpoint-10").exists()
    assert json.loads((work / WORK_MARKER).read_text())["seed"] == 1


@pytest.mark.parametrize("command", ["inspect", "eval"])
def test_inspect_and_eval_refuse_to_replace_a_users_file(tmp_path, capsys, command):
    from trl_mrtpo.scripts.cli import main

    mine = tmp_path / ("page.html" if command == "inspect" else "results.json")
    mine.write_text("<html>my page</html>" if command == "inspect" else '{"mine": 1}')
    message = refused(capsys, main, [command, "--output", str(mine)])
    assert f"{mine} exists and was not written by trl-mrtpo" in message
    assert mine.read_text() in ("<html>my page</html>", '{"mine": 1}')


def test_the_package_knows_its_own_pages_reports_and_results(tmp_path):
    from tests.helpers import CharTokenizer, record_for
    from trl_mrtpo.observability.viz import credit_heatmap_html
    from trl_mrtpo.outputs import OutputRefused, page_is_ours, writable_file
    from trl_mrtpo.scripts.evaluation import results_are_ours
    from trl_mrtpo.scripts.inspection import report_is_ours, write_report

    page = tmp_path / "credit.html"
    page.write_text(credit_heatmap_html(record_for("hi", [0.2, 0.8], [0.5, 0.5]), CharTokenizer(), ["a", "b", "c"]))
    report = tmp_path / "report.csv"
    write_report([], str(report))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"model": "m", "adapter": None, "limit": 1, "results": []}))
    for path, ours in ((page, page_is_ours), (report, report_is_ours), (results, results_are_ours)):
        writable_file(path, False, ours)  # a rerun replaces its own file
        other = tmp_path / f"other{path.suffix}"
        other.write_text("a user's\n")
        with pytest.raises(OutputRefused, match="was not written by trl-mrtpo"):
            writable_file(other, False, ours)
        writable_file(other, True, ours)


@pytest.mark.parametrize("compare", [False, True])
def test_the_demo_refuses_a_folder_that_is_not_new_or_empty(tmp_path, capsys, compare):
    from trl_mrtpo.scripts.cli import main

    folder = users_folder(tmp_path)
    before = snapshot(folder)
    message = refused(capsys, main, ["demo", "--output-dir", str(folder), *(["--compare"] if compare else [])])
    assert "README.md, run, which this script did not write" in message
    assert snapshot(folder) == before


# Every call in the package and its benchmarks that removes or replaces a file, and why the file is its own:
# (module, function) -> what it removes or replaces. A new call fails the sweep until it is listed here.
OWNED_REMOVALS = {
    ("trl_mrtpo/scripts/agent_warm_start.py", "work_folder"): "its own .warm-start folder, marked for other arguments",
    ("trl_mrtpo/scripts/agent_warm_start.py", "train_adapter"): "the adapter files it saved, moved out of its folder",
    ("trl_mrtpo/outputs.py", "build_folder"): "its own unique temporary folder, renamed into place",
    ("trl_mrtpo/outputs.py", "write_output"): "its own unique temporary file, renamed onto a path the script owns",
    ("trl_mrtpo/kits/sql.py", "build_demo_databases"): "its own .partial database, renamed when complete",
    ("trl_mrtpo/gym/grid.py", "run_all"): "its own .json.tmp result, renamed when complete",
    ("benchmarks/agent_gym.py", "stored"): "its own .partial result, renamed when complete",
    ("benchmarks/if_transfer.py", "compute"): "the tokenizer files its own save_model wrote beside the adapter",
}
REMOVING = {"rmtree", "unlink", "rmdir", "rename", "move"}


def removals(path: Path):
    """``(function, line)`` of every call in ``path`` that removes or replaces a file, by its innermost function:
    ``shutil.rmtree``, ``os.remove``, ``Path.unlink`` and the like, and ``replace`` with one argument (``os.replace``,
    ``Path.replace``; ``str.replace`` takes two, ``dataclasses.replace`` is not a file's)."""
    found = []

    class Calls(ast.NodeVisitor):
        def __init__(self):
            self.functions = []

        def visit_FunctionDef(self, node):
            self.functions.append(node.name)
            self.generic_visit(node)
            self.functions.pop()

        def visit_Call(self, node):
            if isinstance(node.func, ast.Attribute) and self.functions:
                name = node.func.attr
                module = node.func.value.id if isinstance(node.func.value, ast.Name) else None
                if (
                    name in REMOVING
                    or (name == "remove" and module == "os")
                    or (name == "replace" and (module == "os" or (len(node.args) == 1 and module != "dataclasses")))
                ):
                    found.append((self.functions[-1], node.lineno))
            self.generic_visit(node)

    Calls().visit(ast.parse(path.read_text()))
    return found


def test_every_removal_in_the_package_is_of_a_file_it_wrote():
    seen = set()
    for path in [*sorted((ROOT / "trl_mrtpo").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]:
        relative = str(path.relative_to(ROOT))
        for function, line in removals(path):
            assert (relative, function) in OWNED_REMOVALS, (
                f"{relative}:{line} ({function}) removes or replaces a file: list it in OWNED_REMOVALS with what "
                "makes the file its own, or write only what the script owns"
            )
            seen.add((relative, function))
    assert seen == set(OWNED_REMOVALS)  # no stale entry


def test_the_sweep_finds_a_planted_removal(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import shutil\n\ndef save(output):\n    shutil.rmtree(output / 'run')\n    'x'.replace('a', 'b')\n"
    )
    assert removals(planted) == [("save", 4)]


BUILD_AT_ONCE = """
import importlib.util, os, sys, time
from pathlib import Path

spec = importlib.util.spec_from_file_location("outputs", sys.argv[1])  # the module alone, without the package
outputs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(outputs)

def build(folder):
    time.sleep(0.3)
    (folder / "weights").write_text(str(os.getpid()))

target = Path(sys.argv[2])
built = outputs.build_folder(target, build, lambda folder: (folder / "weights").is_file())
print(built, (target / "weights").read_text())
"""


def test_two_processes_building_one_folder_at_once_both_get_the_finished_one(tmp_path):
    """The first rename wins; the later builder drops its own copy, never the finished folder (before, both built in
    one .partial path and the later one removed the folder the earlier had returned)."""
    import subprocess
    import sys

    target = tmp_path / "cache" / "model-abc"
    command = [sys.executable, "-c", BUILD_AT_ONCE, str(ROOT / "trl_mrtpo" / "outputs.py"), str(target)]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=60) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err for _, err in outputs]
    lines = {out.strip() for out, _ in outputs}
    assert len(lines) == 1  # both returned the same folder holding the same (the winner's) weights
    assert sorted(p.name for p in target.parent.iterdir()) == ["model-abc"]  # no temporary folder left


def test_a_folder_in_the_way_that_is_not_a_finished_build_is_refused_not_removed(tmp_path):
    from trl_mrtpo.outputs import OutputRefused, build_folder

    target = tmp_path / "model"
    (target / "notes").mkdir(parents=True)
    with pytest.raises(OutputRefused, match="exists but is not a finished build"):
        build_folder(
            target, lambda folder: (folder / "weights").write_text("w"), lambda built: (built / "weights").exists()
        )
    assert (target / "notes").is_dir() and [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.mark.slow
def test_embedded_agent_is_named_by_its_warm_start_and_built_by_two_processes_at_once(tmp_path):
    """Two real processes build ``embedded-agent`` on first use, as accelerate launch does: both load the one
    folder, whose name and local_model.txt carry the warm start's hash; an adapter whose base names another warm start
    is refused, naming both hashes."""
    import os
    import subprocess
    import sys

    from trl_mrtpo.scripts.embedded import EMBEDDED_MODEL_NAME, embedded_model_path, warm_start_hash
    from trl_mrtpo.scripts.policy import check_warm_start

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / EMBEDDED_MODEL_NAME).symlink_to(embedded_model_path())  # converted once, not again here
    env = {**os.environ, "TRL_MRTPO_CACHE": str(cache), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-c",
        "from trl_mrtpo.scripts.embedded import local_model; print(local_model('embedded-agent'))",
    ]
    runs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)
    ]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-3000:] for _, err in outputs]
    stamp = warm_start_hash()
    folder = cache / f"{EMBEDDED_MODEL_NAME}-agent-{stamp}"
    assert {out.strip().splitlines()[-1] for out, _ in outputs} == {str(folder)}
    assert (folder / "local_model.txt").read_text() == f"embedded-agent@{stamp}"
    assert sorted(p.name for p in cache.iterdir()) == sorted([EMBEDDED_MODEL_NAME, folder.name])
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    other = f"/somewhere/{EMBEDDED_MODEL_NAME}-agent-0123456789ab"
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": other}))
    with pytest.raises(ValueError, match=f"warm start 0123456789ab; --model loads the warm start {stamp}"):
        check_warm_start(str(folder), str(adapter))
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(folder)}))
    check_warm_start(str(folder), str(adapter))


def test_a_card_naming_another_warm_start_is_refused_naming_both(monkeypatch):
    from trl_mrtpo.scripts import embedded

    monkeypatch.setattr(embedded, "warm_start_hash", lambda: "aaaaaaaaaaaa")
    with pytest.raises(ValueError, match="warm start bbbbbbbbbbbb; this trl-mrtpo ships the warm start aaaaaaaaaaaa"):
        embedded.local_model("embedded-agent@bbbbbbbbbbbb")


@pytest.mark.slow
def test_the_warm_start_writes_only_its_own_files_beside_a_users(tmp_path):
    """A real run (2 demonstrations, a few steps) into a folder holding a user's README.md and run/, with
    --overwrite: the adapter and provenance are written, the user's files are as they were, the script's own folder
    is gone, and provenance.json records the arguments that ran."""
    from trl_mrtpo.scripts.agent_warm_start import WORK, main

    folder = users_folder(tmp_path)
    before = snapshot(folder)
    main(["--output", str(folder), "--demonstrations", "2", "--epochs", "1", "--seed", "3", "--overwrite"])
    after = snapshot(folder)
    assert {name: after[name] for name in before} == before
    assert {"adapter_config.json", "adapter_model.safetensors", "provenance.json"} <= set(after)
    assert not (folder / WORK).exists()
    provenance = json.loads((folder / "provenance.json").read_text())
    assert provenance["arguments"] == {"demonstrations": 2, "epochs": 1.0, "seed": 3}
    assert provenance["command"].endswith(
        f"python -m trl_mrtpo.scripts.agent_warm_start --output {folder} --demonstrations 2 --epochs 1 --seed 3 "
        "--overwrite"
    )


def provenance_folder(tmp_path: Path, name: str, provenance: str | None, adapter: bool = True) -> Path:
    """An output folder holding a LoRA adapter as PEFT writes it, and ``provenance`` as provenance.json."""
    folder = tmp_path / name
    folder.mkdir()
    if adapter:
        (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 16}')
        (folder / "adapter_model.safetensors").write_bytes(b"my weights")
    if provenance is not None:
        (folder / "provenance.json").write_text(provenance)
    return folder


ARGUMENTS = {"demonstrations": 2, "epochs": 1.0, "seed": 0}


def test_a_provenance_link_in_the_output_folder_is_written_through(tmp_path):
    """A provenance.json that is a link: refused naming it, with or without --overwrite, and the file it points to,
    in another folder, stays as it was."""
    from trl_mrtpo.outputs import OutputRefused, write_output
    from trl_mrtpo.scripts.agent_warm_start import PROVENANCE_KEYS, work_folder

    elsewhere = tmp_path / "elsewhere" / "notes.json"
    elsewhere.parent.mkdir()
    elsewhere.write_text(json.dumps(dict.fromkeys(PROVENANCE_KEYS, 1)))  # even one that reads as the script's
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "provenance.json").symlink_to(elsewhere)
    with pytest.raises(OutputRefused, match="provenance.json, which this script did not write"):
        work_folder(folder, ARGUMENTS, overwrite=False)  # what the command checks before anything loads
    before = elsewhere.read_text()
    write_output(folder / "provenance.json", "{}")  # what --overwrite writes: the link is replaced, not followed
    assert elsewhere.read_text() == before and not (folder / "provenance.json").is_symlink()


@pytest.mark.parametrize("provenance", [None, '{"command": "mine"}'], ids=["adapter alone", "its own provenance"])
def test_a_users_own_adapter_or_provenance_is_overwritten_without_a_word(tmp_path, provenance):
    """Ownership by content, not by file name: a user's LoRA adapter (PEFT's two files), alone or with a
    provenance.json the script did not write, is refused; the script's own (every provenance key it writes) is not."""
    from trl_mrtpo.outputs import OutputRefused
    from trl_mrtpo.scripts.agent_warm_start import PROVENANCE_KEYS, work_folder, written_here

    folder = provenance_folder(tmp_path, "users", provenance)
    before = snapshot(folder)
    with pytest.raises(OutputRefused, match="adapter_config.json, adapter_model.safetensors"):
        work_folder(folder, ARGUMENTS, overwrite=False)
    assert snapshot(folder) == before
    own = provenance_folder(tmp_path, "own", json.dumps(dict.fromkeys(PROVENANCE_KEYS, 1)))
    assert all(written_here(entry) for entry in own.iterdir())


@pytest.mark.parametrize("kind", ["a link", "not JSON"])
def test_a_warm_start_work_folder_that_is_a_link_is_trained_into(tmp_path, kind):
    """A .warm-start that is a link to another folder (it was trained into, then the run failed removing it), or
    whose marker is not JSON (a bare JSONDecodeError): refused naming it, before anything loads."""
    from trl_mrtpo.outputs import OutputRefused
    from trl_mrtpo.scripts.agent_warm_start import WORK, WORK_MARKER, work_folder

    arguments = {"demonstrations": 2, "epochs": 1.0, "seed": 0}
    output, other = tmp_path / "output", tmp_path / "other"
    other.mkdir()
    (other / WORK_MARKER).write_text(json.dumps(arguments, sort_keys=True))
    output.mkdir()
    if kind == "a link":
        (output / WORK).symlink_to(other, target_is_directory=True)
    else:
        (output / WORK).mkdir()
        (output / WORK / WORK_MARKER).write_text("not json {")
    with pytest.raises(OutputRefused, match=rf"{WORK} (is a symbolic link|exists but was not made by this script)"):
        work_folder(output, arguments, overwrite=True)
    assert sorted(p.name for p in other.iterdir()) == [WORK_MARKER]


def test_inspect_output_on_a_named_pipe_blocks_forever(tmp_path, capsys):
    """The ownership check opened it for reading; a pipe, like a link, is refused naming it, before anything loads."""
    import os

    from tests.helpers import time_limit
    from trl_mrtpo.scripts.cli import main

    pipe = tmp_path / "page.html"
    os.mkfifo(pipe)
    with time_limit(10):
        message = refused(capsys, main, ["inspect", "--output", str(pipe)])
    assert f"{pipe} is a named pipe" in message


def test_inspect_output_equal_to_report_writes_the_page_then_the_csv_over_it(tmp_path, capsys):
    from trl_mrtpo.scripts.cli import main

    same = tmp_path / "credit.html"
    message = refused(capsys, main, ["inspect", "--output", str(same), "--report", str(same)])
    assert "--output and --report name one file" in message and not same.exists()


@pytest.mark.parametrize(
    "argv, planted",
    [
        (["inspect", "--output"], "a link"),
        (["eval", "--output"], "a link"),
        (["demo", "--output-dir"], "a link"),
        (["demo", "--output-dir"], "a user's adapter"),
    ],
    ids=["inspect link", "eval link", "demo link", "demo adapter"],
)
def test_no_script_writes_through_a_link_or_over_a_users_adapter(tmp_path, capsys, argv, planted):
    """Each script's output, planted with a link to the user's own file or folder, or with a user's LoRA adapter:
    refused naming it, before anything loads, and nothing of the user's changes."""
    from trl_mrtpo.scripts.cli import main

    users = provenance_folder(tmp_path, "users", None)
    before = snapshot(users)
    output = users
    if planted == "a link":
        output = tmp_path / "out"
        output.symlink_to(users if argv[0] == "demo" else users / "adapter_config.json")
    message = refused(capsys, main, [*argv, str(output)])
    assert ("is a symbolic link" if planted == "a link" else "adapter_config.json, adapter_model.safetensors") in (
        message
    )
    assert snapshot(users) == before
