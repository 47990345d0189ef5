"""The real model's speed: SmolLM2-135M-Instruct (`smollm2`: the packaged GGUF, dequantized to fp32 and cached as
safetensors) on the sample's single-answer items under clean, type1 and type2, as one table measured in one run.

- option scoring (`ScoreRequest(continuations=option texts)`: the summed log-likelihood of each option's text, the
  prompt read once and the options batched on its cache) and letter scoring (the next-token log-probability of each
  option key after the answer prefix), in prompts/s, against lm-eval's HFLM on the same weights (the cached
  safetensors folder) and prompts, its requests as lm-eval's `multiple_choice` issues them (one loglikelihood
  request per option, batch 1), in the side venv `.venv-harness` (`make harness-env`): the ratio, how many prompts
  get the same answer, and MFU (the job's model FLOPs / time / the fp32 matmul peak; `option_flops` says what an
  option-scoring prompt counts);
- greedy generation (`--gen-prompts` prompts, at most `--new-tokens` new tokens) against bench.py's `naive_generate`
  (one `generate` per prompt): tok/s of the tokens generated, the ratio, identical texts, and the fraction of the
  job's roofline (`RealShape.roofline_replies`: each reply's own length, on the memory bandwidth measured here);
- vLLM (`.venv-vllm`, `make vllm`: `smollm2_vllm`, the same safetensors in fp32, prefix caching off so that every
  round computes every prompt, as in-process does) against in-process, in rounds of their own once the server is
  healthy and has answered two untimed requests of each kind: letter scoring (prompts/s, answers agreeing, the
  largest |difference| of the log-probability of the key in-process chose, MFU) and generation (tok/s, identical
  texts, fraction of the roofline); each disagreement is printed with both backends' log-probability margins (for a
  reply, at its first differing token); then option scoring on the engine (`prompt_logprobs`, one request per
  option, the token ids in-process reads) against in-process, one timed pass each: rate, answers, and the largest
  |difference| of an option's summed log-probability. `--skip vllm`, or no .venv-vllm: its row says why not.

The in-process methods run once per round, the rounds interleave them (the order reversed every other round) and
print as they finish; the table shows medians over the rounds. The fp32 matmul peak is sampled before every method
and the memory bandwidth once per round (bench.py's `matmul_peak` and `memory_bandwidth`); the bounds are the best
samples. On this shared machine the absolute numbers move with the load (printed at the start and the end); read the
ratios. Nothing is asserted.

    .venv/bin/python bench/bench_real.py [--rounds 2] [--threads N] [--items 12] [--gen-prompts 12] [--new-tokens 32]
                                         [--skip hflm,gen,vllm] [--quick [--vllm]]

`--quick`: 3 items, 3 generation prompts, one round, no vLLM unless `--vllm`: checks the script end to end. On a
loaded machine pass --threads 1 (two OpenMP threads with a descheduled sibling are many times slower than one).
"""
import argparse, os, statistics, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench import Shape, HFLMWorker, best_keys, matmul_peak, memory_bandwidth, naive_generate, table, timed   # bench/bench.py

med = statistics.median


class RealShape(Shape):
    "bench.py's `Shape` (a tied output matrix, SmolLM2's, counted in the bytes a step reads), with replies of their own lengths"
    def step(self, ctx:list)->tuple:
        "FLOPs and bytes of one decoding step of a batch whose rows hold `ctx` tokens each (as in `Shape.roofline`)"
        flops = sum(2 * self.params + 4 * self.layers * c * self.d + 2 * self.d * self.vocab for c in ctx)
        return flops, self.weight_bytes + sum(c * self.layers * 2 * self.kv * 4 for c in ctx)

    def roofline_replies(self, lengths:list, new:list, peak:float, bandwidth:float)->float:
        """Seconds at best for prompts of `lengths` tokens whose replies have `new` tokens each: prefill at the peak
        (it yields each reply's first token), then one decoding step per further token, a finished reply leaving the
        batch; a step costs the larger of its FLOPs at the peak and its bytes at the bandwidth"""
        t = sum(self.prefill(n) for n in lengths) / peak
        for s in range(max(new, default=1) - 1):
            flops, byts = self.step([n + s for n, k in zip(lengths, new) if k > s + 1])
            t += max(flops / peak, byts / bandwidth)
        return t


