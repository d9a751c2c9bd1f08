"""`areal-kit train PRESET [key=value ...]`: validate, plan, run (with recover relaunches).

    areal-kit train tiny
    areal-kit train 1.5B_n4 --dry-run ppo.gen.max_new_tokens=8192
    areal-kit train tiny --show-args                      # a table; markdown rows in a pipe
    areal-kit train tiny --show-args --json ppo.kl_ctl=0.01

`areal-kit train PRESET --cluster NAME`, the same run on a cluster's head, is cluster/cmd.py's
train_on; cli.py gives the command both sets of options and picks one by --cluster.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer
from rich.table import Table
from rich.text import Text

from areal_kit.console import make_console
from areal_kit.errors import UserError
from areal_kit.flags import command, params
from areal_kit.options import Output
from areal_kit.train_scripts import preset_names

if TYPE_CHECKING:
    from areal_kit.config.schema import TrainConfig


@command(params(Output), own_first=True)
def train(
    preset: str = typer.Argument(..., help=f"Preset name in train_scripts/ ({', '.join(preset_names())}) or a path to a YAML "
                                           "file."),
    overrides: list[str] = typer.Argument(None, help="Config overrides key=value, e.g. actor.lr=2e-6 "
                                                     "ppo.gen.max_new_tokens=8192."),
    show_args: bool = typer.Option(False, "--show-args", help="List every option with its value and help."),
    fresh: bool = typer.Option(False, "--fresh", help="Start over instead of resuming or stopping on a mismatch: "
                                                      "the recover checkpoints are set aside (RECOVER_DIR/set-aside-"
                                                      "TIME/, the newest kept), not deleted."),
    discard: bool = typer.Option(False, "--discard", help="With --fresh: delete the run's recover checkpoints, set-"
                                                          "aside ones included, instead of setting them aside."),
    **given: bool,
) -> None:
    """Train a preset: GRPO/PPO with DeepSpeed trainers and vLLM rollout engines on Ray."""
    from areal_kit.config.loader import load_config

    dry_run, as_json = given["dry_run"], given["as_json"]  # Output's: setup, down and doctor take them too

    if as_json and not show_args:
        raise UserError("--json goes with --show-args (areal-kit train PRESET --show-args --json)")
    check_discard(fresh, discard)
    cfg = load_config(preset, overrides or [])
    if show_args:
        _show_args(preset, cfg, as_json)
        return
    console = make_console()
    from areal_kit import hardware

    plat = hardware.detect()
    if dry_run:
        from areal_kit.rl.driver.placement import check_gpu_sharing
        from areal_kit.rl.plan import check_memory, plan_lines

        check_gpu_sharing(cfg, plat)  # where the run would fail: on this machine's device
        for line in plan_lines(cfg, plat):
            console.out(line, highlight=False)
        check_memory(cfg, plat)  # after the plan, whose lines show what does not fit
        console.print("[green]dry run: configuration is valid[/green]")
        return
    from areal_kit.interrupts import stops_say_so
    from areal_kit.rl.driver.launch import launch

    if not plat.is_cpu:  # before Ray and any actor, each in one line: the dry run's memory refusal, then
        from areal_kit.rl.plan import check_memory  # a node whose CUDA does not start (CPU runs skip both)

        check_memory(cfg, plat)
        console.print(f"CUDA: {hardware.check_cuda(cfg.ray_address)}", highlight=False, markup=False, soft_wrap=True)
    with stops_say_so():
        rc = launch(cfg, fresh=fresh, discard=discard)
    raise typer.Exit(rc)


def check_discard(fresh: bool, discard: bool) -> None:
    """--discard deletes a run's progress: only beside the --fresh it qualifies, never by itself."""
    if discard and not fresh:
        raise UserError("--discard goes with --fresh (areal-kit train PRESET --fresh --discard deletes the run's "
                        "recover checkpoints; --fresh alone sets them aside)")


def _show_args(preset: str, cfg: TrainConfig, as_json: bool) -> None:
    """Every option with its value and help: a table (markdown rows in a pipe), or JSON."""
    from areal_kit.config.loader import describe_args, describe_options

    if as_json:
        # Plain print, not the console: the text must be exactly what json.dumps wrote.
        print(json.dumps(describe_options(cfg), indent=1, ensure_ascii=False))
        return
    table = Table(title=f"areal-kit train {preset}")
    table.add_column("key", no_wrap=True)  # on a narrow terminal the help wraps, the key stays whole
    table.add_column("value")
    table.add_column("help")
    for key, value, help_ in describe_args(cfg):
        table.add_row(key, Text(value), Text(help_))  # Text: a "[...]" in a value is no markup
    make_console().print(table)
