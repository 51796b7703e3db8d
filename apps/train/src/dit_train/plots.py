"""The curves dit-train draws at the end of a run: RUN_DIR/loss.png (training loss), RUN_DIR/heldout.png (held-out
loss per noise level)."""

from __future__ import annotations

from pathlib import Path


def plot_losses(history: list[list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    steps, losses = zip(*history, strict=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, lw=0.6, alpha=0.4, label="loss")
    k = max(1, len(losses) // 50)
    smooth = [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1]) for i in range(len(losses))]
    ax.plot(steps, smooth, lw=1.5, label=f"mean of {k + 1}")
    ax.set(xlabel="step", ylabel="EDM loss", yscale="log", title="training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_heldout(history: list, path: Path) -> None:
    """The EMA weights' held-out loss at each noise level over the steps (dit_train.heldout: [step, values]), one
    line per level, and the weighted total."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [step for step, _ in history]
    # EDM's noise levels (heldout/ema/sigma_00=0.002, ...) or flow's times (heldout/ema/t_00=0.05, ...)
    names = sorted(name for name in history[-1][1] if name.startswith(("heldout/ema/sigma_", "heldout/ema/t_")))
    flow = any(name.startswith("heldout/ema/t_") for name in names)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = plt.cm.viridis([k / max(1, len(names) - 1) for k in range(len(names))])
    for name, colour in zip(names, colours, strict=True):
        ax.plot(steps, [values.get(name, float("nan")) for _, values in history], marker=".", color=colour,
                label=("t = " if flow else "σ = ") + name.split("=", 1)[1])
    ax.plot(steps, [values.get("heldout/ema/total", float("nan")) for _, values in history], "k--", lw=2,
            label="weighted total")
    ax.set(xlabel="step", ylabel=f"held-out {'flow' if flow else 'EDM'} loss (EMA)", yscale="log",
           title="held-out loss per noise level")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