def option_flops(shape:Shape, n:int, conts:list)->float:
    """Model FLOPs of option scoring one prompt of `n` tokens with options of token ids `conts`: the prompt's prefill
    (`Shape.prefill`: its one row of logits scores every option's first token), then, per option, each token but the
    last (the last is only scored, never read) on the prompt's cache: the linear layers, attention over the prompt
    and the option's earlier tokens (4 d FLOPs per layer and attended position, as `Shape.prefill` counts), and one
    row of logits. Padding the options to one length is the method's cost, not the job's: not counted."""
    f = shape.prefill(n)
    for c in conts:
        f += sum(2 * shape.params + 4 * shape.layers * shape.d * (n + i + 1) + 2 * shape.d * shape.vocab for i in range(len(c) - 1))
    return f


def margin(logprobs:dict)->float:
    "How far the chosen key's log-probability is above the runner-up's"
    v = sorted(logprobs.values(), reverse=True)
    return v[0] - v[1] if len(v) > 1 else float("inf")


def reply_divergence(sm, v, p, text_in:str, text_v:str)->str:
    """Where two replies to prompt `p` first differ (in the in-process tokenizer's tokens of the texts): the common
    start, each side's next token, and each backend's log-probability of its own token minus the other's there"""
    from medsafe_nb.models.base import ScoreRequest
    import torch
    tok = sm.tokenizer
    a, b = tok(text_in, add_special_tokens=False).input_ids, tok(text_v, add_special_tokens=False).input_ids
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    eos = tok.eos_token_id
    ta, tb = (a[j] if j < len(a) else eos), (b[j] if j < len(b) else eos)
    ctx = sm._encode([sm.prompt_text(p.messages)])[0] + a[:j]
    with torch.inference_mode(): lp = sm.lm(input_ids=torch.tensor([ctx])).logits[0, -1].float().log_softmax(-1)
    m_in = (lp[ta] - lp[tb]).item()
    ka, kb = tok.decode([ta]).strip(), tok.decode([tb]).strip()   # vLLM's top tokens are matched on their stripped text
    m_v = "n/a (the two tokens differ only in spaces)"
    if ka and kb and ka != kb:
        s = dict(v.score([ScoreRequest(p.messages, (kb, ka), prefix=tok.decode(a[:j]))]))[0]
        m_v = f"{s.logprobs[kb] - s.logprobs[ka]:+.3f}" if not s.error else f"n/a ({s.error})"
    return (f"after {tok.decode(a[:j])!r}: in-process {tok.decode([ta])!r} (margin {m_in:+.3f}), "
            f"vLLM {tok.decode([tb])!r} (margin {m_v})")


def bench_vllm(sm, ps, key_reqs, gen_reqs, new, rounds, letter_flops, gen_lengths, peak, bw, shape, opt_reqs, opt_flops):
    "vLLM against in-process on the real model: letter scoring and generation in rounds of their own, then option scoring once"
    from medsafe_nb.models.vllm import find_vllm_python
    from medsafe_nb.models.hf import smollm2_vllm
    import torch
    not_measured = lambda why: [("vLLM, letter scoring and generation", "vLLM server (.venv-vllm)", "not measured", why, "")]
    try: find_vllm_python()
    except Exception as e: print(f"vLLM: not measured ({e})"); return not_measured(str(e).split(", or ")[0])
    out = Path(tempfile.mkdtemp(prefix="medsafe-bench-real-vllm-"))
    n = torch.get_num_threads()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if n == 1 else f"0-{n - 1}")   # as many threads as in-process
    print(f"vLLM: starting the server (log in {out}) ...", flush=True)
    t0 = time.perf_counter()
    args = {"max_model_len": 4096, "vllm_args": "--no-enable-prefix-caching"}   # every round computes every prompt, as in-process does
    try: v = smollm2_vllm(run_dir=out, model_args=args, max_new_tokens=new, startup_timeout=480)
    except Exception as e:
        print(f"vLLM: not measured: the server did not start ({type(e).__name__}: {str(e)[:300]}); log in {out}")
        return not_measured(f"the server did not start ({type(e).__name__}); log in {out}")
    print(f"  vLLM server healthy after {time.perf_counter() - t0:.0f} s", flush=True)
    try: return (vllm_rows(v, sm, ps, key_reqs, gen_reqs, new, rounds, letter_flops, gen_lengths, peak, bw, shape)
                 + vllm_option_rows(v, sm, ps, opt_reqs, opt_flops, peak))
    except Exception as e:                                     # the server died or refused: the rest of the table still prints
        print(f"vLLM: measurement failed ({type(e).__name__}: {str(e)[:300]}); log in {out}")
        return not_measured(f"failed ({type(e).__name__}); log in {out}")
    finally:
        v.close()


