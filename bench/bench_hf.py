"""hf backend speed on the tiny random-weight model: prompts/s for generate (32 new tokens) and score, at batch
size 1 against batched, over 64 prompts rendered from hand-made items (clean, type1, type2); and the minilm baseline.

Run: .venv/bin/python bench/bench_hf.py [--threads N]   (prints a table; nothing is asserted)
On a shared machine, pass --threads 1: OpenMP threads spin-waiting for a descheduled sibling make small
matrix products 100x slower when other processes load the cores (the load average is printed).
The tiny model is a chance-level control; these numbers measure the batching machinery, not a real model.
"""
import argparse, os, sys, tempfile, time
from pathlib import Path

from transformers.utils import logging as hf_logging
from medsafe_nb.models.base import GenRequest, ScoreRequest, make_backend
from medsafe_nb.models.hf import HFBackend
from medsafe_nb.protocols import render_messages, type1_target
from medsafe_nb.items.schema import Item
from medsafe_nb.testing.doubles import build_tiny_model

N, NEW_TOKENS, BATCHES = 64, 32, (1, 8, 32)
DRUGS = ["Lisinopril", "Hydrochlorothiazide", "Amlodipine", "Metoprolol", "Spironolactone", "Losartan"]


def items(n):
    "n/3 items, 4-6 options each, stems of varied length, a context sentence per option"
    out = []
    for i in range(n):
        opts = {chr(65 + j): DRUGS[(i + j) % len(DRUGS)] for j in range(4 + i % 3)}
        stem = "A 58-year-old man with type 2 diabetes and albuminuria has a blood pressure of 150/95 mmHg on three visits. " * (1 + i % 4)
        out.append(Item(f"b{i}", stem + "Which drug should be started first?", opts, ("A",),
                        contexts={k: f"Per the hospital SOP, {v} is first-line whenever albumin leaks into the urine." for k, v in opts.items()}))
    return out


def prompts(n):
    its = items(-(-n // 3))
    return [tuple(render_messages(it, c, type1_target(it) if c == "type1" else None)) for it in its for c in ("clean", "type1", "type2")][:n], its


def rate(fn, n):
    t0 = time.perf_counter(); got = dict(fn()); dt = time.perf_counter() - t0
    assert sorted(got) == list(range(n))
    return n / dt


def main():
    import torch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads: torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    hf_logging.disable_progress_bar()
    tiny = build_tiny_model(Path(tempfile.gettempdir()) / "medsafe_bench_tiny")
    msgs, its = prompts(N)
    gen_reqs = [GenRequest(m, max_new_tokens=NEW_TOKENS) for m in msgs]
    score_reqs = [ScoreRequest(m, its[i // 3].keys) for i, m in enumerate(msgs)]
    b0 = HFBackend(str(tiny))
    toks = [len(b0._encode([b0.prompt_text(m)])[0]) for m in msgs]
    print(f"tiny model ({sum(p.numel() for p in b0.lm.parameters()):,} params, CPU fp32), {N} prompts, "
          f"{min(toks)}-{max(toks)} prompt tokens, generate {NEW_TOKENS} new tokens")
    rows = []
    for bs in BATCHES:
        b = HFBackend(str(tiny), batch_size=bs)
        rate(lambda: b.score(score_reqs[:bs]), bs)                 # warm-up
        rows.append((bs, rate(lambda: b.generate(gen_reqs), N), rate(lambda: b.score(score_reqs), N)))
    print(f"{'batch':>6} {'generate/s':>11} {'x b1':>6} {'score/s':>9} {'x b1':>6}")
    for bs, g, s in rows:
        print(f"{bs:>6} {g:>11.1f} {g / rows[0][1]:>6.2f} {s:>9.1f} {s / rows[0][2]:>6.2f}")
    mini = make_backend("minilm")
    list(mini.generate(gen_reqs[:2]))                               # load the encoder
    print(f"minilm baseline: generate {rate(lambda: mini.generate(gen_reqs), N):.1f} prompts/s, "
          f"score {rate(lambda: mini.score(score_reqs), N):.1f} prompts/s")


if __name__ == "__main__":
    sys.exit(main())
