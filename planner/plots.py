"""PNG plots of simulation results. matplotlib is imported (with the Agg backend) only when a plot is drawn."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.errors import ConfigError
from planner.goodput import Goodput
from planner.metrics import SimResult, Slo
from planner.search import Candidate


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError(
            "plots need matplotlib, which the daemon/conductor install leaves out: "
            "pip install 'kvtier[planner]'"
        ) from exc

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _log_axis(ax: Any, *, unit: str = "") -> None:
    """A log x axis with few, readable labels; call after plotting (it reads the data limits).

    ``unit="ms"`` labels durations in ms, s or min; otherwise plain numbers.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    decades = np.log10(hi / lo) if lo > 0 and hi > lo else 1.0
    subs = (1.0, 2.0, 5.0) if decades <= 2.5 else (1.0,)
    ax.xaxis.set_major_locator(LogLocator(subs=subs, numticks=12))
    ax.xaxis.set_major_formatter(FuncFormatter(
        (lambda value, _pos: _duration_label(value)) if unit == "ms"
        else (lambda value, _pos: f"{value:g}")))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _duration_label(ms: float) -> str:
    if ms >= 3_600_000:
        return f"{ms / 3_600_000:.3g} h"
    if ms >= 60_000:
        return f"{ms / 60_000:.3g} min"
    if ms >= 1_000:
        return f"{ms / 1_000:.3g} s"
    return f"{ms:.3g} ms"


def _cdf(ax: Any, values: np.ndarray, label: str) -> None:
    finite = np.sort(values[np.isfinite(values)])
    if len(finite) == 0:
        return
    y = np.arange(1, len(finite) + 1) / len(values)
    ax.step(finite * 1e3, y, where="post", label=label)


def plot_latency_cdfs(results: Sequence[SimResult], slo: Slo | None, path: Path) -> Path:
    """TTFT and TPOT CDFs of one or more simulations side by side, with the SLOs marked."""
    plt = _pyplot()
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    for res in results:
        _cdf(ax_ttft, res.ttft_s, res.deployment)
        _cdf(ax_tpot, res.tpot_s, res.deployment)
    for ax, title, limit in (
        (ax_ttft, "Time to first token", slo.ttft_s if slo else None),
        (ax_tpot, "Time per output token", slo.tpot_s if slo else None),
    ):
        _log_axis(ax, unit="ms")
        ax.set_xlabel("latency (log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if limit is not None:
            ax.axvline(limit * 1e3, color="grey", linestyle="--", label=f"SLO {limit * 1e3:.0f} ms")
        ax.axhline(0.9, color="lightgrey", linestyle=":")
        ax.set_ylim(0, 1.01)
    ax_tpot.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{results[0].workload}: latency distributions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_goodput_curves(
    goodputs: Sequence[Goodput], slo: Slo, path: Path, per_gpu: bool = True
) -> Path:
    """SLO attainment against offered rate for each deployment, with its goodput marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for gp in goodputs:
        scale = gp.gpus if per_gpu else 1
        xs = [p.rate_per_s / scale for p in gp.curve]
        ys = [p.attainment * 100 for p in gp.curve]
        line = ax.plot(
            xs, ys, marker="o", markersize=3, label=f"{gp.deployment} ({gp.rate_per_s / scale:.2f})"
        )
        if gp.rate_per_s > 0:
            ax.axvline(gp.rate_per_s / scale, color=line[0].get_color(), linestyle=":", alpha=0.7)
    ax.axhline(
        slo.attainment_target * 100,
        color="grey",
        linestyle="--",
        label=f"target {slo.attainment_target:.0%}",
    )
    _log_axis(ax)
    ax.set_xlabel("offered rate, requests/s" + (" per GPU" if per_gpu else "") + " (log scale)")
    ax.set_ylabel("requests meeting both SLOs (%)")
    ax.set_ylim(0, 102)
    ax.set_title(
        f"Goodput: TTFT <= {slo.ttft_s * 1e3:.0f} ms and TPOT <= {slo.tpot_s * 1e3:.0f} ms"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_search(candidates: Sequence[Candidate], path: Path, top: int = 20) -> Path:
    """The best ``top`` candidates by goodput per GPU, coloured by architecture."""
    plt = _pyplot()
    shown = list(candidates)[:top][::-1]
    colours = {"colocated": "tab:blue", "chunked": "tab:green", "disaggregated": "tab:orange"}
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(shown) + 1.2))
    ax.barh(
        [c.deployment.label for c in shown],
        [c.per_gpu for c in shown],
        color=[colours[c.deployment.architecture.value] for c in shown],
    )
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(color=colour, label=arch) for arch, colour in colours.items()],
        fontsize=8,
        loc="lower right",
    )
    ax.set_xlabel("goodput per GPU (requests/s)")
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title("Search: best deployments per GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
