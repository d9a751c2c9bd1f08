"""The `areal-kit` command line: setup, train, eval, grade, status, down, doctor, logs, plot, view.

Each subcommand lives next to the code it drives (cluster/cmd.py, rl/cmd.py, eval/cmd.py,
monitor.py); this module only assembles them and turns bad input into one line and exit 2.
Command modules import heavy libraries (torch, ray, vllm) inside the command, never at the
top, so `areal-kit --help` stays instant.

    areal-kit --help
    areal-kit train tiny
"""

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import click
import typer

from areal_kit.errors import ExitCode, RunFailed, UserError, refuse
from areal_kit.interrupts import Interrupted

# typer >= 0.2x vendors click as typer._click and raises its exceptions (and typer.Exit/Abort),
# older typer raises click's own: catch both, or a usage error escapes as a traceback.
_vendored: types.ModuleType
try:
    from typer._click import exceptions as _vendored
except ImportError:  # pragma: no cover - older typer
    _vendored = click.exceptions
_USAGE_ERRORS = (click.exceptions.UsageError, _vendored.UsageError)
_NO_ARGS_HELP = tuple(m.NoArgsIsHelpError for m in (click.exceptions, _vendored) if hasattr(m, "NoArgsIsHelpError"))
_ABORTS = (click.exceptions.Abort, typer.Abort)
_EXITS = (click.exceptions.Exit, typer.Exit)

