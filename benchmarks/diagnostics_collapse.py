"""Provoked failure: attention entropy collapse in a tiny LM at a high learning rate, with and without QK-norm.

Claim: without QK-norm the Monitor's entropy-collapse alarm fires before the loss spikes;
with QK-norm neither happens (same seed, data, schedule). Seconds on a CPU.

Setup (see ``normatlas.diagnostics.tinylm.collapse_experiment``): TinyLM (2 Pre-LN layers,
d_model 64, 4 heads, RMSNorm), ``bag_batches`` (each sequence draws from its own 4 tokens,
so uniform attention is optimal), AdamW peak LR 0.1 after 100 warmup steps, 160 steps,
batch 32. Loss spike = EMA(0.1) of the loss 0.2 nats above its running minimum.

Command: ``.venv/bin/python benchmarks/diagnostics_collapse.py``
"""

from __future__ import annotations

import time

import torch

from normatlas.diagnostics.tinylm import collapse_experiment


def main() -> None:
    torch.set_num_threads(1)
    for qk in (False, True):
        t0 = time.perf_counter()
        r = collapse_experiment(qk_norm=qk)
        mon = r["monitor"]
        ent = [v for k, v in mon.last.items() if k.startswith("attention/entropy_norm/")]
        logit = [v for k, v in mon.last.items() if k.startswith("attention/max_logit/")]
        print(
            f"qk_norm={qk!s:5}  entropy-collapse alarm at step {r['alarm_step']}  "
            f"loss spike at step {r['spike_step']}  "
            f"min loss {min(r['losses']):.3f}  final loss {r['losses'][-1]:.3f}  "
            f"final min normalized entropy {min(ent):.3f}  final max logit {max(logit):.1f}  "
            f"({time.perf_counter() - t0:.1f} s)"
        )


if __name__ == "__main__":
    main()
