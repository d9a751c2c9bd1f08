"""Each command-line option written once (areal_kit/flags.py, areal_kit/options.py), and an option's
old spelling still accepted, with one line on stderr that names the new one."""

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from cli_run import assert_one_line_error, run_cli
from typer.testing import CliRunner

from areal_kit.flags import build, command, flag, params

PKG = Path(__file__).resolve().parents[2] / "areal_kit"
DECLARE = {"typer.Option", "flag", "many"}

# The options several commands take, and the storage's three spellings (one now, the others old names).
ONCE = ("--storage", "--mirror", "--fileroot", "--user")


def _declarations() -> dict[str, list[str]]:
    """Each long option's spelling -> where areal_kit declares it (typer.Option, flag or many)."""
    where = defaultdict(list)
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in DECLARE:
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                        where[arg.value].append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    return where


def test_each_option_is_declared_once():
    where = _declarations()
    for opt in ONCE:
        assert len(where[opt]) == 1, f"{opt} declared at {where[opt]}"
    assert "--storage_root" not in where and "--storage-root" not in where  # only as --storage's old spelling
    twice = {opt: places for opt, places in where.items() if len(places) > 1}
    assert not twice, f"options declared more than once: {twice}"


@dataclass
class _Where:
    root: str | None = flag(None, "--root", old=("--root_dir", "--root-dir"), help="Where.")


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @command(params(_Where))
    def show(**given) -> None:
        print(f"root={build(_Where, given).root}")

    return app


@pytest.mark.parametrize("argv, root, note", [
    (["--root", "/a"], "/a", ""),
    (["--root_dir", "/b"], "/b", "note: --root_dir is a deprecated alias of --root; use --root\n"),
    (["--root-dir", "/c"], "/c", "note: --root-dir is a deprecated alias of --root; use --root\n"),
    ([], "None", ""),
])
def test_an_old_spelling_fills_the_same_field_and_names_the_new_one(argv, root, note):
    res = CliRunner().invoke(_app(), argv)
    assert res.exit_code == 0, res.output
    assert res.stdout == f"root={root}\n"
    assert res.stderr == note


@dataclass
class _Shared:
    """An option two commands take, declared once without a default; each command's own class has one."""
    wait: float | None = flag(None, "--wait", help="Seconds.")


@dataclass
class _Setup:
    wait: float = 30.0


@dataclass
class _Status:
    wait: float = 10.0


@pytest.mark.parametrize("argv, setup, status", [([], 30.0, 10.0), (["--wait", "0"], 0.0, 0.0)])
def test_a_shared_option_not_given_takes_each_commands_default(argv, setup, status):
    app = typer.Typer()

    @app.command()
    @command(params(_Shared))
    def show(**given) -> None:
        print(build(_Setup, given).wait, build(_Status, given).wait)

    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 0, res.output
    assert res.stdout == f"{setup} {status}\n"


def test_an_old_spelling_beside_the_new_one_is_refused():
    res = CliRunner().invoke(_app(), ["--root", "/a", "--root_dir", "/b"])
    assert res.exit_code != 0 and "--root_dir and --root are one option: give --root alone" in str(res.exception)


def test_the_old_spelling_is_not_in_help():
    out = CliRunner().invoke(_app(), ["--help"], env={"COLUMNS": "200"}).stdout
    assert "--root " in out and "--root_dir" not in out and "--root-dir" not in out


def test_evals_storage_root_is_storage(tmp_path, fake_model, capsys, monkeypatch):
    """eval's --storage_root (its spelling before) still names the storage its sets are read from."""
    monkeypatch.delenv("AREAL_EVAL_DATA", raising=False)
    code, _, err = run_cli(["eval", "--model_path", str(fake_model), "--output_path", str(tmp_path / "o"),
                            "--storage_root", str(tmp_path / "st"), "--mirror", "http://127.0.0.1:9",
                            "--data_names", "amc23"], capsys)
    note, rest = err.split("\n", 1)
    assert note == "note: --storage_root is a deprecated alias of --storage; use --storage"
    assert_one_line_error(code, rest, "eval set amc23 is missing", f"{tmp_path}/st/datasets/eval/amc23/test.jsonl")


def test_doctor_takes_storage_with_slurm_only_in_either_spelling(capsys):
    for opt in ("--storage", "--storage-root"):
        code, _, err = run_cli(["doctor", opt, "/x"], capsys)
        lines = err.splitlines()
        assert lines[-1].startswith("error: --partition and --storage go with --slurm"), err
        assert lines[:-1] == ([] if opt == "--storage" else
                              ["note: --storage-root is a deprecated alias of --storage; use --storage"])
        assert code == 2
