"""CPU inference speed before and after surgery, as ratios measured in one run on the same inputs.

Claim checked (essay, "Folding"): converting LayerNorm to RMSNorm losslessly is reported to give
2-12% end-to-end inference speedups; FlashNorm's gain folding removes the gain multiply. This
script measures what we get on this machine, whatever it is.

Variants (each verified against the baseline before it is timed; max_rel is reported):
  gpt2 baseline            stock transformers GPT-2 (torch LayerNorm)
  gpt2 fold                gains folded into consumers, weightless normatlas LayerNorms
  gpt2 ln->rms             centred writers, normatlas RMSNorms (runtime swaps)
  gpt2 ln->rms (stock LN)  the same weights in stock LayerNorms (control: LN on a centred stream)
  llama baseline / fold / fold+defer   the same for an RMSNorm model

Timing: forward passes under torch.inference_mode, variants interleaved in a fresh seeded order every round so machine
load affects all alike; the median of ``--repeats`` rounds is reported.

    .venv/bin/python benchmarks/surgery_speed.py [--layers 6 --width 512 --batch 4 --seq 128 --repeats 15]
"""

from __future__ import annotations

import argparse
import copy
import csv
import random
import statistics
import sys
import time

import torch


def _gpt2(layers: int, width: int, vocab: int) -> torch.nn.Module:
    import transformers as T

    cfg = T.GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=max(1, width // 64),
        vocab_size=vocab,
        n_positions=1024,
        bos_token_id=0,
        eos_token_id=0,
    )
    return T.GPT2LMHeadModel(cfg).eval()


def _llama(layers: int, width: int, vocab: int) -> torch.nn.Module:
    import transformers as T

    cfg = T.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        intermediate_size=width * 8 // 3,
        num_attention_heads=max(1, width // 64),
        num_key_value_heads=max(1, width // 64),
        vocab_size=vocab,
    )
    return T.LlamaForCausalLM(cfg).eval()


def _randomise(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)


def main(argv: list[str] | None = None) -> int:
    from normatlas.surgery import compare, deferred_runtime, fold_gains, ln_to_rms, probe_inputs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    variants: dict[str, tuple[str, torch.nn.Module]] = {}
    for family, build in (("gpt2", _gpt2), ("llama", _llama)):
        base = build(args.layers, args.width, args.vocab)
        _randomise(base)
        small = probe_inputs(base, length=16)
        variants[f"{family} baseline"] = (family, base)
        fold = fold_gains(base, small, defer=family == "llama")
        variants[f"{family} fold"] = (family, fold.runtime())
        if family == "llama":
            variants["llama fold+defer"] = (family, deferred_runtime(fold))
        else:
            conv = ln_to_rms(base, small)
            variants["gpt2 ln->rms"] = (family, conv.runtime())
            variants["gpt2 ln->rms (stock LN)"] = (family, copy.deepcopy(conv.stock))

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    inputs = {"input_ids": ids, "use_cache": False}
    rows = []
    errors = {}
    for name, (family, model) in variants.items():
        base = variants[f"{family} baseline"][1]
        errors[name] = compare(base, model, inputs, torch.float32).max_rel
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for _, model in variants.values():  # warm-up
            model(**inputs)
        order = list(variants.items())
        shuffle = random.Random(0).shuffle
        for _ in range(args.repeats):
            shuffle(order)  # a fresh order every round: no variant keeps the same predecessor
            for name, (_, model) in order:
                t0 = time.perf_counter()
                model(**inputs)
                times[name].append(time.perf_counter() - t0)
    for name, (family, _) in variants.items():
        med = statistics.median(times[name])
        base = statistics.median(times[f"{family} baseline"])
        rows.append(
            {
                "variant": name,
                "median_ms": f"{med * 1e3:.2f}",
                "speedup": f"{base / med:.3f}",
                "max_rel_vs_baseline": f"{errors[name]:.2g}",
            }
        )
    print(
        f"# layers={args.layers} width={args.width} batch={args.batch} seq={args.seq} "
        f"repeats={args.repeats} threads={torch.get_num_threads()} torch={torch.__version__}"
    )
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    print("  ".join(k.ljust(w) for k, w in widths.items()))
    for r in rows:
        print("  ".join(str(r[k]).ljust(w) for k, w in widths.items()))
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
