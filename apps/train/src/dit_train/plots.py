"""The loss curve dit-train draws into RUN_DIR/loss.png at the end of a run."""

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
