"""`areal-kit train PRESET [key=value ...]`: validate, plan, run (with recover relaunches).

    areal-kit train tiny
    areal-kit train 1.5B_n4 --dry-run ppo.gen.max_new_tokens=8192
    areal-kit train tiny --show-args
"""

from __future__ import annotations

import typer


def train(
    preset: str = typer.Argument(..., help="Preset name in train_scripts/ (tiny, 1.5B_n1, 1.5B_n4, 1.5B_n16, "
                                           "7B_n4, 7B_n16) or a path to a YAML file."),
    overrides: list[str] = typer.Argument(None, help="Config overrides key=value, e.g. actor.lr=2e-6 "
                                                     "ppo.gen.max_new_tokens=8192."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate everything checkable without GPUs and "
                                                          "print the plan; start nothing."),
    show_args: bool = typer.Option(False, "--show-args", help="List every option with its value and help."),
    fresh: bool = typer.Option(False, "--fresh", help="Ignore (and replace) an existing recover checkpoint "
                                                      "instead of resuming or stopping on a mismatch."),
) -> None:
    """Train a preset: GRPO/PPO with DeepSpeed trainers and vLLM rollout engines on Ray."""
    from rich.console import Console
    from rich.table import Table

    from areal_kit.config.loader import describe_args, load_config

    cfg = load_config(preset, overrides or [])
    console = Console()
    if show_args:
        table = Table("key", "value", "help", title=f"areal-kit train {preset}", show_lines=False)
        for key, value, help_ in describe_args(cfg):
            table.add_row(key, value, help_)
        console.print(table)
        return
    if dry_run:
        from areal_kit import hardware
        from areal_kit.rl.plan import plan_lines
        from areal_kit.rl.workers.placement import check_gpu_sharing

        check_gpu_sharing(cfg, hardware.detect())  # where the run would fail: on this machine's device
        for line in plan_lines(cfg):
            console.print(line, highlight=False, soft_wrap=True)
        console.print("[green]dry run: configuration is valid[/green]")
        return
    from areal_kit.errors import stops_say_so
    from areal_kit.rl.launch import launch

    with stops_say_so():
        rc = launch(cfg, fresh=fresh)
    raise typer.Exit(rc)
