"""The real model's scoring speed: SmolLM2-135M-Instruct (`smollm2`) on sample prompts, option scoring (the likelihood
of each option's text, one prompt pass shared by its options) and letter scoring (the next-token probability of each
option key), in prompts/s, against lm-eval's HFLM on the same model (the cached safetensors copy) and the same
prompts, with its requests as lm-eval's `multiple_choice` issues them: one loglikelihood request per option.

Run: .venv/bin/python bench/bench_real.py [--rounds 3] [--threads N] [--items 12] [--quick]   (prints a table; nothing is asserted)
lm-eval runs in .venv-harness (`make harness-env`); without it its rows say so. `--quick`: 3 items, one round (checks
that the bench runs). On a shared machine the numbers move with the load: the load average is printed.
"""
import argparse, os, statistics, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def main():
    import torch
    from transformers.utils import logging as hf_logging
    from medsafe_nb.items.release import load_medmisbench
    from medsafe_nb.models.base import ScoreRequest, make_backend
    from medsafe_nb.protocols import build_prompts, ANSWER_PREFIX
    from bench import HFLMWorker                             # bench/bench.py: lm-eval's HFLM in the side venv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--items", type=int, default=12, help="single-answer sample items (x clean, type1, type2)")
    ap.add_argument("--quick", action="store_true", help="3 items, one round: check that it runs")
    ap.add_argument("--skip", default="", help="comma-separated: hflm")
    args, _ = ap.parse_known_args()                           # `make bench` passes bench.py's options too
    if args.quick: args.items, args.rounds = 3, 1
    if args.threads: torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    sm = make_backend("smollm2")
    items = [it for it in load_medmisbench("all", "sample") if not it.is_multi][:args.items]
    by_id = {it.id: it for it in items}
    ps = build_prompts(items, ["clean", "type1", "type2"])
    texts = [sm.prompt_text(p.messages, thinking=False) for p in ps]
    opts = [tuple(by_id[p.item_id].options[k] for k in p.keys) for p in ps]
    opt_reqs = [ScoreRequest(p.messages, p.keys, prefix="", continuations=o) for p, o in zip(ps, opts)]
    key_reqs = [ScoreRequest(p.messages, p.keys) for p in ps]
    lengths = [len(e) for e in sm._encode(texts)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"smollm2 ({sm.identity()['model']}, {sm.dtype}), {len(ps)} prompts, {min(lengths)}-{max(lengths)} tokens, "
          f"{sum(map(len, opts))} options; {args.rounds} round(s)", flush=True)
    workers = {}
    if "hflm" not in args.skip.split(","):
        py = ROOT / ".venv-harness" / "bin" / "python"
        if py.exists():
            model = sm.gguf["checkpoint"]
            for name, ctx, conts in (("options", texts, opts), ("letter", [t + ANSWER_PREFIX for t in texts], [p.keys for p in ps])):
                try: workers[name] = HFLMWorker(str(py), model, ctx, conts, args.threads)
                except Exception as e: print(f"lm-eval HFLM ({name}): not measured ({e}); run `make harness-env`")
        else: print("lm-eval HFLM: not measured: no .venv-harness (run `make harness-env`)")
    best = lambda res: [max(s.logprobs, key=s.logprobs.get) for _, s in sorted(res.items())]
    runs = {"options": lambda: best(dict(sm.score(opt_reqs))), "letter": lambda: best(dict(sm.score(key_reqs)))}
    R, answers = {k: [] for k in ("options", "letter", "hflm_options", "hflm_letter")}, {}
    for _ in range(args.rounds):                              # interleaved, so a load change hits every row alike
        for name, fn in runs.items():
            t0 = time.perf_counter(); answers[name] = fn(); R[name].append(time.perf_counter() - t0)
        for name, w in workers.items():
            dt, got = w.run(); R[f"hflm_{name}"].append(dt)
            answers[f"hflm_{name}"] = [p.keys[o.index(a)] if name == "options" else a for p, o, a in zip(ps, opts, got)]
    for w in workers.values(): w.close()
    n = len(ps)
    print(f"\n{'scoring':44s} {'prompts/s':>10s}  vs lm-eval   answers agree")
    for name, label in (("options", "options: medsafe (prompt once, options batched)"), ("hflm_options", "options: lm-eval HFLM, one request per option"),
                        ("letter", "letter: medsafe (one pass per prompt)"), ("hflm_letter", "letter: lm-eval HFLM, one request per key")):
        if not R[name]: print(f"{label:44s} {'-':>10s}"); continue
        rate = n / statistics.median(R[name])
        peer = R.get(f"hflm_{name}")
        ratio = f"{statistics.median(peer) / statistics.median(R[name]):.2f}x" if peer else ""
        base = name.replace("hflm_", "")
        agree = f"{sum(a == b for a, b in zip(answers[name], answers[base]))}/{n}" if name.startswith("hflm") else ""
        print(f"{label:44s} {rate:10.2f}  {ratio:>9s}   {agree}")
    sm.close()


if __name__ == "__main__":
    main()
