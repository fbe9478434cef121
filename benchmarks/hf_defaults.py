"""Hugging Face causal LMs and seq2seq models with their default config (``use_cache=True``):
how many ``amprewrite.transform`` takes, and for those it does not, whether
``torch.compile(model, backend="eager", fullgraph=True)`` fails too.

    python -m benchmarks.hf_defaults [--models gpt2 llama t5 ...] [--dtype bf16]

Each model is built from its config class's defaults (``AutoConfig.for_model``), made small
where the config has the attribute (2 layers, hidden 64, 4 heads, 2 key-value heads, head
dimension 16, feed-forward 128, at most 128 positions; the vocabulary kept unless above 64k,
then 1,024, special token ids wrapped into it), random weights, eval mode, and transformed on
token ids of batch 2 (a seq2seq model also gets ``decoder_input_ids``; Whisper gets log-mel
features in place of token ids), verification on. It
prints one line per model: ``ok`` with the output types and the logits' error against fp32,
or ``fail`` with the first line of the error and what the eager-backend ``torch.compile`` with
``fullgraph=True`` did on the same inputs; and writes docs/benchmarks/hf_defaults.{json,csv}
(``--no-save``: print only). No downloads.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

CAUSAL = ["gpt2", "gpt_neo", "gpt_neox", "gptj", "codegen", "opt", "bloom", "falcon",
          "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
          "gemma2", "gemma3_text", "phi", "phi3", "stablelm", "starcoder2", "olmo", "olmo2",
          "granite", "cohere", "glm", "smollm3", "gpt_bigcode", "mpt", "biogpt", "xglm",
          "persimmon", "helium"]
SEQ2SEQ = ["t5", "mt5", "bart", "mbart", "pegasus", "marian", "blenderbot", "m2m_100",
           "whisper"]
SMALL = {"num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "encoder_layers": 2,
         "decoder_layers": 2, "num_decoder_layers": 2, "hidden_size": 64, "d_model": 64,
         "n_embd": 64, "num_attention_heads": 4, "encoder_attention_heads": 4,
         "decoder_attention_heads": 4, "num_heads": 4, "n_head": 4, "num_key_value_heads": 2,
         "head_dim": 16, "d_kv": 16, "intermediate_size": 128, "d_ff": 128,
         "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "ffn_dim": 128, "n_inner": 128,
         "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
         "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
         "max_position_embeddings": 128, "n_positions": 128, "sliding_window": 8,
         "rotary_dim": 8, "partial_rotary_factor": 0.5, "window_size": 8,
         "num_mel_bins": 16, "max_source_positions": 32, "max_target_positions": 32}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def build(model_type: str) -> tuple[torch.nn.Module, dict]:
    """A small random-weight model of ``model_type`` with its default config, and its inputs."""
    import transformers as tf

    cfg = tf.AutoConfig.for_model(model_type)
    for key, value in SMALL.items():
        if hasattr(cfg, key) and getattr(cfg, key) is not None:
            try:
                setattr(cfg, key, value)
            except AttributeError:  # a property computed from the others (Falcon's head_dim)
                pass
    if getattr(cfg, "vocab_size", 0) > 65536:
        cfg.vocab_size = 1024
    vocab = cfg.vocab_size
    for key in TOKEN_IDS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value >= vocab:
            setattr(cfg, key, value % vocab)
    seq2seq = model_type in SEQ2SEQ
    auto = (tf.AutoModelForSpeechSeq2Seq if model_type == "whisper" else
            tf.AutoModelForSeq2SeqLM if seq2seq else tf.AutoModelForCausalLM)
    torch.manual_seed(0)
    model = auto.from_config(cfg).eval()
    ids = torch.randint(3, min(vocab, 200), (2, 12), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids}
    if model_type == "whisper":  # audio in: log-mel features of 2 x max_source_positions frames
        inputs = {"input_features": torch.randn(2, cfg.num_mel_bins,
                                                2 * cfg.max_source_positions,
                                                generator=torch.Generator().manual_seed(0))}
    if seq2seq:
        inputs["decoder_input_ids"] = ids[:, :6]
    return model, inputs


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}"


def compile_eager(model: torch.nn.Module, inputs: dict) -> str | None:
    """None when ``torch.compile(model, backend="eager", fullgraph=True)`` runs on ``inputs``;
    else its error's first line."""
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, backend="eager", fullgraph=True)(**inputs)
    except Exception as exc:
        return _first(exc)
    return None


