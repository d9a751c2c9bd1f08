"""A run's curves per global step, drawn from its metrics.jsonl rows: a PNG of the panels users
watch (matplotlib; `areal-kit plot RUN`) and one curve as terminal text (plotext; `areal-kit logs
RUN --plot`). The reading of the run's files is monitor.py's.
"""

from __future__ import annotations

import os

from areal_kit.errors import UserError


def terminal_plot(rows: list[dict], key: str = "task_reward", width: int = 80, color: bool = False) -> str:
    """The curve of `key` over global steps as terminal text (plotext; its 5.x and 6.x APIs differ),
    with ANSI colour codes if color (plotext 5.x may add them anyway: print it with Text.from_ansi)."""
    import plotext as plt

    pts = [(r["global_step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    if not pts:
        return f"(no {key} values yet)"
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    width, height, title = min(100, max(40, width)), 18, f"{key} per global step"
    if hasattr(plt, "build"):  # plotext 5.x: module-level state
        plt.clear_figure()
        plt.plot(xs, ys, marker="braille")
        plt.title(title)
        plt.xlabel("global step")
        plt.plotsize(width, height)
        return plt.build()
    fig = plt.figure  # plotext 6.x: an explicit figure object
    fig.clear.all()
    fig.plot_size(width, height)
    fig.title(title)
    fig.label("global step", axis="x")
    fig.draw(fig.signal(xs, ys, marker="braille").lines())
    return fig.build().string(colorless=not color)


PANELS = (("task_reward", "task reward"), ("avg_seq_len", "response length (tokens)"),
          ("ppo_approx_kl", "approx. KL (ppo_approx_kl)"), ("entropy", "entropy (nats/token)"))


def extra_panels(rows: list[dict]) -> list[tuple[str, str, list[str]]]:
    """Panels of what this run logged besides PANELS: (title, y label, keys), one line per key.
    Each dataset.mix source's task reward; the in-training eval (greedy pass@1, avg@k, pass@k); the
    share of episodes that call a tool (a multi-turn workflow's or an agent's episodes)."""
    keys = sorted({k for r in rows for k in r})
    out = []
    sources = [k for k in keys if k.startswith("task_reward/")]
    if sources:
        out.append(("task reward per source (dataset.mix)", "task reward", sources))
    evals = [k for k in keys if k == "eval/pass@1" or k.startswith(("eval/avg@", "eval/pass@"))]
    if evals:
        out.append(("in-training eval (held-out split)", "accuracy", sorted(evals, key=len)))
    if "episode/tool_call_share" in keys:
        out.append(("episodes that call a tool (episode/tool_call_share)", "share of episodes",
                    ["episode/tool_call_share"]))
    return out


def write_png(rows: list[dict], out: str, title: str = "", smooth: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    extra = extra_panels(rows)
    n_rows = 2 + (len(extra) + 1) // 2
    fig, axes = plt.subplots(n_rows, 2, figsize=(11, 3.5 * n_rows), sharex=True)
    panels = [(label, [key], True) for key, label in PANELS] + [(t, keys, False) for t, _, keys in extra]
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (label, keys, single) in zip(axes.flat, panels):
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        drawn = False
        for key in keys:
            pts = [(r["global_step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if not pts:
                continue
            drawn = True
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            name = None if single else key.split("/", 1)[1]
            ax.plot(xs, ys, lw=1, alpha=0.5 if smooth > 1 and single else 1.0,
                    marker="." if len(xs) < 50 else None, label=name)
            if single and smooth > 1 and len(ys) >= smooth:
                avg = [sum(ys[i - smooth + 1:i + 1]) / smooth for i in range(smooth - 1, len(ys))]
                ax.plot(xs[smooth - 1:], avg, lw=2, label=f"mean of {smooth}")
            if ax.get_legend_handles_labels()[1]:
                ax.legend(fontsize=8)
        if not drawn:
            ax.text(0.5, 0.5, f"{keys[0]} not logged", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[-1]:
        ax.set_xlabel("global step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise UserError(f"cannot write {out} ({e.strerror or e}); expected a writable path for -o") from None
    finally:
        plt.close(fig)
