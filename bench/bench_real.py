"""The real model's speed: SmolLM2-135M-Instruct (`smollm2`: the packaged GGUF, dequantized to fp32 and cached as
safetensors) on the sample's single-answer items under clean, type1 and type2, each row printed as it is measured,
then one table whose last column says which goal each row met or missed.

- option scoring (`ScoreRequest(continuations=option texts)`: the summed log-likelihood of each option's text, the
  prompt and every option read in one forward pass) and letter scoring (the next-token log-probability of each
  option key after the answer prefix), in prompts/s, against lm-eval's HFLM on the same weights (the cached
  safetensors folder) and prompts, its requests as lm-eval's `multiple_choice` issues them (one loglikelihood
  request per option, batch 1), in the side venv `.venv-harness` (`make harness-env`): the ratio, how many prompts
  get the same answer, and MFU (the job's model FLOPs / time / the fp32 matmul peak; `option_flops` says what an
  option-scoring prompt counts). Goals: MFU >= 0.6 for both; option scoring >= 3x lm-eval with the same answers;
- greedy generation (`--gen-prompts` prompts, at most `--new-tokens` new tokens) against bench.py's `naive_generate`
  (one `generate` per prompt): tok/s of the tokens generated, the ratio, identical texts, and the fraction of the
  job's roofline (`RealShape.roofline_replies`: each reply's own length, on the memory bandwidth measured here);
  goal >= 0.6 of the roofline;
- vLLM (`.venv-vllm`, `make vllm`: `smollm2_vllm`, the same safetensors in fp32, its default flags, prefix caching
  on) against in-process, interleaved in rounds of their own once the server is healthy and has answered untimed
  requests of each kind: letter scoring, generation and option scoring (each prompt read once, its options
  continuing it from the prefix cache: `VLLMBackend.score`). Every vLLM pass sends its own `cache_salt`, so a pass
  finds no prompt of an earlier pass in the cache and computes every prompt, as in-process does; within a pass the
  options of a prompt share its cached prefix. Rows: the rate, answers (or texts) agreeing, the largest |difference|
  of a log-probability; each disagreement is printed with both backends' margins. Goal: option scoring >= 1.0x
  in-process with the same answers. `--skip vllm`, or no .venv-vllm: its rows say why not.

Each method starts on a quiet CPU (bench.py's `settle`: a vLLM server's threads poll for a second after its last
request, and would share the CPU with the method after it). The fp32 matmul peak is sampled at the start and before
every method, the memory bandwidth at the start and once per round (bench.py's `matmul_peak` and
`memory_bandwidth`); a row uses the best samples so far. On this shared machine
the absolute numbers move with the load (printed with every row): read the ratios, and rerun with `--rounds 3` on a
quiet machine for figures to keep. Nothing is asserted. The defaults fit in `--budget` (300 s): a part that would
start after it is not measured, and its row says so. SIGTERM, SIGHUP or Ctrl-C stop the script with the vLLM server
and the lm-eval workers it started.

    .venv/bin/python bench/bench_real.py [--rounds 1] [--threads N] [--items 6] [--gen-prompts 6] [--new-tokens 32]
                                         [--budget 300] [--skip hflm,gen,vllm] [--quick [--vllm]]

`--quick`: 2 items, 2 generation prompts, one round, no vLLM unless `--vllm`: checks the script end to end. On a
loaded machine pass --threads 1 (two OpenMP threads with a descheduled sibling are many times slower than one).
"""
import argparse, os, statistics, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench import Shape, HFLMWorker, Report, best_keys, matmul_peak, memory_bandwidth, naive_generate, settle, stop_on_signals, timed   # bench/bench.py

med = statistics.median
T0 = time.perf_counter()