def probe(model_type: str, dtype: str) -> dict:
    """One row: ``verdict`` "ok", "fail" (with ``compile_eager``: None when the eager-backend
    torch.compile with fullgraph=True captures the model) or "skip" (no small config)."""
    import amprewrite
    from amprewrite.show.numerics import rel_err

    row: dict = {"model": model_type}
    try:
        model, inputs = build(model_type)
    except Exception as exc:
        return {**row, "verdict": "skip", "error": _first(exc)}
    row["use_cache"] = bool(getattr(model.config, "use_cache", False))  # MPT's default: off
    start = time.perf_counter()
    try:
        gm = amprewrite.transform(model, dtype, example_inputs=inputs)
        with torch.no_grad():
            got, want = gm(**inputs), model(**inputs)
    except Exception as exc:
        return {**row, "verdict": "fail", "seconds": round(time.perf_counter() - start, 2),
                "error": _first(exc), "compile_eager": compile_eager(model, inputs) or "ok"}
    return {**row, "verdict": "ok", "seconds": round(time.perf_counter() - start, 2),
            "logits_error": float(rel_err(got.logits, want.logits)),
            "outputs": ", ".join(f"{k}: {type(v).__name__}" for k, v in got.items())}


def _line(row: dict) -> str:
    name = f"{row['verdict']:5s} {row['model']:12s}"
    if row["verdict"] != "skip" and not row["use_cache"]:
        name += " (use_cache off by default)"
    if row["verdict"] == "skip":
        return f"{name} cannot build a small config: {row['error']}"
    if row["verdict"] == "ok":
        return (f"{name} {row['seconds']:5.1f} s  logits error {row['logits_error']:.2e}  "
                f"({row['outputs']})")
    eager = ("captures it" if row["compile_eager"] == "ok"
             else f"fails too: {row['compile_eager']}")
    return (f"{name} {row['seconds']:5.1f} s  {row['error']}\n      "
            f"torch.compile(backend='eager', fullgraph=True) {eager}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=CAUSAL + SEQ2SEQ)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--no-save", action="store_true",
                        help="print only; do not write docs/benchmarks/hf_defaults.{json,csv}")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    for model_type in args.models:
        rows.append(probe(model_type, args.dtype))
        print(_line(rows[-1]), flush=True)
    verdicts = [r["verdict"] for r in rows]
    summary = {"built": len(rows) - verdicts.count("skip"), "transformed": verdicts.count("ok"),
               "cache_on": sum(r.get("use_cache", False) for r in rows),
               "returned_cache": sum("Cache" in r.get("outputs", "") for r in rows),
               "failed": verdicts.count("fail"),
               "failed_where_compile_eager_captures": sum(
                   r["verdict"] == "fail" and r["compile_eager"] == "ok" for r in rows),
               "transformers": transformers.__version__, "dtype": args.dtype}
    print(f"\n{summary['transformed']} of {summary['built']} models transform "
          f"({verdicts.count('skip')} could not be built small); of the failures, "
          f"{summary['failed_where_compile_eager_captures']} where torch.compile(backend="
          f"'eager', fullgraph=True) captures the model; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    if not args.no_save:
        from benchmarks.common import save

        print("wrote", save("hf_defaults", rows, {"summary": summary}))


if __name__ == "__main__":
    main()