def vllm_rows(v, sm, ps, key_reqs, gen_reqs, new, rounds, letter_flops, gen_lengths, peak, bw, shape):
    "The vLLM rounds (vLLM and in-process interleaved, the order reversed every other round) and their table rows"
    R, got = {k: [] for k in ("v_letter", "i_letter", "v_gen", "i_gen")}, {}
    list(v.score(key_reqs[:2])); list(v.generate(gen_reqs[:2]))   # untimed: the server's first requests (in-process is warm already)
    runs = [("v_letter", lambda: dict(v.score(key_reqs))), ("i_letter", lambda: dict(sm.score(key_reqs))),
            ("v_gen", lambda: dict(v.generate(gen_reqs))), ("i_gen", lambda: dict(sm.generate(gen_reqs)))]
    for r in range(rounds):
        for k, fn in (runs if r % 2 == 0 else runs[::-1]):
            dt, o = timed(fn); R[k].append(dt); got.setdefault(k, o)
        print(f"  vLLM round {r + 1}: " + ", ".join(f"{k} {x[-1]:.2f}s" for k, x in R.items()), flush=True)
    N, G = len(key_reqs), len(gen_reqs)
    vs, ins = got["v_letter"], got["i_letter"]
    v_ans = [max(vs[i].logprobs, key=vs[i].logprobs.get) if vs[i].logprobs else None for i in range(N)]   # None: a failed request
    i_ans = best_keys(ins)
    s_agree = sum(a == b for a, b in zip(v_ans, i_ans))
    errors = sum(bool(vs[i].error) for i in range(N))
    diffs = [abs(vs[i].logprobs.get(k, float("-inf")) - ins[i].logprobs[k]) for i, k in enumerate(i_ans)]
    finite = [d for d in diffs if d != float("inf")]
    out_of_top = len(diffs) - len(finite)
    v_text = [got["v_gen"][i].text for i in range(G)]
    i_text = [got["i_gen"][i].text for i in range(G)]
    g_agree = sum(a == b for a, b in zip(v_text, i_text))
    for i in range(N):
        if v_ans[i] != i_ans[i]:
            print(f"  letter disagreement, {ps[i].item_id} {ps[i].condition}: in-process {i_ans[i]} (margin {margin(ins[i].logprobs):.3f}), "
                  f"vLLM {v_ans[i]} (margin {margin(vs[i].logprobs):.3f})" + (f"; vLLM: {vs[i].error}" if vs[i].error else ""))
    for i in range(G):
        if v_text[i] != i_text[i]:
            print(f"  text disagreement, {ps[i].item_id} {ps[i].condition}: {reply_divergence(sm, v, ps[i], i_text[i], v_text[i])}")
    v_tokens = sum(g.completion_tokens or 0 for g in got["v_gen"].values())
    i_tokens = sum(g.completion_tokens or 0 for g in got["i_gen"].values())
    v_bound = shape.roofline_replies(gen_lengths, [got["v_gen"][i].completion_tokens or 1 for i in range(G)], peak, bw)
    lp_diff = (f"max |d log p| of in-process's chosen key {max(finite):.1e}" if finite else "no chosen key in vLLM's top logprobs") + \
              (f" ({out_of_top} outside vLLM's top logprobs)" if finite and out_of_top else "") + (f", {errors} vLLM errors" if errors else "")
    return [(f"vLLM, letter scoring, {N} prompts", "vLLM server (top-100 logprobs), concurrency 64", f"{N / med(R['v_letter']):.2f} prompts/s",
             f"{med(R['i_letter']) / med(R['v_letter']):.2f}x in-process ({N / med(R['i_letter']):.2f} prompts/s beside it), "
             f"answers {s_agree}/{N}, {lp_diff}", f"MFU {letter_flops / med(R['v_letter']) / peak:.2f} (fp32 peak)"),
            (f"vLLM, generation, {G} x <= {new} tokens", "vLLM server, concurrency 64", f"{v_tokens / med(R['v_gen']):.1f} tok/s",
             f"{(v_tokens / med(R['v_gen'])) / (i_tokens / med(R['i_gen'])):.2f}x in-process ({i_tokens / med(R['i_gen']):.1f} tok/s beside it), "
             f"texts {g_agree}/{G}", f"{v_bound / med(R['v_gen']):.2f} of roofline")]


