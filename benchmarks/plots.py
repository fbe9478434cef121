"""Plots for docs/benchmarks.md from the JSON results (matplotlib, PNG).

    python -m benchmarks.plots

- transform_cost.png: capture and pass time against graph size (log-log), with the fitted slope;
- runtime_<device>.png: time relative to fp32 per model, task and variant;
- error_<device>.png: relative output error against fp64 per model and variant.
"""

from __future__ import annotations

import json

from .common import RESULTS


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def transform_cost(plt) -> str | None:
    data = _load("transform_cost")
    if data is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, marker in (("symbolic_trace", "o"), ("dynamo", "s")):
        rows = [r for r in data["rows"] if r["capture"] == method]
        if not rows:
            continue
        nodes = [r["nodes"] for r in rows]
        fit = data.get("fits", {}).get(method, {})
        ax.loglog(nodes, [r["capture_s"] for r in rows], marker + "-",
                  label=f"{method} capture (k={fit.get('capture_exponent', float('nan')):.2f})")
        ax.loglog(nodes, [r["passes_s"] for r in rows], marker + "--",
                  label=f"{method} passes (k={fit.get('passes_exponent', float('nan')):.2f})")
    ax.set_xlabel("graph nodes")
    ax.set_ylabel("seconds")
    ax.set_title("transform cost (time ~ nodes^k)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    out = RESULTS / "transform_cost.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out.name


def runtime(plt, device: str) -> list[str]:
    data = _load(f"runtime_{device}")
    if data is None:
        return []
    rows = [r for r in data["rows"] if "median_ms" in r]
    groups = sorted({(r["model"], r["task"], r["mode"]) for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(variants)
    for k, v in enumerate(variants):
        ys, errs = [], []
        for g in groups:
            r = next((r for r in rows if (r["model"], r["task"], r["mode"]) == g
                      and r["variant"] == v), None)
            base = next((b for b in rows if (b["model"], b["task"], b["mode"]) == g
                         and b["variant"] == "fp32"), None)
            ratio = r["median_ms"] / base["median_ms"] if r and base else 0.0
            ys.append(ratio)
            errs.append(r["iqr_ms"] / 2 / base["median_ms"] if r and base else 0.0)
        ax.bar([i + k * width for i in range(len(groups))], ys, width, yerr=errs, label=v,
               capsize=2)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{t}\n{mode}" for m, t, mode in groups], fontsize=7)
    ax.set_ylabel("time / fp32 (same mode)")
    ax.set_title(f"runtime on {device} (medians; bars: half the IQR)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    out = RESULTS / f"runtime_{device}.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    names = [out.name]
    err_rows = [r for r in rows if "rel_err_vs_fp64" in r and r["variant"] != "fp32"]
    if err_rows:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r['model']} {r['mode']}\n{r['variant']}" for r in err_rows]
        ax.barh(range(len(err_rows)), [r["rel_err_vs_fp64"] for r in err_rows])
        ax.set_yticks(range(len(err_rows)))
        ax.set_yticklabels(labels, fontsize=6)
        ax.set_xscale("log")
        ax.set_xlabel("relative output error vs fp64")
        ax.set_title(f"numerics on {device} (inference)")
        fig.tight_layout()
        out = RESULTS / f"error_{device}.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        names.append(out.name)
    return names


def main(argv: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = [transform_cost(plt), *runtime(plt, "cpu"), *runtime(plt, "cuda")]
    print("wrote " + ", ".join(str(RESULTS / m) for m in made if m))


if __name__ == "__main__":
    main()
