"""What a simulation run shows: a summary table (rich) and a PNG of GPU utilization, queue length and node
count over time (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from azulite.cluster.pools import Pool
from azulite.cluster.sim import Result


def _dur(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def summary_table(result: Result, pools: list[Pool], title: str = "Simulation") -> Table:
    t = Table(title=title, title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    cost = "unknown (a pool's price has no source)" if result.cost_usd is None else f"${result.cost_usd:,.2f}"
    rows = [
        ("jobs finished", f"{result.finished:,} / {result.jobs:,}"),
        ("makespan", _dur(result.makespan_s)),
        ("cost", cost),
        ("GPU utilization", f"{result.gpu_utilization:.1%}"),
        ("queueing delay p50 / p99", f"{_dur(result.queue_p50_s)} / {_dur(result.queue_p99_s)}"),
        ("lost work (evictions, preemptions)", f"{result.lost_gpu_hours:,.1f} GPU-h"),
        ("spot evictions / preemptions", f"{result.evictions:,} / {result.preemptions:,}"),
        ("autoscaler nodes added / removed", f"{result.scale_ups:,} / {result.scale_downs:,}"),
        ("events (wall time)", f"{result.events:,} ({result.wall_s:.2f} s)"),
    ]
    for pool in pools:
        c = result.cost_by_pool.get(pool.name)
        rows.append((f"pool {pool.name} ({pool.sku}{', spot' if pool.spot else ''})",
                     f"{result.node_hours_by_pool[pool.name]:,.1f} node-h, " + ("cost unknown" if c is None else f"${c:,.2f}")))
    for k, v in rows:
        t.add_row(k, v)
    return t


def check_plot_path(path: Path, flag: str = "--plot") -> None:
    """Refuse, before a run, a file name whose extension matplotlib cannot write (the run would be lost)."""
    from matplotlib.backend_bases import FigureCanvasBase

    from azulite.errors import SpecError

    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = path.suffix.lower().lstrip(".")
    if ext not in kinds:
        raise SpecError(f"cannot write a plot as {('.' + ext) if ext else 'a file without an extension'}",
                        file=str(path), field=flag,
                        fix=f"name a .png (or {', '.join('.' + k for k in sorted(kinds) if k != 'png')}) file, "
                            f"e.g. {flag} {path.with_suffix('.png').name}")


def plot(result: Result, path: str | Path, title: str = "azulite simulate") -> Path:
    """Utilization, queue length and node count over time, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.series
    hours = s["t"] / 3600.0
    ready = s["ready_gpus"].astype(float)
    util = (s["busy_gpus"] / ready.clip(min=1)) * (ready > 0)
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    axes[0].step(hours, util * 100, where="post", color="tab:green")
    axes[0].set_ylabel("GPU util. %")
    axes[0].set_ylim(0, 105)
    axes[1].step(hours, s["queue"], where="post", color="tab:orange")
    axes[1].set_ylabel("queued jobs")
    axes[2].step(hours, s["nodes"], where="post", color="tab:blue")
    axes[2].set_ylabel("nodes")
    axes[2].set_xlabel("hours")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
