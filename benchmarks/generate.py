"""HF generation: 32 new greedy tokens from a tiny LLaMA, first call with all compile work.

    python -m benchmarks.generate [--variants autocast amprewrite-eager ...] [--tokens 32]

Each variant runs in a fresh Python process (so every first call pays the same one-off costs:
dynamo's and inductor's lazy imports, amprewrite's kernel probes). In that process: build the
model, run one autocast-eager generate (warms the transformers code and gives the reference
tokens), then the variant's first and second generate. ``tokens_equal``: the variant's tokens
equal autocast eager's. Writes docs/benchmarks/generate.{json,csv}.

Variants: ``autocast`` (eager), ``autocast+inductor`` (``model.forward = torch.compile(...)``
under autocast), ``amprewrite-eager`` / ``amprewrite-inductor`` (:func:`amprewrite.for_generation`
with a static cache, the documented recipe), ``*-dynamic`` (the same on HF's DynamicCache),
``dynamo-eager`` (``torch.compile(backend="eager")`` in fp32 with a static cache: what dynamo
alone costs). inductor's on-disk caches are off, so every first call compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from .common import save, table

VARIANTS = ["autocast", "autocast+inductor", "amprewrite-eager", "amprewrite-eager-dynamic",
            "amprewrite-inductor", "amprewrite-inductor-dynamic", "dynamo-eager"]

_CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import amprewrite

variant, tokens = sys.argv[1], int(sys.argv[2])
cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 256, (1, 12))

def gen(m, **kw):
    return m.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **kw)

with torch.autocast("cpu", torch.bfloat16):
    ref = gen(model)
ctx, kw, m = torch.autocast("cpu", torch.bfloat16, enabled=False), {}, model
if variant == "autocast":
    ctx = torch.autocast("cpu", torch.bfloat16)
elif variant == "autocast+inductor":
    ctx = torch.autocast("cpu", torch.bfloat16)
    model.forward = torch.compile(model.forward)
elif variant.startswith("amprewrite-"):
    inner = "inductor" if "inductor" in variant else "eager"
    m = amprewrite.for_generation(model, torch.bfloat16, inner=inner,
                                  static_cache="dynamic" not in variant)
elif variant == "dynamo-eager":
    model.forward = torch.compile(model.forward, backend="eager")
    kw = {"cache_implementation": "static", "disable_compile": True}
times = []
for _ in range(2):
    start = time.perf_counter()
    with ctx:
        out = gen(m, **kw)
    times.append(time.perf_counter() - start)
print(json.dumps({"variant": variant, "first_s": times[0], "second_s": times[1],
                  "tokens_equal": bool(torch.equal(out, ref))}))
"""


def run(variant: str, tokens: int) -> dict:
    # inductor's on-disk caches off: a first call must really compile, in every run.
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, variant, str(tokens)],
                          capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"variant": variant, "first_s": "failed", "second_s": "", "tokens_equal": last}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    rows = []
    for variant in args.variants:
        rows.append(run(variant, args.tokens))
        print(rows[-1], flush=True)
    print(table(rows, ["variant", "first_s", "second_s", "tokens_equal"]))
    save("generate", rows, {"tokens": args.tokens, "model": "LLaMA, hidden 64, 2 layers"})
    return rows


if __name__ == "__main__":
    main()
