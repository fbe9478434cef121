"""The training state: what ``params="low"`` + ``amprewrite.optimizer`` keeps, against fp32,
autocast (fp32 weights and AdamW, bf16 compute) and naive ``model.to(bf16)`` + AdamW.

    python -m benchmarks state                  # all three parts, results in docs/benchmarks/
    python -m benchmarks state --parts bytes    # or: loss, step
    python -m benchmarks state --steps 40 --out /tmp/state   # a smoke run

Three parts:
- ``bytes``: bytes of training state per parameter for AdamW after the first steps (weights +
  gradients + states + masters + compensations) on the zoo LLaMA and GPT-2, at two learning
  rates (the choice follows the updates' size); goal <= 8.5 (autocast's recipe: 16).
- ``loss``: a small LLaMA trained on text every machine has (the Python standard library's own
  source files, byte-level, vocabulary 256), the four recipes from one initial model on the
  same batches; goal: amprewrite's final loss (mean of the last 50 steps) within 1% of fp32's,
  and its norm weights moving as fp32's do. Plot: docs/benchmarks/training_state_loss.png.
- ``step``: inductor's own count of the bytes a compiled train step (forward and backward)
  moves, zoo LLaMA, against autocast + compile; goal <= 0.9x with ``params="low"``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

from ..common import RESULTS, save

PARTS = ("bytes", "loss", "step")
RECIPES = ("fp32", "autocast", "naive bf16", "amprewrite")


# ------------------------------------------------------------------------------ recipes
def _silent_transform(model, **kw):
    import amprewrite

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return amprewrite.transform(model, "bf16", **kw)


def make(recipe: str, model: torch.nn.Module, inputs: dict, lr: float, wd: float, warmup: int):
    """``(forward, optimizer, module)`` of one recipe; ``forward(**inputs)`` returns the loss."""
    import amprewrite

    model = copy.deepcopy(model).train()
    if recipe == "fp32":
        return (lambda **kw: model(**kw).loss), torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=wd), model
    if recipe == "autocast":
        def forward(**kw):
            with torch.autocast("cpu", torch.bfloat16):
                return model(**kw).loss
        return forward, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd), model
    if recipe == "naive bf16":
        model = model.to(torch.bfloat16)
        return (lambda **kw: model(**kw).loss.float()), torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=wd), model
    gm = _silent_transform(model, example_inputs=inputs, params="low")
    opt = amprewrite.optimizer(gm, torch.optim.AdamW, lr=lr, weight_decay=wd, warmup=warmup)
    return (lambda **kw: gm(**kw).loss), opt, gm


def state_bytes(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Weights, gradients (one a weight that gets one) and states of a torch optimizer, or
    amprewrite's own count."""
    if hasattr(opt, "state_bytes"):
        return opt.state_bytes()
    out = dict.fromkeys(("weights", "grads", "states", "masters", "compensations"), 0)
    count = 0
    for group in opt.param_groups:
        for p in group["params"]:
            size = p.numel() * p.element_size()
            count += p.numel()
            out["weights"] += size
            st = opt.state.get(p, {})
            out["grads"] += size if st else 0
            out["states"] += sum(v.numel() * v.element_size() for v in st.values()
                                 if isinstance(v, torch.Tensor) and v.shape == p.shape)
    out["total"] = sum(out.values())
    out["params"] = count
    return out


# --------------------------------------------------------------------------------- bytes
def part_bytes(steps: int, warmup: int) -> list[dict]:
    from amprewrite.testing import zoo

    rows = []
    for name in ("llama", "gpt2"):
        model, (ids,) = getattr(zoo, name)()
        inputs = {"input_ids": ids, "labels": ids}
        g = torch.Generator().manual_seed(0)  # a new batch each step, as training sees
        batches = [torch.randint(0, 256, ids.shape, generator=g) for _ in range(steps)]
        for lr in (1e-3, 1e-4):
            for recipe in RECIPES:
                forward, opt, _ = make(recipe, model, inputs, lr, 0.01, warmup)
                for batch in batches:
                    forward(input_ids=batch, labels=batch).backward()
                    opt.step()
                    opt.zero_grad()
                b = state_bytes(opt)
                row = {"model": name, "lr": lr, "recipe": recipe, "steps": steps,
                       "bytes_per_param": round(b["total"] / b["params"], 3),
                       **{k: b[k] for k in ("weights", "grads", "states", "masters",
                                            "compensations", "params")}}
                if recipe == "amprewrite":
                    chosen = [d.storage for d in opt.decisions.values()]
                    row["storages"] = {s: chosen.count(s) for s in sorted(set(chosen))}
                rows.append(row)
                print(f"{name} lr {lr:g} {recipe:>10}: {row['bytes_per_param']:.2f} bytes a "
                      "parameter", flush=True)
    return rows


