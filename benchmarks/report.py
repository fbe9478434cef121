"""Tables for docs/benchmarks.md, printed from the JSON results (no re-measuring).

    python -m benchmarks.report transform_cost|runtime|upsample|loops|capture|capture_llama|
                                generate|inference|inference_compiled|report_page|fp8|
                                training_state_bytes|training_state_loss|training_state_step|
                                bytes
"""

from __future__ import annotations

import json
import sys

from .common import RESULTS, table


def transform_cost() -> str:
    data = json.loads((RESULTS / "transform_cost.json").read_text())
    cols = ["capture", "blocks", "nodes", "nodes_after", "capture_s", "passes_s", "recompile_s",
            "capture_us_per_node", "passes_us_per_node", "recompile_us_per_node", "peak_mb"]
    fits = "\n".join(
        f"- {m}: time ~ nodes^k with k = {f['capture_exponent']:.2f} (capture), "
        f"{f['passes_exponent']:.2f} (passes); peak memory k = {f['peak_mb_exponent']:.2f}"
        for m, f in data.get("fits", {}).items())
    return table(data["rows"], cols) + "\n\n" + fits


def runtime(device: str = "cpu") -> str:
    data = json.loads((RESULTS / f"runtime_{device}.json").read_text())
    rows = []
    for r in data["rows"]:
        rows.append({**r, "median (IQR) ms": f"{r['median_ms']:.1f} ({r['iqr_ms']:.1f})"
                     if "median_ms" in r else "-"})
    cols = ["model", "dtype", "task", "mode", "variant", "median (IQR) ms", "vs_fp32",
            "rel_err_vs_fp64", "error"]
    return table(rows, cols)


def upsample(device: str = "cpu") -> str:
    data = json.loads((RESULTS / f"upsample_{device}.json").read_text())
    rows = [{**r, "native ms (IQR)": f"{r['native_ms']:.2f} ({r['native_iqr_ms']:.2f})",
             "rewrite ms (IQR)": f"{r['rewrite_ms']:.2f} ({r['rewrite_iqr_ms']:.2f})"}
            for r in data["rows"]]
    return table(rows, ["dtype", "mode", "pass", "native ms (IQR)", "rewrite ms (IQR)",
                        "rewrite/native"])


def loops(device: str = "cpu") -> str:
    data = json.loads((RESULTS / f"loops_{device}.json").read_text())
    rows = [{**r, **{f"{k} ms (IQR)": f"{r[k + '_ms']:.3f} ({r[k + '_iqr_ms']:.3f})"
                     for k in ("loop", "amprewrite", "hand_vectorized")}} for r in data["rows"]]
    first = table(rows, ["B", "loop ms (IQR)", "amprewrite ms (IQR)",
                         "hand_vectorized ms (IQR)", "amprewrite/hand", "loop/amprewrite"])
    second = table(data["compile"], ["B", "compile", "first_call_s"])
    return f"{first}\n\n{second}\n\nplain inductor / amprewrite backend: " \
           f"{data['compile_ratio']:.1f}x"


def capture() -> str:
    data = json.loads((RESULTS / "capture.json").read_text())
    return table(data["rows"], ["model", "nodes", "export_static_s", "transform_s", "capture_s",
                                "ratio", "meets_goal", "export_nonstrict_s",
                                "export_nonstrict_batch_s", "capture_export_s",
                                "capture_export_vs_nonstrict_batch", "low_nodes",
                                "low_nodes_export", "err_export_vs_dynamo"])


def capture_llama() -> str:
    data = json.loads((RESULTS / "capture_llama.json").read_text())
    return table(data["rows"], ["what", "seconds", "median_s", "capture_s", "capture_median_s",
                                "passes_s", "capture_vs_nonstrict", "capture_vs_nonstrict_median",
                                "capture_vs_nonstrict_batch",
                                "capture_vs_nonstrict_batch_median"])


def generate() -> str:
    data = json.loads((RESULTS / "generate.json").read_text())
    return table(data["rows"], ["variant", "first_s", "second_s", "tokens_equal"])


