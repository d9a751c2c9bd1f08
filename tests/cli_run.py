"""Run the CLI in-process for tests: `dry_run(argv, capsys)` -> what it printed, after checking it
exited 0 with no traceback."""

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