def vllm_option_rows(v, sm, ps, opt_reqs, opt_flops, peak):
    """Option scoring on vLLM (`prompt_logprobs` on /completions, one request per option, the same token ids as
    in-process) against in-process, one timed pass each: the rate, the answers, the largest |difference| of an
    option's summed log-probability"""
    list(v.score(opt_reqs[:1]))                                 # untimed: the first completions request
    dt_v, vs = timed(lambda: dict(v.score(opt_reqs)))
    dt_i, ins = timed(lambda: dict(sm.score(opt_reqs)))
    N = len(opt_reqs)
    errors = sum(bool(vs[i].error) for i in range(N))
    v_ans = [max(vs[i].logprobs, key=vs[i].logprobs.get) if vs[i].logprobs else None for i in range(N)]
    i_ans = best_keys(ins)
    diffs = [abs(vs[i].logprobs[k] - ins[i].logprobs[k]) for i in range(N) if vs[i].logprobs for k in ins[i].logprobs]
    for i in range(N):
        if v_ans[i] != i_ans[i]:
            print(f"  option disagreement, {ps[i].item_id} {ps[i].condition}: in-process {i_ans[i]} (margin {margin(ins[i].logprobs):.3f}), "
                  f"vLLM {v_ans[i]}" + (f" (margin {margin(vs[i].logprobs):.3f})" if vs[i].logprobs else f": {vs[i].error}"))
    print(f"  vLLM option scoring: {dt_v:.2f}s, in-process beside it {dt_i:.2f}s", flush=True)
    return [(f"vLLM, option scoring, {N} prompts", "vLLM server (prompt_logprobs, one request per option), one pass", f"{N / dt_v:.2f} prompts/s",
             f"{dt_i / dt_v:.2f}x in-process ({N / dt_i:.2f} prompts/s beside it), answers {sum(a == b for a, b in zip(v_ans, i_ans))}/{N}, "
             f"max |d log p| over {len(diffs)} options {max(diffs, default=float('nan')):.1e}" + (f", {errors} vLLM errors" if errors else ""),
             f"MFU {opt_flops / dt_v / peak:.2f} (fp32 peak)")]