def load()->str:
    "The load average now and the seconds since the start, as every printed figure carries them"
    return f"load {os.getloadavg()[0]:.1f}, {time.perf_counter() - T0:.0f} s"


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
    last (the last is only scored, never read) after the prompt: the linear layers, attention over the prompt and the
    option's earlier tokens (4 d FLOPs per layer and attended position, as `Shape.prefill` counts), and one row of
    logits. Attention between two options (masked) is the method's cost, not the job's: not counted."""
    f = shape.prefill(n)
    for c in conts:
        f += sum(2 * shape.params + 4 * shape.layers * shape.d * (n + i + 1) + 2 * shape.d * shape.vocab for i in range(len(c) - 1))
    return f


def margin(logprobs:dict)->float:
    "How far the chosen key's log-probability is above the runner-up's"
    v = sorted(logprobs.values(), reverse=True)
    return v[0] - v[1] if len(v) > 1 else float("inf")


def answers_of(results:dict, n:int)->list:
    "The likeliest candidate of each of `n` results (None where a request failed)"
    return [max(results[i].logprobs, key=results[i].logprobs.get) if results[i].logprobs else None for i in range(n)]


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


class Limits:
    "The machine's bounds as sampled so far: the best fp32 matmul peak and memory bandwidth"
    def __init__(self): self.peaks, self.bws = [], []
    def sample_peak(self):
        import torch
        self.peaks.append(matmul_peak(torch.float32, seconds=0.15))
    def sample_bw(self): self.bws.append(memory_bandwidth())
    @property
    def peak(self)->float: return max(self.peaks)
    @property
    def bw(self)->float: return max(self.bws)


def interleave(methods:list, rounds:int, lim:Limits, label:str)->tuple[dict, dict]:
    """Each of `methods` (name, fn -> (seconds, output)) once per round, the order reversed every other round; before
    each, the machine left to settle (`bench.settle`: a vLLM server's or lm-eval worker's threads still busy) and a peak sample"""
    R, got = {m: [] for m, _ in methods}, {}
    for r in range(rounds):
        waited = 0.0
        for name, fn in (methods if r % 2 == 0 else methods[::-1]):
            waited += settle(); lim.sample_peak()
            dt, out = fn(); R[name].append(dt); got.setdefault(name, out)
        print(f"  {label} round {r + 1}: " + ", ".join(f"{m} {R[m][-1]:.1f}s" for m, _ in methods)
              + f" ({load()}; {waited:.1f} s waiting for a quiet CPU)", flush=True)
    varied = [f"{m} {max(x) / min(x):.1f}x" for m, x in R.items() if max(x) > 1.5 * min(x)]
    if varied: print(f"  note: the rounds differ by more than 1.5x ({', '.join(varied)}): the load changed; the medians carry it", flush=True)
    return {m: med(x) for m, x in R.items()}, got


def scoring_part(rep, lim, name, sm_fn, worker, flops, N, rounds, ps, labels, peer_min:float|None):
    "Option or letter scoring: medsafe against lm-eval's HFLM (when its worker runs), one row each"
    methods = [("medsafe", lambda: timed(lambda: best_keys(dict(sm_fn()))))]
    if worker: methods.append(("lm-eval", lambda: worker.run(name)))
    T, got = interleave(methods, rounds, lim, name)
    part = f"{name} scoring, {N} prompts"
    mfu = flops / T["medsafe"] / lim.peak
    rep.add(part, labels[0], f"{N / T['medsafe']:.2f} prompts/s", f"({load()})", f"MFU {mfu:.2f} (fp32 peak)", "MFU >= 0.6", mfu >= 0.6)
    if worker:
        ratio = T["lm-eval"] / T["medsafe"]
        same = sum(a == b for a, b in zip(got["medsafe"], got["lm-eval"]))
        goal = f"medsafe >= {peer_min:g}x lm-eval, same answers" if peer_min else ""
        met = (ratio >= peer_min and same == N) if peer_min else None
        rep.add(part, labels[1], f"{N / T['lm-eval']:.2f} prompts/s", f"medsafe {ratio:.2f}x it, answers {same}/{N} identical",
                f"MFU {flops / T['lm-eval'] / lim.peak:.2f} (fp32 peak)", goal, met)
    return T


def generation_part(rep, lim, sm, gen_reqs, gen_texts, gen_lengths, shape, new, rounds):
    "Greedy generation: medsafe against one `generate` per prompt, and the job's roofline"
    from medsafe_nb.models.base import make_backend
    plain = make_backend("smollm2", max_new_tokens=new, linear_kernels="torch")   # the naive peer's model, as a user loads it (nn.Linear)
    methods = [("medsafe", lambda: timed(lambda: dict(sm.generate(gen_reqs)))),
               ("naive", lambda: timed(lambda: naive_generate(plain.lm, plain.tokenizer, gen_texts, new)))]
    lim.sample_bw()
    T, got = interleave(methods, rounds, lim, "generation")
    G = len(gen_reqs)
    gens = got["medsafe"]
    n_new = [gens[i].completion_tokens or 1 for i in range(G)]
    tokens = sum(n_new)
    bound = shape.roofline_replies(gen_lengths, n_new, lim.peak, lim.bw)
    same = sum(gens[i].text == t for i, t in enumerate(got["naive"]))
    part = f"generation, {G} x <= {new} tokens ({tokens} generated)"
    print(f"  roofline of the generation job: {bound:.2f} s; replies of {min(n_new)}-{max(n_new)} tokens, "
          f"{sum(k == new for k in n_new)} at the cap", flush=True)
    rep.add(part, "medsafe generate (auto batch)", f"{tokens / T['medsafe']:.1f} tok/s",
            f"{T['naive'] / T['medsafe']:.2f}x naive, texts {same}/{G} identical ({load()})", f"{bound / T['medsafe']:.2f} of roofline",
            ">= 0.60 of roofline", bound / T["medsafe"] >= 0.6)
    rep.add(part, "naive per-prompt generate (bench.py)", f"{tokens / T['naive']:.1f} tok/s", "", f"{bound / T['naive']:.2f} of roofline")


def vllm_part(rep, lim, sm, ps, key_reqs, gen_reqs, opt_reqs, new, rounds, letter_flops, opt_flops, gen_lengths, shape):
    "vLLM against in-process on the real model: letter scoring, generation and option scoring, interleaved"
    from medsafe_nb.models.vllm import find_vllm_python
    from medsafe_nb.models.gguf import smollm2_vllm
    import torch
    parts = ("vLLM, letter scoring", "vLLM, generation", "vLLM, option scoring")
    def not_measured(why):
        for p in parts: rep.add(p, "vLLM server (.venv-vllm)", "not measured", why, "", "option scoring >= 1.0x in-process, same answers"
                                if p.endswith("option scoring") else "")
    try: find_vllm_python()
    except Exception as e: return not_measured(str(e).split(", or ")[0])
    out = Path(tempfile.mkdtemp(prefix="medsafe-bench-real-vllm-"))
    n = torch.get_num_threads()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if n == 1 else f"0-{n - 1}")   # as many threads as in-process
    print(f"vLLM: starting the server (log in {out}) ... ({load()})", flush=True)
    t0 = time.perf_counter()
    try: v = smollm2_vllm(run_dir=out, model_args={"max_model_len": 4096}, max_new_tokens=new, startup_timeout=480)
    except Exception as e:
        print(f"vLLM: not measured: the server did not start ({type(e).__name__}: {str(e)[:300]}); log in {out}")
        return not_measured(f"the server did not start ({type(e).__name__}); log in {out}")
    print(f"  vLLM server healthy after {time.perf_counter() - t0:.0f} s ({load()})", flush=True)
    try:
        passes = iter(range(10 ** 9))
        def fresh(fn):                                          # each pass in a prefix-cache namespace of its own
            def run():
                v.extra_body = {**(v.extra_body or {}), "cache_salt": f"medsafe-bench-{next(passes)}"}
                return timed(fn)
            return run
        fresh(lambda: (list(v.score(key_reqs[:2])), list(v.generate(gen_reqs[:2])), list(v.score(opt_reqs[:2]))))()   # untimed: the first requests
        methods = [("v_letter", fresh(lambda: dict(v.score(key_reqs)))), ("i_letter", lambda: timed(lambda: dict(sm.score(key_reqs)))),
                   ("v_gen", fresh(lambda: dict(v.generate(gen_reqs)))), ("i_gen", lambda: timed(lambda: dict(sm.generate(gen_reqs)))),
                   ("v_opt", fresh(lambda: dict(v.score(opt_reqs)))), ("i_opt", lambda: timed(lambda: dict(sm.score(opt_reqs))))]
        T, got = interleave(methods, rounds, lim, "vLLM")
        letter_rows(rep, lim, sm, v, ps, key_reqs, got, T, letter_flops)
        gen_rows(rep, lim, sm, v, ps, gen_reqs, got, T, gen_lengths, shape)
        option_rows(rep, lim, ps, opt_reqs, got, T, opt_flops)
    except Exception as e:                                      # the server died or refused: the rest of the table still prints
        print(f"vLLM: measurement failed ({type(e).__name__}: {str(e)[:300]}); log in {out}")
        not_measured(f"failed ({type(e).__name__}); log in {out}")
    finally:
        v.close()


def letter_rows(rep, lim, sm, v, ps, key_reqs, got, T, letter_flops):
    N = len(key_reqs)
    vs, ins = got["v_letter"], got["i_letter"]
    v_ans, i_ans = answers_of(vs, N), best_keys(ins)
    errors = sum(bool(vs[i].error) for i in range(N))
    diffs = [abs(vs[i].logprobs.get(k, float("-inf")) - ins[i].logprobs[k]) for i, k in enumerate(i_ans)]
    finite = [d for d in diffs if d != float("inf")]
    for i in range(N):
        if v_ans[i] != i_ans[i]:
            print(f"  letter disagreement, {ps[i].item_id} {ps[i].condition}: in-process {i_ans[i]} (margin {margin(ins[i].logprobs):.3f}), "
                  f"vLLM {v_ans[i]} (margin {margin(vs[i].logprobs):.3f})" + (f"; vLLM: {vs[i].error}" if vs[i].error else ""))
    lp = (f"max |d log p| of in-process's chosen key {max(finite):.1e}" if finite else "no chosen key in vLLM's top logprobs") + \
         (f" ({len(diffs) - len(finite)} outside vLLM's top logprobs)" if finite and len(finite) < len(diffs) else "") + (f", {errors} vLLM errors" if errors else "")
    rep.add(f"vLLM, letter scoring, {N} prompts", "vLLM server (top-100 logprobs), concurrency 64", f"{N / T['v_letter']:.2f} prompts/s",
            f"{T['i_letter'] / T['v_letter']:.2f}x in-process ({N / T['i_letter']:.2f} prompts/s beside it), "
            f"answers {sum(a == b for a, b in zip(v_ans, i_ans))}/{N}, {lp} ({load()})", f"MFU {letter_flops / T['v_letter'] / lim.peak:.2f} (fp32 peak)")


def gen_rows(rep, lim, sm, v, ps, gen_reqs, got, T, gen_lengths, shape):
    G = len(gen_reqs)
    v_text, i_text = [got["v_gen"][i].text for i in range(G)], [got["i_gen"][i].text for i in range(G)]
    for i in range(G):
        if v_text[i] != i_text[i]:
            print(f"  text disagreement, {ps[i].item_id} {ps[i].condition}: {reply_divergence(sm, v, ps[i], i_text[i], v_text[i])}")
    v_tokens = sum(g.completion_tokens or 0 for g in got["v_gen"].values())
    i_tokens = sum(g.completion_tokens or 0 for g in got["i_gen"].values())
    bound = shape.roofline_replies(gen_lengths, [got["v_gen"][i].completion_tokens or 1 for i in range(G)], lim.peak, lim.bw)
    rep.add(f"vLLM, generation, {G} x <= {gen_reqs[0].max_new_tokens} tokens", "vLLM server, concurrency 64", f"{v_tokens / T['v_gen']:.1f} tok/s",
            f"{(v_tokens / T['v_gen']) / (i_tokens / T['i_gen']):.2f}x in-process ({i_tokens / T['i_gen']:.1f} tok/s beside it), "
            f"texts {sum(a == b for a, b in zip(v_text, i_text))}/{G} ({load()})", f"{bound / T['v_gen']:.2f} of roofline")


def option_rows(rep, lim, ps, opt_reqs, got, T, opt_flops):
    N = len(opt_reqs)
    vs, ins = got["v_opt"], got["i_opt"]
    errors = sum(bool(vs[i].error) for i in range(N))
    v_ans, i_ans = answers_of(vs, N), best_keys(ins)
    diffs = [abs(vs[i].logprobs[k] - ins[i].logprobs[k]) for i in range(N) if vs[i].logprobs for k in ins[i].logprobs]
    for i in range(N):
        if v_ans[i] != i_ans[i]:
            print(f"  option disagreement, {ps[i].item_id} {ps[i].condition}: in-process {i_ans[i]} (margin {margin(ins[i].logprobs):.3f}), "
                  f"vLLM {v_ans[i]}" + (f" (margin {margin(vs[i].logprobs):.3f})" if vs[i].logprobs else f": {vs[i].error}"))
    ratio, same = T["i_opt"] / T["v_opt"], sum(a == b for a, b in zip(v_ans, i_ans))
    rep.add(f"vLLM, option scoring, {N} prompts", "vLLM server (prompt once, options from its prefix cache)", f"{N / T['v_opt']:.2f} prompts/s",
            f"{ratio:.2f}x in-process ({N / T['i_opt']:.2f} prompts/s beside it), answers {same}/{N}, "
            f"max |d log p| over {len(diffs)} options {max(diffs, default=float('nan')):.1e}" + (f", {errors} vLLM errors" if errors else "") + f" ({load()})",
            f"MFU {opt_flops / T['v_opt'] / lim.peak:.2f} (fp32 peak)", "option scoring >= 1.0x in-process, same answers", ratio >= 1.0 and same == N)


def main():
    stop_on_signals()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians over them); 3 for figures to keep")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--items", type=int, default=6, help="single-answer sample items (x clean, type1, type2)")
    ap.add_argument("--gen-prompts", type=int, default=6, help="prompts of the generation job (the first of the scoring prompts)")
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per reply at most")
    ap.add_argument("--budget", type=float, default=300, help="seconds: a part that would start after them is not measured")
    ap.add_argument("--quick", action="store_true", help="2 items, 2 generation prompts, one round, no vLLM: check that it runs")
    ap.add_argument("--vllm", action="store_true", help="with --quick: run the vLLM part too")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: hflm, gen, vllm")
    args, _ = ap.parse_known_args()                           # `make bench` passes bench.py's options too
    skip = set(filter(None, args.skip.split(",")))
    if args.quick:
        args.items, args.rounds, args.gen_prompts = 2, 1, min(args.gen_prompts, 2)
        if not args.vllm: skip.add("vllm")
    import torch
    if args.threads: torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging
    from medsafe_nb.items.release import load_medmisbench
    from medsafe_nb.models.base import GenRequest, ScoreRequest, make_backend
    from medsafe_nb.protocols import build_prompts, ANSWER_PREFIX
    hf_logging.disable_progress_bar()
    n_load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {n_load:.1f} on {os.cpu_count()} cores"
          + ("  (busy: --threads 1 is faster here)" if n_load >= os.cpu_count() and torch.get_num_threads() > 1 else ""), flush=True)

    rep, lim = Report(), Limits()
    workers = {}
    try:
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
        print(f"smollm2 ({sm.identity()['model']}, {sm.dtype}, {shape.params / 1e6:.0f} M non-embedding parameters); "
              f"scoring: {N} prompts ({len(items)} items x clean, type1, type2), {min(map(len, enc))}-{max(map(len, enc))} tokens, "
              f"{sum(map(len, opts))} options of {min(len(c) for cs in conts for c in cs)}-{max(len(c) for cs in conts for c in cs)} tokens; "
              f"generation: {len(gen_ps)} prompts x <= {args.new_tokens} new tokens; {args.rounds} round(s); budget {args.budget:.0f} s", flush=True)
        list(sm.score(opt_reqs[:1])); list(sm.score(key_reqs[:1]))    # untimed: the first call of each kind (the option roads are checked once)
        for _ in range(3): lim.sample_peak()
        lim.sample_bw()
        print(f"  fp32 matmul peak {lim.peak / 1e9:.0f} GFLOP/s, memory {lim.bw / 1e9:.1f} GB/s ({load()})", flush=True)

        hflm_why = None
        if "hflm" in skip: hflm_why = "not measured (--skip hflm)"
        elif not (py := ROOT / ".venv-harness" / "bin" / "python").exists(): hflm_why = "not measured: no .venv-harness (`make harness-env`)"
        else:
            try: workers["hflm"] = HFLMWorker(str(py), sm.gguf["checkpoint"], {"option": (texts, opts), "letter": (letter_texts, [p.keys for p in ps])},
                                              args.threads)   # the cached safetensors copy: the same weights
            except Exception as e: hflm_why = f"not measured ({e}); `make harness-env`"
        if hflm_why: print(f"lm-eval HFLM: {hflm_why}", flush=True)
        hflm = workers.get("hflm")

        def in_time(part:str)->bool:
            if time.perf_counter() - T0 <= args.budget: return True
            rep.add(part, "-", "not measured", f"past the --budget of {args.budget:.0f} s ({load()})"); return False

        # option scoring answers by the option text: lm-eval's answer is mapped back to its key
        option_worker = None
        if hflm:
            class OptionWorker:
                def run(self, name):
                    dt, got = hflm.run(name)
                    return dt, [p.keys[o.index(a)] for p, o, a in zip(ps, opts, got)]
            option_worker = OptionWorker()
        if in_time("option scoring"):
            scoring_part(rep, lim, "option", lambda: sm.score(opt_reqs), option_worker, opt_flops, N, args.rounds, ps,
                         ("medsafe (prompt and options in one pass)", "lm-eval HFLM, one request per option, bs 1"), 3.0)
        if in_time("letter scoring"):
            scoring_part(rep, lim, "letter", lambda: sm.score(key_reqs), hflm, letter_flops, N, args.rounds, ps,
                         ("medsafe (one pass per prompt)", "lm-eval HFLM, one request per key, bs 1"), None)
        if hflm_why:
            rep.add("option and letter scoring", "lm-eval HFLM", "not measured", hflm_why, "", "medsafe >= 3x, same answers", None)
        if hflm: hflm.close()
        if "gen" in skip: rep.add("generation", "medsafe generate", "not measured", "(--skip gen)", "", ">= 0.60 of roofline", None)
        elif in_time("generation"): generation_part(rep, lim, sm, gen_reqs, gen_texts, gen_lengths, shape, args.new_tokens, args.rounds)
        if "vllm" in skip: rep.add("vLLM", "vLLM server (.venv-vllm)", "not measured", "(--skip vllm)", "", "option scoring >= 1.0x in-process, same answers", None)
        elif in_time("vLLM"):
            vllm_part(rep, lim, sm, ps, key_reqs, gen_reqs, opt_reqs, args.new_tokens, args.rounds, letter_flops, opt_flops, gen_lengths, shape)
        sm.close()
    finally:
        for w in workers.values(): w.close()
    print()
    print(rep.table())
    print(f"\n{rep.summary()}")
    print(f"(medians of {args.rounds} interleaved round(s); bounds: the best samples of this run, fp32 matmul peak {lim.peak / 1e9:.0f} GFLOP/s, "
          f"memory bandwidth {lim.bw / 1e9:.1f} GB/s; {torch.get_num_threads()} thread(s); load average {os.getloadavg()[0]:.1f} at the end; "
          f"{time.perf_counter() - T0:.0f} s in all)")


if __name__ == "__main__":
    main()
