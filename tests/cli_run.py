"""Run the CLI in-process for tests: `dry_run(argv, capsys)` -> what it printed, after checking it
exited 0 with no traceback; `run_cli(argv, capsys)` -> (exit code, stdout, stderr) of a command that
exits; `cli(capsys, *args)` -> the same for a command that may return instead;
`assert_one_line_error(code, err, *needles)` -> the bad-input contract (exit 2, one line)."""

import pytest

from areal_kit.cli import main


def dry_run(argv, capsys) -> str:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Traceback" not in out.out + out.err
    return out.out


def run_cli(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def cli(capsys, *args) -> tuple[int, str, str]:
    try:
        code = main(list(args)) or 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code, err, *needles) -> None:
    """Exit code 2 and one line `error: ...` holding every needle."""
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], lines[0]