# ---------------------------------------------------------------------------------- loss
def corpus(limit: int = 4 << 20) -> torch.Tensor:
    """The standard library's ``.py`` files, sorted by path, as bytes (the first ``limit``):
    the same text on every machine with this Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= limit:
            break
    return torch.frombuffer(bytearray(data[:limit]), dtype=torch.uint8).long()


def small_llama():
    from amprewrite.testing import zoo

    return zoo.llama_lm(hidden=128, intermediate=344, layers=4, positions=256)


def _norms(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for n, p in module.named_parameters()
                      if "norm" in n])


def part_loss(steps: int, batch: int, seq: int, lr: float, warmup: int,
              seeds: int = 3) -> tuple[list, dict]:
    """Each recipe on ``seeds`` orders of batches (seed 0, 1, ...) from one initial model: one
    run's final loss moves by about 1% with the order of its batches, the size of the
    differences measured here, so the goal is read on the mean over the seeds."""
    runs = [_loss_runs(steps, batch, seq, lr, warmup, seed) for seed in range(seeds)]
    rows = []
    for i in range(len(RECIPES)):
        per_seed = [r[0][i] for r in runs]
        finals = [r["final_loss"] for r in per_seed]
        rows.append({**per_seed[0], "seeds": seeds,
                     "final_loss": sum(finals) / len(finals),
                     "final_loss_by_seed": finals,
                     "norm_moved_mean": sum(r["norm_moved_mean"] for r in per_seed) / seeds,
                     "seconds": round(sum(r["seconds"] for r in per_seed), 1)})
    fp32 = rows[0]["final_loss"]
    for r in rows:
        r["vs_fp32"] = round(r["final_loss"] / fp32, 4)
        r["vs_fp32_by_seed"] = [round(a / b, 4) for a, b in
                                zip(r["final_loss_by_seed"], rows[0]["final_loss_by_seed"])]
        print(f"{r['recipe']:>10}: mean final loss {r['final_loss']:.4f} over {seeds} seeds, "
              f"{r['vs_fp32']:.4f}x fp32's (by seed {r['vs_fp32_by_seed']})", flush=True)
    return rows, runs[0][1]


def _loss_runs(steps: int, batch: int, seq: int, lr: float, warmup: int,
               seed: int) -> tuple[list, dict]:
    text = corpus()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, text.numel() - seq - 1, (steps, batch), generator=g)
    model = small_llama()
    example = text[starts[0, 0]:starts[0, 0] + seq].reshape(1, seq).repeat(batch, 1)
    rows, curves = [], {}
    for recipe in RECIPES:
        forward, opt, module = make(recipe, model, {"input_ids": example, "labels": example},
                                    lr, 0.1, warmup)
        norms0 = _norms(module)
        losses = []
        start = time.perf_counter()
        for step in range(steps):
            ids = torch.stack([text[s:s + seq] for s in starts[step].tolist()])
            loss = forward(input_ids=ids, labels=ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        seconds = time.perf_counter() - start
        moved = (_norms(module) - norms0).abs()
        curves[recipe] = losses
        tail = losses[-50:]
        rows.append({"recipe": recipe, "steps": steps, "final_loss": sum(tail) / len(tail),
                     "norm_moved_mean": moved.mean().item(),
                     "norm_unmoved_share": (moved == 0).float().mean().item(),
                     "seconds": round(seconds, 1),
                     "bytes_per_param": round(state_bytes(opt)["total"]
                                              / state_bytes(opt)["params"], 3)})
        print(f"seed {seed} {recipe:>10}: final loss {rows[-1]['final_loss']:.4f}, norm "
              f"weights moved {rows[-1]['norm_moved_mean']:.2e} on average, "
              f"{rows[-1]['norm_unmoved_share']:.0%} never, {seconds:.0f} s", flush=True)
    return rows, curves


def plot(curves: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for recipe, losses in curves.items():
        t = torch.tensor(losses)
        smooth = torch.nn.functional.avg_pool1d(t[None, None], 9, 1, 4,
                                                count_include_pad=False)[0, 0]
        ax.plot(smooth.tolist(), label=recipe, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats a byte, 9-step mean)")
    ax.set_title("small LLaMA on the Python standard library's source, bf16 (seed 0)")
    ax.legend()
    ax.grid(alpha=0.3)
    path = out / "training_state_loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------------------------- step
def part_step() -> list[dict]:
    from amprewrite.testing import zoo

    from ..compile.step_bytes import count

    model, (ids,) = zoo.llama()
    model.train()
    inputs = {"input_ids": ids, "labels": ids}

    def autocast():
        compiled = torch.compile(model)
        with torch.autocast("cpu", torch.bfloat16):
            loss = compiled(**inputs).loss
        loss.backward()

    variants = {"autocast + compile": autocast}
    for params in ("fp32", "low"):
        for io in (True, False):
            gm = _silent_transform(copy.deepcopy(model), example_inputs=inputs, params=params,
                                   keep_io_dtype=io)
            variants[f"transform params={params!r} keep_io_dtype={io} + compile"] = (
                lambda gm=gm: torch.compile(gm)(**inputs).loss.backward())
    rows = []
    for name, step in variants.items():
        figures = count(step)
        rows.append({"variant": name, **figures})
        print(f"{name}: {figures['bytes']:,} bytes, {figures['launches']} launches", flush=True)
    base = rows[0]["bytes"]
    for r in rows:
        r["vs_autocast"] = round(r["bytes"] / base, 3)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks state", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--steps", type=int, default=300, help="steps of the loss part")
    parser.add_argument("--seeds", type=int, default=3,
                        help="batch orders of the loss part (the goal reads their mean)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=10,
                        help="amprewrite.optimizer's measured steps before it decides")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = "python -m benchmarks state " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {}
    if "bytes" in args.parts:
        results["bytes"] = part_bytes(steps=2 * args.warmup, warmup=args.warmup)
        save("training_state_bytes", results["bytes"], {"command": command.strip()}, args.out)
    if "loss" in args.parts:
        rows, curves = part_loss(args.steps, args.batch, args.seq, args.lr, args.warmup,
                                 args.seeds)
        results["loss"] = rows
        save("training_state_loss", rows, {"command": command.strip(), "curves": curves,
                                           "lr": args.lr, "batch": args.batch,
                                           "seq": args.seq}, args.out)
        try:
            print("plot:", plot(curves, args.out))
        except ImportError:
            print("no matplotlib: the plot needs pip install -e '.[bench]'")
    if "step" in args.parts:
        results["step"] = part_step()
        save("training_state_step", results["step"], {"command": command.strip()}, args.out)
    return results


if __name__ == "__main__":
    main()
