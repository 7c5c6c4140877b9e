"""The sweep's PNG: S_PP and S_TG against N_KV, two panels side by side, a line per run."""
from nbmoe.errors import NbmoeError


def plot_runs(rows, path):
    """rows: the sweep's (sweep.KEYS plus label, model_type), grouped into runs by label."""
    import matplotlib
    matplotlib.use("Agg")          # files only: no display needed
    import matplotlib.pyplot as plt

    runs = {}
    for r in rows:
        runs.setdefault(r["label"], []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    for ax, key, what in ((axes[0], "speed_pp", "prompt processing (PP)"),
                          (axes[1], "speed_tg", "token generation (TG)")):
        for label, run in runs.items():
            run = sorted(run, key=lambda r: r["n_kv"])
            ax.plot([r["n_kv"] for r in run], [r[key] for r in run], marker="o", markersize=3,
                    label=label)
        ax.set_title(f"{what}, {run[0]['pp'] if key == 'speed_pp' else run[0]['tg']} tokens")
        ax.set_xlabel("N_KV (tokens in the cache)")
        ax.set_ylabel(f"{'S_PP' if key == 'speed_pp' else 'S_TG'} (tokens/s)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    models = sorted({r["model_type"] for r in rows})
    fig.suptitle(f"nbmoe sweep: {', '.join(models)}")
    try:
        fig.savefig(path, dpi=110)
    except (OSError, ValueError) as e:
        raise NbmoeError(f"cannot write the plot {path}: {e}") from None
    finally:
        plt.close(fig)
