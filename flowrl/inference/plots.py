"""The picture of an inference-time scaling measurement: a quantity against the number of candidates N."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..atomic_files import atomic_path


def save_scaling_plot(
    panels: Mapping[str, Mapping[str, Mapping[int, float]]],
    path: Path,
    ylabel: str,
    references: Mapping[str, Mapping[str, float]] | None = None,
    title: str = "",
) -> None:
    """One panel per entry of ``panels`` ({panel title: {line label: {N: value}}}), N on a log2 axis, all
    panels on one y scale so they compare at a glance. A label containing "oracle" is drawn dashed (an
    upper bound, not a method); ``references`` ({panel title: {label: value}}) are horizontal dotted lines
    (e.g. greedy decoding)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    references = references or {}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), dpi=110, sharey=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = list(dict.fromkeys(label for lines in panels.values() for label in lines))  # one colour per label across panels
    for ax, (panel, lines) in zip(axes[0], panels.items()):
        for label, curve in lines.items():
            ns = sorted(curve)
            oracle = "oracle" in label
            ax.plot(
                ns,
                [curve[n] for n in ns],
                marker="o",
                ms=4,
                label=label,
                color="0.45" if oracle else colors[labels.index(label) % len(colors)],
                linestyle="--" if oracle else "-",
            )
        for i, (label, value) in enumerate(references.get(panel, {}).items()):
            ax.axhline(value, color="0.2", linestyle=":", linewidth=1.2 + 0.4 * i, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({n for c in lines.values() for n in c}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("N (candidates per item)")
        ax.set_title(panel, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(ylabel)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


__all__ = ["save_scaling_plot"]