app = typer.Typer(
    name="areal-kit",
    help="Bare GPU nodes to a running, resumable RL experiment on reasoning LLMs, and an eval table.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _train() -> Callable[..., object]:
    """`areal-kit train`: rl/cmd.py's command (here), with cluster/cmd.py's options for a run on a
    cluster's head (train_on, given --cluster) and slurm/'s for a job (given --slurm): rl, cluster
    and slurm never import each other."""
    from areal_kit.cluster import cmd as cluster_cmd
    from areal_kit.flags import build, command, params
    from areal_kit.rl import cmd as rl_cmd
    from areal_kit.slurm.options import SlurmOptions

    here = inspect.signature(rl_cmd.train, eval_str=True).parameters

    @command(list(here.values()), *cluster_cmd.TRAIN_ON, params(SlurmOptions))
    def train(**given: Any) -> object:
        where = build(cluster_cmd.OnCluster, given)
        slurm = build(SlurmOptions, given)
        rl_cmd.check_discard(given["fresh"], given["discard"])
        if slurm.slurm and not given["show_args"]:
            if where.cluster is not None:
                raise UserError("--slurm and --cluster: pick one (Slurm submits from a login node, --cluster runs on "
                                "the head of a cluster setup made)")
            from areal_kit.slurm import cmd as slurm_cmd

            return slurm_cmd.submit(given["preset"], given["overrides"] or [], slurm, dry_run=given["dry_run"],
                                    fresh=given["fresh"], discard=given["discard"])
        slurm.check()  # a Slurm option without --slurm
        if where.cluster is None or given["show_args"]:
            if where.train_wait is not None:
                raise UserError("--train-wait goes with --cluster (areal-kit train PRESET --cluster NAME --train-wait S)")
            return rl_cmd.train(**{name: given[name] for name in here})
        if given["as_json"]:
            raise UserError("--json goes with --show-args (areal-kit train PRESET --show-args --json)")
        return cluster_cmd.train_on(given["preset"], given["overrides"] or [], fresh=given["fresh"],
                                    discard=given["discard"], dry_run=given["dry_run"], given=given)

    train.__doc__ = rl_cmd.train.__doc__
    return train


def _status() -> Callable[..., int]:
    """`areal-kit status`: cluster/cmd.py's, or with --slurm slurm/cmd.py's list of jobs."""
    from areal_kit.cluster import cmd as cluster_cmd
    from areal_kit.flags import command, params
    from areal_kit.slurm.options import SlurmOptions

    @command(list(inspect.signature(cluster_cmd.status).parameters.values()), params(SlurmOptions, "slurm"))
    def status(**given: Any) -> int:
        if given.pop("slurm"):
            from areal_kit.slurm import cmd as slurm_cmd

            return slurm_cmd.status()
        return cluster_cmd.status(**given)

    status.__doc__ = f"{cluster_cmd.status.__doc__} With --slurm: areal-kit's Slurm jobs."
    return status


def _doctor() -> Callable[..., int]:
    """`areal-kit doctor`: cluster/cmd.py's, or with --slurm slurm/cmd.py's checks of a partition."""
    from areal_kit.cluster import cmd as cluster_cmd
    from areal_kit.flags import command, params
    from areal_kit.options import Storage
    from areal_kit.slurm.options import SlurmOptions

    @command(list(inspect.signature(cluster_cmd.doctor).parameters.values()), params(SlurmOptions, "partition"),
             params(Storage), params(SlurmOptions, "slurm"))
    def doctor(**given: Any) -> int:
        slurm = given.pop("slurm")
        storage = given.pop("storage")  # with --slurm: a folder every node must share (runs write logs and checkpoints there)
        if slurm:
            from areal_kit.slurm import cmd as slurm_cmd

            return slurm_cmd.doctor(given["partition"], storage or ".", given["python"], given["preset"],
                                    given["as_json"])
        if given["partition"] or storage is not None:
            raise UserError("--partition and --storage go with --slurm (areal-kit doctor --slurm --partition P)")
        return cluster_cmd.doctor(**{k: v for k, v in given.items() if k != "partition"})

    doctor.__doc__ = cluster_cmd.doctor.__doc__
    return doctor


def _view() -> Callable[..., None]:
    """`areal-kit view`: view/cmd.py's page, of the run monitor.py finds (as `logs` does): view
    never imports monitor, a command of its own."""
    from areal_kit import monitor
    from areal_kit.cluster.cmd import OnCluster
    from areal_kit.flags import build, command, params
    from areal_kit.view import cmd as view_cmd

    @command(list(inspect.signature(view_cmd.view_options).parameters.values()), params(monitor.RunRoot),
             params(OnCluster, "cluster"), own_first=True)
    def view(**given: Any) -> None:
        root = build(monitor.RunRoot, given)
        if given["cluster"]:
            from areal_kit.cluster.options import ConnectOptions
            from areal_kit.cluster.view_on import view_on

            probe = view_cmd.listen(given["host"], given["port"])  # a port in use: one line before any host
            port = probe.getsockname()[1]
            probe.close()
            view_on(given["cluster"], given["run"], root.user, root.fileroot, given["host"], port,
                    ConnectOptions(ssh_wait=10.0))
            return
        files = (monitor.resolve_run(given["run"], root.fileroot, root.user) if given["run"]
                 else monitor.latest_run(root.fileroot, root.user))
        view_cmd.serve(files, files.name, given["host"], given["port"],
                       summary=lambda: monitor.summary_lines(monitor.read_status(files, tail=0)))

    view.__doc__ = view_cmd.view_options.__doc__
    return view


def _register() -> None:
    from areal_kit import monitor
    from areal_kit.cluster import cmd as cluster_cmd
    from areal_kit.eval import cmd as eval_cmd

    app.command("setup")(cluster_cmd.setup)
    app.command("train", context_settings={"allow_extra_args": False})(_train())
    app.command("eval")(eval_cmd.eval_)
    app.command("filter")(eval_cmd.filter_)
    app.command("grade")(eval_cmd.grade)
    app.command("status")(_status())
    app.command("down")(cluster_cmd.down)
    app.command("doctor")(_doctor())
    app.command("logs")(monitor.logs)
    app.command("plot")(monitor.plot)
    app.command("view")(_view())


_register()


def main(argv: list[str] | None = None) -> None:
    try:
        rc = app(args=argv, prog_name="areal-kit", standalone_mode=False)
    except (UserError, RunFailed) as e:
        refuse(str(e), e.exit_code)
    except _NO_ARGS_HELP as e:  # `areal-kit` alone: the help (typer has printed it already)
        if e.format_message().strip():
            print(e.format_message(), file=sys.stderr)
        raise SystemExit(ExitCode.BAD_INPUT)
    except _USAGE_ERRORS as e:
        sub = e.ctx.command_path.split(" ", 1)[1:] if e.ctx else []  # drop the program name
        hint = f" (see: {' '.join(['areal-kit', *sub, '--help'])})" if e.ctx else ""
        refuse(" ".join(e.format_message().split()) + hint)
    except Interrupted as e:
        print(e, file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except _ABORTS:
        print("aborted", file=sys.stderr)
        raise SystemExit(ExitCode.INTERRUPTED)
    except _EXITS as e:
        raise SystemExit(e.exit_code)
    if isinstance(rc, int) and rc:
        raise SystemExit(rc)


if __name__ == "__main__":
    main()