def inference(device: str = "cpu", tag: str = "") -> str:
    data = json.loads((RESULTS / f"inference_{device}{tag}.json").read_text())
    rows = [{**r, "median (IQR) ms": f"{r['median_ms']:.1f} ({r['iqr_ms']:.1f})"}
            for r in data["rows"]]
    return table(rows, ["case", "variant", "median (IQR) ms", "vs_autocast", "vs_to_dtype",
                        "rel_err_vs_fp64", "weights_mb", "weights_vs_fp32"])


def report_page() -> str:
    data = json.loads((RESULTS / "report_page.json").read_text())
    return table(data["rows"], ["model", "nodes", "page_mb", "open_s", "expand_all_s",
                                "expanded_items", "search_s"])


def fp8(device: str = "cpu") -> str:
    data = json.loads((RESULTS / f"fp8_{device}.json").read_text())
    rows = [{**r, "median (IQR) ms": f"{r['median_ms']:.1f} ({r['iqr_ms']:.1f})",
             "float8 linears": f"{r['fp8_linears']}/{r['linears']}"} for r in data["rows"]]
    cols = ["task", "variant", "median (IQR) ms", "speedup", "out_err", "loss_err",
            "loss_after_err", "grad_err", "float8 linears", "first_call_s"]
    if any("peak_mib" in r for r in rows):
        cols.insert(4, "peak_mib")
    return table(rows, cols)


def training_state_bytes() -> str:
    data = json.loads((RESULTS / "training_state_bytes.json").read_text())
    rows = [{**r, "storages": ", ".join(f"{k} {v}" for k, v in r.get("storages", {}).items())}
            for r in data["rows"]]
    return table(rows, ["model", "lr", "recipe", "bytes_per_param", "weights", "grads",
                        "states", "masters", "compensations", "storages"])


def training_state_loss() -> str:
    data = json.loads((RESULTS / "training_state_loss.json").read_text())
    rows = [{**r, "by seed": " / ".join(f"{v:.4f}" for v in r["vs_fp32_by_seed"]),
             "final loss (mean)": f"{r['final_loss']:.4f}", "vs fp32": f"{r['vs_fp32']:.4f}",
             "norm weights moved": f"{r['norm_moved_mean']:.2e}",
             "norm weights never moved": f"{r['norm_unmoved_share']:.0%}",
             "seconds (all seeds)": r["seconds"]} for r in data["rows"]]
    return table(rows, ["recipe", "final loss (mean)", "vs fp32", "by seed",
                        "norm weights moved", "norm weights never moved", "bytes_per_param",
                        "seconds (all seeds)"])


def training_state_step() -> str:
    data = json.loads((RESULTS / "training_state_step.json").read_text())
    return table(data["rows"], ["variant", "bytes", "vs_autocast", "kernels", "extern",
                                "launches"])


def step_bytes() -> str:
    data = json.loads((RESULTS / "bytes.json").read_text())
    rows = [{**r, "vs autocast": f"{r['vs_autocast']:.3f}x", "bytes": f"{r['bytes']:,}"}
            for r in data["rows"]]
    return table(rows, ["model", "task", "dtype", "variant", "bytes", "vs autocast", "launches",
                        "differs_most"])


def plan_time() -> str:
    from .precision.plan_time import markdown

    return markdown(json.loads((RESULTS / "plan_time.json").read_text())["rows"])


TABLES = {"transform_cost": transform_cost, "runtime": runtime, "upsample": upsample,
          "loops": loops, "capture": capture, "capture_llama": capture_llama,
          "generate": generate, "inference": inference,
          "inference_compiled": lambda: inference(tag="_compiled"), "report_page": report_page,
          "fp8": fp8, "training_state_bytes": training_state_bytes,
          "training_state_loss": training_state_loss, "training_state_step": training_state_step,
          "bytes": step_bytes, "plan_time": plan_time}

if __name__ == "__main__":
    print(TABLES[sys.argv[1] if len(sys.argv) > 1 else "transform_cost"]())