def main():
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (medians over them)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--items", type=int, default=12, help="single-answer sample items (x clean, type1, type2)")
    ap.add_argument("--gen-prompts", type=int, default=12, help="prompts of the generation job (the first of the scoring prompts)")
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per reply at most")
    ap.add_argument("--quick", action="store_true", help="3 items, 3 generation prompts, one round, no vLLM: check that it runs")
    ap.add_argument("--vllm", action="store_true", help="with --quick: run the vLLM part too")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: hflm, gen, vllm")
    args, _ = ap.parse_known_args()                           # `make bench` passes bench.py's options too
    skip = set(filter(None, args.skip.split(",")))
    if args.quick:
        args.items, args.rounds, args.gen_prompts = 3, 1, min(args.gen_prompts, 3)
        if not args.vllm: skip.add("vllm")
    import torch
    if args.threads: torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging
    from medsafe_nb.items.release import load_medmisbench
    from medsafe_nb.models.base import GenRequest, ScoreRequest, make_backend
    from medsafe_nb.protocols import build_prompts, ANSWER_PREFIX
    hf_logging.disable_progress_bar()
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {load:.1f} on {os.cpu_count()} cores"
          + ("  (busy: --threads 1 is faster here)" if load >= os.cpu_count() and torch.get_num_threads() > 1 else ""), flush=True)

    sm = make_backend("smollm2", max_new_tokens=args.new_tokens)
    shape = RealShape(sm.lm)
    items = [it for it in load_medmisbench("all", "sample") if not it.is_multi][:args.items]
    by_id = {it.id: it for it in items}
    ps = build_prompts(items, ["clean", "type1", "type2"])
    N = len(ps)
    texts = [sm.prompt_text(p.messages, thinking=False) for p in ps]    # option scoring's contexts (prefix "")
    opts = [tuple(by_id[p.item_id].options[k] for k in p.keys) for p in ps]
    opt_reqs = [ScoreRequest(p.messages, p.keys, prefix="", continuations=o) for p, o in zip(ps, opts)]
    key_reqs = [ScoreRequest(p.messages, p.keys) for p in ps]
    letter_texts = [t + ANSWER_PREFIX for t in texts]
    enc, letter_lengths = sm._encode(texts), [len(e) for e in sm._encode(letter_texts)]
    conts = [[sm._continuation_tokens(t, e, o) for o in options] for t, e, options in zip(texts, enc, opts)]
    opt_flops = sum(option_flops(shape, len(e), cs) for e, cs in zip(enc, conts))
    letter_flops = sum(shape.prefill(n) for n in letter_lengths)
    gen_ps = ps[:args.gen_prompts]
    gen_reqs = [GenRequest(p.messages, max_new_tokens=args.new_tokens) for p in gen_ps]
    gen_texts = [sm.prompt_text(p.messages) for p in gen_ps]
    gen_lengths = [len(e) for e in sm._encode(gen_texts)]
    G = len(gen_ps)
    print(f"smollm2 ({sm.identity()['model']}, {sm.dtype}, {shape.params / 1e6:.0f} M non-embedding parameters); "
          f"scoring: {N} prompts ({len(items)} items x clean, type1, type2), {min(map(len, enc))}-{max(map(len, enc))} tokens, "
          f"{sum(map(len, opts))} options of {min(len(c) for cs in conts for c in cs)}-{max(len(c) for cs in conts for c in cs)} tokens; "
          f"generation: {G} prompts x <= {args.new_tokens} new tokens; {args.rounds} round(s)", flush=True)

    workers, hflm_why = {}, None
    if "hflm" in skip: hflm_why = "not measured (--skip hflm)"
    elif not (py := ROOT / ".venv-harness" / "bin" / "python").exists(): hflm_why = "not measured: no .venv-harness (`make harness-env`)"
    else:
        model = sm.gguf["checkpoint"]                             # the cached safetensors copy: the same weights
        for name, ctx, cands in (("options", texts, opts), ("letter", letter_texts, [p.keys for p in ps])):
            try: workers[name] = HFLMWorker(str(py), model, ctx, cands, args.threads)
            except Exception as e: hflm_why = f"not measured ({e}); `make harness-env`"
    if hflm_why: print(f"lm-eval HFLM: {hflm_why}", flush=True)

    def hflm_run(name):
        dt, got = workers[name].run()
        return dt, [p.keys[o.index(a)] if name == "options" else a for p, o, a in zip(ps, opts, got)]

    methods = [("options", lambda: timed(lambda: best_keys(dict(sm.score(opt_reqs)))))]
    if "options" in workers: methods.append(("hflm_options", lambda: hflm_run("options")))
    methods.append(("letter", lambda: timed(lambda: dict(sm.score(key_reqs)))))
    if "letter" in workers: methods.append(("hflm_letter", lambda: hflm_run("letter")))
    if "gen" not in skip:
        methods += [("gen", lambda: timed(lambda: dict(sm.generate(gen_reqs)))),
                    ("gen_naive", lambda: timed(lambda: naive_generate(sm.lm, sm.tokenizer, gen_texts, args.new_tokens)))]
    R = {k: [] for k in ("peak", "bw", *(m for m, _ in methods))}
    got = {}
    for r in range(args.rounds):
        R["bw"].append(memory_bandwidth())
        for name, fn in (methods if r % 2 == 0 else methods[::-1]):   # the order reversed every other round
            R["peak"].append(matmul_peak(torch.float32, seconds=0.15))   # before every method: the best one is the peak
            dt, out = fn(); R[name].append(dt); got.setdefault(name, out)
        print(f"  round {r + 1}: " + ", ".join(f"{m} {R[m][-1]:.1f}s" for m, _ in methods)
              + f" ({time.perf_counter() - t_start:.0f} s so far)", flush=True)
    for w in workers.values(): w.close()
    varied = [f"{m} {max(R[m]) / min(R[m]):.1f}x" for m, _ in methods if max(R[m]) > 1.5 * min(R[m])]
    if varied: print(f"  note: the rounds differ by more than 1.5x ({', '.join(varied)}): the load changed; "
                     "the medians carry it (rerun with more --rounds, or --threads 1 on a busy machine)", flush=True)

    peak, bw = max(R["peak"]), max(R["bw"])
    print(f"  peak fp32 {peak / 1e9:.0f} GFLOP/s (median sample {med(R['peak']) / 1e9:.0f}), memory {bw / 1e9:.1f} GB/s", flush=True)
    letter_ans = best_keys(got["letter"])
    rows = []
    for part, key, flops, label, peer_label, ans in (
            (f"option scoring, {N} prompts", "options", opt_flops, "medsafe (prompt once, options on its cache)",
             "lm-eval HFLM, one request per option, bs 1", got["options"]),
            (f"letter scoring, {N} prompts", "letter", letter_flops, "medsafe (one pass per prompt)",
             "lm-eval HFLM, one request per key, bs 1", letter_ans)):
        dt = med(R[key])
        peer = R.get(f"hflm_{key}")
        if peer:
            same = sum(a == b for a, b in zip(ans, got[f"hflm_{key}"]))
            target = " (target >= 3x, identical)" if key == "options" else ""
            ratio = f"{med(peer) / dt:.2f}x lm-eval, answers {same}/{N} identical{target}"
        else: ratio = f"lm-eval {hflm_why}"
        rows.append((part, label, f"{N / dt:.2f} prompts/s", ratio, f"MFU {flops / dt / peak:.2f} (fp32 peak)"))
        if peer: rows.append((part, peer_label, f"{N / med(peer):.2f} prompts/s", "", f"MFU {flops / med(peer) / peak:.2f} (fp32 peak)"))
    if "gen" in skip: rows.append(("generation", "medsafe generate", "not measured", "(--skip gen)", ""))
    else:
        gens = got["gen"]
        new = [gens[i].completion_tokens or 1 for i in range(G)]
        tokens = sum(new)
        bound = shape.roofline_replies(gen_lengths, new, peak, bw)
        same = sum(gens[i].text == t for i, t in enumerate(got["gen_naive"]))
        part = f"generation, {G} x <= {args.new_tokens} tokens ({tokens} generated)"
        rows.append((part, "medsafe generate (auto batch)", f"{tokens / med(R['gen']):.1f} tok/s",
                     f"{med(R['gen_naive']) / med(R['gen']):.2f}x naive, texts {same}/{G} identical", f"{bound / med(R['gen']):.2f} of roofline"))
        rows.append((part, "naive per-prompt generate (bench.py)", f"{tokens / med(R['gen_naive']):.1f} tok/s", "", f"{bound / med(R['gen_naive']):.2f} of roofline"))
        print(f"  roofline of the generation job: {bound:.2f} s; replies of {min(new)}-{max(new)} tokens, {sum(k == args.new_tokens for k in new)} at the cap", flush=True)
    if "vllm" in skip: rows.append(("vLLM, letter scoring and generation", "vLLM server (.venv-vllm)", "not measured", "(--skip vllm)", ""))
    else: rows += bench_vllm(sm, ps, key_reqs, gen_reqs, args.new_tokens, args.rounds, letter_flops, gen_lengths, peak, bw, shape, opt_reqs, opt_flops)
    sm.close()
    print()
    print(table(rows))
    print(f"\n(medians of interleaved rounds; bounds measured in this run, the best of all samples: fp32 matmul peak "
          f"{peak / 1e9:.0f} GFLOP/s, memory bandwidth {bw / 1e9:.1f} GB/s; {torch.get_num_threads()} thread(s); "
          f"load average {os.getloadavg()[0]:.1f} at the end; {time.perf_counter() - t_start:.0f} s in all)")


if __name__ == "__main__":
    main()
