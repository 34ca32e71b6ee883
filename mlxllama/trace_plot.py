"""`trace`'s pictures (matplotlib, the optional `plot` extra): a comparison's error at every layer
and position, and one head's attention weights.

The heatmap draws log10 of each position's relative error ||a - b|| / ||b|| for every dumped tensor
in computation order, with the tolerance marked on its colour bar and the first divergence boxed:
an error that grows layer after layer from one cell is a bug; one that stays flat, near the bottom
of the scale, is rounding.
"""

from __future__ import annotations

import html
import io
import os
from pathlib import Path

import numpy as np

from .errors import MlxLlamaError
from .trace import Comparison, layer_errors, stats_label

FORMATS = (".png", ".svg", ".html")
# Errors below this are drawn as it: float32 rounding, which a log scale would stretch over decades.
FLOOR = 1e-7


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no window, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise MlxLlamaError('--plot needs matplotlib: pip install "mlxllama[plot]"') from None
    return plt


def check_plot_path(path: str | os.PathLike) -> None:
    if Path(path).suffix.lower() not in FORMATS:
        raise MlxLlamaError(f"--plot {path}: the file must end in {', '.join(FORMATS)}")


def plot_comparison(comparison: Comparison, dir_a: str, dir_b: str, path: str | os.PathLike,
                    head: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """Draw the comparison's heatmap to `path`; the (row, position) boxed as the first divergence, if
    any. With a (layer, head), a second panel draws that head's prompt weights from each dump that
    holds them (`trace --attention --dump` writes them)."""
    check_plot_path(path)
    plt = pyplot()
    names = [d.name for d in comparison.layers]
    errors = np.stack([layer_errors(dir_a, dir_b, name, comparison.positions) for name in names])
    shown = np.log10(np.clip(np.nan_to_num(errors, nan=np.inf, posinf=1e6), FLOOR, 1e6))
    tolerance = np.log10(comparison.tolerance)
    panels = [] if head is None else [(d, w) for d in (dir_a, dir_b) if (w := head_weights(d, *head)) is not None]
    if head is not None and not panels:
        raise MlxLlamaError("--plot-head: neither dump holds attention weights (trace --attention --dump writes them)")
    width = max(6, 0.25 * comparison.positions + 3)
    figure, axes = plt.subplots(1, 1 + len(panels), figsize=(width + 5 * len(panels), max(4, 0.22 * len(names) + 2)),
                                squeeze=False)
    axis = axes[0][0]
    for panel, (directory, weights) in zip(axes[0][1:], panels):
        draw_weights(panel, figure, weights, f"{Path(directory).name}: layer {head[0]}, head {head[1]}")
    image = axis.imshow(shown, aspect="auto", cmap="viridis", interpolation="nearest",
                        vmin=min(shown.min(), tolerance - 3), vmax=max(shown.max(), tolerance + 1))
    axis.set_yticks(range(len(names)), [stats_label(n) for n in names], fontsize=7)
    axis.set_xlabel("position")
    axis.set_ylabel("layer output (computation order)")
    bar = figure.colorbar(image, ax=axis)
    bar.set_label("log10 ||a - b|| / ||b||")
    bar.ax.axhline(tolerance, color="red", linewidth=2)
    bar.ax.text(1.05, tolerance, f" tolerance {comparison.tolerance:g}", color="red", va="center", fontsize=7,
                transform=bar.ax.get_yaxis_transform())
    marked = None
    first = comparison.first_divergence
    if first is not None:
        marked = (names.index(first.name), first.first_diverging)
        row, column = marked
        axis.add_patch(plt.Rectangle((column - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
        axis.set_title(f"first divergence: {stats_label(first.name)} at position {column} "
                       f"(step {comparison.step(column)})", fontsize=9)
    elif comparison.token_divergence is not None:
        axis.set_title(f"every layer within {comparison.tolerance:g}; the token ids part at position "
                       f"{comparison.token_divergence[0]}", fontsize=9)
    else:
        axis.set_title(f"no divergence: every layer within {comparison.tolerance:g}", fontsize=9)
    save(figure, path, f"{dir_a} against {dir_b}")
    plt.close(figure)
    return marked


def plot_attention(weights: np.ndarray, layer: int, head: int, path: str | os.PathLike) -> None:
    """One head's prompt weights [queries, keys] (trace --attention) as an image: query × key."""
    check_plot_path(path)
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 5))
    draw_weights(axis, figure, weights, f"attention of layer {layer}, head {head}")
    save(figure, path, f"layer {layer} head {head}")
    plt.close(figure)


def draw_weights(axis, figure, weights: np.ndarray, title: str) -> None:
    image = axis.imshow(weights, aspect="auto", cmap="magma", interpolation="nearest", vmin=0, vmax=1)
    axis.set_xlabel("key (cache slot)")
    axis.set_ylabel("query position")
    axis.set_title(title, fontsize=9)
    figure.colorbar(image, ax=axis).set_label("weight")


def head_weights(directory: str | os.PathLike, layer: int, head: int) -> np.ndarray | None:
    """A head's prompt weights from a dump (layer_LLL_weights.npy), or None where it has none."""
    path = Path(directory) / f"layer_{layer:03d}_weights.npy"
    if not path.is_file():
        return None
    weights = np.load(path, allow_pickle=False)
    if weights.ndim != 3 or not 0 <= head < weights.shape[0]:
        raise MlxLlamaError(f"{path}: has no head {head} (shape {list(weights.shape)})")
    return weights[head]


def save(figure, path: str | os.PathLike, title: str) -> None:
    """PNG or SVG as matplotlib writes them; HTML as a page holding the SVG."""
    target = Path(path)
    try:
        if target.suffix.lower() == ".html":
            svg = io.StringIO()
            figure.savefig(svg, format="svg", bbox_inches="tight")
            page = f"<!doctype html><meta charset='utf-8'><title>mlxllama trace: {html.escape(title)}</title>\n{svg.getvalue()}"
            target.write_text(page, encoding="utf-8")
        else:
            figure.savefig(target, bbox_inches="tight", dpi=110)
    except OSError as e:
        raise MlxLlamaError(f"cannot write {path}: {e.strerror}") from None

