"""TTFT CDF plot for `kvrep sim --plot` (matplotlib is imported lazily: it is an optional dependency)."""

from __future__ import annotations


def plot_ttft_cdf(results: list[dict], path: str, samples: dict) -> None:
    """Writes a PNG with one TTFT CDF per policy.

    Args:
        results: the result records (for the order and names).
        path: output PNG path.
        samples: policy name -> list of TTFT values, s.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        v = np.sort(np.asarray(samples.get(r["policy"], []), dtype=float))
        if v.size == 0:
            continue
        ax.plot(v, np.arange(1, v.size + 1) / v.size, label=r["policy"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
