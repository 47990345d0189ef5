"""`make bench`: the speed of medsafe_nb against its peers and this machine's limits, as one table measured in one run.

Setup: a random-weight Llama (hidden 512, head_dim 64, 4 layers and a 32,000-token vocabulary
by default, on the tokenizer and chat template of `medsafe_nb.testing.doubles`'s tiny model), the sample's
real prompts (clean, type1 and type2 of the first items), CPU, in the checkpoint's own precision (fp32: the default
rule, `hf_plan.auto_dtype`), with bf16 as the opt-in (`--model-args dtype=bfloat16`) beside it. Every method runs once per round and the rounds
interleave the methods, so a slow moment of this shared machine hits all of them, and each scoring, generation and
vLLM method starts on a quiet CPU (`settle`: the threads of a vLLM server or lm-eval worker are left to stop first);
the table shows medians over the rounds and ratios. Absolute numbers are not stable here; the ratios are what to read.

- scoring (letter log-probabilities, one call of `--prompts` prompts): the toolkit at its defaults (on a CPU in fp32,
  linear layers by oneDNN from packed weights: `hf_cpu`), at batch 1, at a fixed batch of 8, with
  `linear_kernels=torch` (nn.Linear), a naive loop (one full forward per prompt, nn.Linear, as are the naive
  generation loop's), and lm-eval's HFLM loglikelihood (batch 1, its
  default) in the side venv `.venv-harness` (`make harness-env`), and the toolkit with the bf16 opt-in, each against
  the matmul peak of the precision it computes in, measured in each round (MFU = model FLOPs of the prompts / time /
  peak);
- generation (greedy, `--new-tokens` tokens): the toolkit against a naive per-prompt `generate` and against the
  job's roofline (prefill at the matmul peak, each decoding step of one batch of all prompts at the larger of its
  FLOPs at the peak and its bytes at the memory bandwidth measured in each round);
- end to end, `medsafe run --scoring logprob --limit --e2e-limit` as a user types it (a fresh folder each time, the
  model's load included): the defaults against `--batch-size 1`, with their answers and p_gold compared, each
  method's round range, and how many prompts the automatic plan batched with others (none: the two run one plan);
- the OpenAI-compatible client against minimal asyncio clients on the same HTTP library (httpx2, the peer the targets
  name) and on httpx, and the ideal, on a local server answering after 50 ms, at concurrency 1-256: requests/s and
  client CPU per request (at least `API_ROUNDS` rounds);
- vLLM (`.venv-vllm`, `make vllm`) against the in-process backend on the same model;
- with `--scale`, the paper-scale verbs (`bench/bench_scale.py`: metrics, report, show, review export and a resumed
  run's ledger on 360,756 rows), its table printed after this one.

    .venv/bin/python bench/bench.py [--rounds 3] [--threads N] [--skip vllm,hflm,e2e,api,bf16] [--scale]

Nothing is asserted. On a loaded machine pass --threads 1 (OpenMP threads spin-waiting for a descheduled sibling
make small matrix products many times slower); the load average is printed.
"""
import argparse, asyncio, json, os, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
med = statistics.median
API_ROUNDS = 5   # the API part takes seconds a round, and one slow moment moves a median of two: at least five rounds


def matmul_peak(dtype, n=1024, seconds=0.3)->float:
    """FLOP/s of the best of three timed stretches of n x n matrix products, by torch's matmul, by `F.linear` (what
    `nn.Linear` computes with: in bf16 on a CPU without bf16 instructions it takes another road than matmul, measured
    here at 18 against 1 GFLOP/s) and, in fp32, by oneDNN's packed linear (the toolkit's CPU road, `hf_cpu`): the
    fastest kernel sets the peak, so no method can beat it"""
    import torch
    from medsafe_nb.models.hf_cpu import onednn_available, packed_linear
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    kernels = [lambda: a @ b, lambda: torch.nn.functional.linear(a, b)]
    if dtype == torch.float32 and onednn_available():
        lin = torch.nn.Linear(n, n, bias=False)
        with torch.no_grad(): lin.weight.copy_(b)
        packed = packed_linear(lin)
        kernels.append(lambda: packed(a))
    def second_call(fn)->float:
        fn(); t0 = time.perf_counter(); fn(); return time.perf_counter() - t0
    warm = [second_call(fn) for fn in kernels]          # a first call of each is the warm-up; the second is timed
    kernels = [fn for fn, t in zip(kernels, warm) if t <= 4 * min(warm)]   # one many times slower cannot set the peak
    best = 0.0
    for fn in kernels:
        for _ in range(3):
            k, t0 = 0, time.perf_counter()
            while (dt := time.perf_counter() - t0) < seconds / 3 / len(kernels): fn(); k += 1
            best = max(best, 2 * n ** 3 * k / dt)
    return best


def memory_bandwidth(mib=256)->float:
    "bytes/s of the best of five copies of a `mib` MiB tensor (read + write)"
    import torch
    x = torch.ones(mib * 2 ** 18); y = torch.empty_like(x); y.copy_(x)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter(); y.copy_(x); best = max(best, 2 * x.nbytes / (time.perf_counter() - t0))
    return best


class Shape:
    "FLOPs and bytes of the benchmark model"
    def __init__(self, lm):
        cfg = lm.config
        self.d, self.layers, self.vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
        self.kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
        from medsafe_nb.models.hf_cpu import is_packed
        packed = [(n, m.in_features * m.out_features) for n, m in lm.named_modules() if is_packed(m)]   # oneDNN layers hold no `weight`
        self.params = (sum(p.numel() for n, p in lm.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
                       + sum(k for n, k in packed if "lm_head" not in n))
        self.weight_bytes = (sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if "embed_tokens" not in n)
                             + sum(4 * k for _, k in packed))                  # packed layers are fp32
        out, inp = lm.get_output_embeddings(), lm.get_input_embeddings().weight
        if not is_packed(out) and out.weight is inp:                           # a tied output matrix: listed once, as the embedding, but read every step
            self.weight_bytes += inp.numel() * inp.element_size()

    def prefill(self, n:int)->float:
        "FLOPs to read a prompt of n tokens and predict the next one (causal attention, one row of logits)"
        return 2 * self.params * n + 2 * self.layers * n * n * self.d + 2 * self.d * self.vocab

    def roofline(self, lengths:list, new:int, peak:float, bandwidth:float)->float:
        "Seconds at best: prefill at the peak (it yields the first new token), then `new - 1` steps of one batch of all prompts"
        t = sum(self.prefill(n) for n in lengths) / peak
        for s in range(1, new):
            ctx = [n + s for n in lengths]
            flops = sum(2 * self.params + 4 * self.layers * c * self.d + 2 * self.d * self.vocab for c in ctx)
            byts = self.weight_bytes + sum(c * self.layers * 2 * self.kv * 4 for c in ctx)
            t += max(flops / peak, byts / bandwidth)
        return t


def bench_model(layers:int, vocab:int)->Path:
    "The tiny chat model's tokenizer and template on a Llama of hidden 512, head_dim 64 (vLLM runs it), `vocab` output rows"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from medsafe_nb.testing.doubles import build_tiny_model
    tmp = Path(tempfile.gettempdir())
    path = tmp / f"medsafe_bench_llama512_l{layers}_v{vocab}"
    if (path / "config.json").exists(): return path
    base = build_tiny_model(tmp / f"medsafe_bench_llama512_l{layers}", hidden_size=512, num_layers=layers, num_heads=8)
    lm = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(0)
    if vocab > lm.config.vocab_size: lm.resize_token_embeddings(vocab, mean_resizing=False)   # a real model's vocabulary size
    part = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=tmp))
    lm.save_pretrained(part); AutoTokenizer.from_pretrained(base).save_pretrained(part)
    part.rename(path)
    return path


def setup(n_items:int, layers:int, vocab:int):
    from transformers.utils import logging as hf_logging
    from medsafe_nb.items.release import load_medmisbench
    from medsafe_nb.protocols import render_messages, type1_target
    hf_logging.disable_progress_bar()
    model = bench_model(layers, vocab)
    items = load_medmisbench()[:n_items]
    msgs = [(it, tuple(render_messages(it, c, type1_target(it) if c == "type1" else None))) for it in items for c in ("clean", "type1", "type2")]
    return model, msgs


def naive_score(lm, tok, texts, keys):
    "One full forward per prompt, all logits, the keys' next-token log-probabilities"
    import torch
    answers = []
    for text, ks in zip(texts, keys):
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode(): lp = lm(**ids).logits[0, -1].log_softmax(-1)
        kid = [tok(text + k, add_special_tokens=False).input_ids[-1] for k in ks]
        answers.append(ks[max(range(len(ks)), key=lambda j: lp[kid[j]].item())])
    return answers


def naive_generate(lm, tok, texts, new):
    "One `generate` per prompt, greedy"
    import torch
    out = []
    for text in texts:
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            row = lm.generate(**ids, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.input_ids.shape[1]:]
        eos = lm.generation_config.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or [])
        stop = next((j for j, t in enumerate(row.tolist()) if t in eos), None)
        out.append(tok.decode(row[:stop], skip_special_tokens=True).strip())
    return out


class HFLMWorker:
    "lm-eval's HFLM in the side venv, loaded once, timed per `run(job)`; stopped with this process however it ends"
    def __init__(self, python, model, jobs:dict, threads):   # jobs: name -> (contexts, candidate tuples)
        import atexit
        spec = Path(tempfile.mkdtemp()) / "requests.json"
        spec.write_text(json.dumps({"model": str(model), "threads": threads,
                                    "jobs": {k: [[t, list(c)] for t, c in zip(*v)] for k, v in jobs.items()}}))
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        log = spec.parent / "worker.log"                    # its stderr: the reason, should it not start
        with open(log, "w") as err:
            self.p = subprocess.Popen([python, str(ROOT / "bench" / "hflm_worker.py"), str(spec)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        atexit.register(self.close)
        line = self.p.stdout.readline()
        if line.strip() != "ready":
            self.close()
            last = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the lm-eval worker did not start: {last[:200]} (its log: {log})")

    def run(self, job:str):
        self.p.stdin.write(f"run {job}\n"); self.p.stdin.flush()
        got = json.loads(self.p.stdout.readline())
        return got["seconds"], got["answers"]

    def close(self):
        "Ask the worker to quit; kill it if it does not within 10 s (it may be in the middle of a run)"
        if self.p.poll() is not None: return
        try: self.p.stdin.write("quit\n"); self.p.stdin.close()
        except OSError: pass
        try: self.p.wait(10)
        except subprocess.TimeoutExpired: self.p.kill(); self.p.wait()


def timed(fn):
    t0 = time.perf_counter(); out = fn(); return time.perf_counter() - t0, out


def cpu_busy()->tuple[float, float]:
    "The machine's (busy, all) CPU time so far in clock ticks, summed over its cores (/proc/stat: Linux; (0, 0) elsewhere)"
    try: ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError): return 0.0, 0.0
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)          # idle and iowait
    return float(sum(ticks[:8]) - idle), float(sum(ticks[:8]))


def settle(quiet:float=0.1, window:float=0.25, timeout:float=3.0)->float:
    """Wait until the machine is quiet (under `quiet` of one core busy over `window` seconds), at most `timeout`
    seconds; the seconds waited. Between the methods of a comparison: a vLLM server keeps its threads polling for about
    a second after its last request, and a method timed in that second shares the CPU with them (on 2 cores in-process
    option scoring of 18 prompts took 6.2-6.3 s there against 5.2-5.4 s after a pause)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        b0, a0 = cpu_busy(); time.sleep(window); b1, a1 = cpu_busy()
        if a1 <= a0 or (b1 - b0) / (a1 - a0) * (os.cpu_count() or 1) < quiet: break
    return time.perf_counter() - t0


def best_keys(results:dict)->list:
    return [max(s.logprobs, key=s.logprobs.get) for _, s in sorted(results.items())]


# --- the OpenAI-compatible client ---------------------------------------------------------------------------------
def api_messages(i): return [{"role": "user", "content": f"Case {i}.\nWhich?\nA. yes\nB. no\nC. maybe"}]


async def _minimal(url, n, c, lib="httpx"):
    import importlib
    httpx = importlib.import_module(lib)
    sem = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)   # the openai SDK's pool
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def one(i):
            async with sem:
                r = await client.post("/chat/completions", json={"model": "mock-model", "messages": api_messages(i), "max_tokens": 64})
                r.raise_for_status()
                return r.json()["choices"][0]["message"]["content"]
        return await asyncio.gather(*(one(i) for i in range(n)))


def minimal_client(url, n, c): return asyncio.run(_minimal(url, n, c))
def minimal_httpx2(url, n, c): return asyncio.run(_minimal(url, n, c, "httpx2"))


def toolkit_client(url, n, c):
    from medsafe_nb.models.openai import OpenAIBackend
    from medsafe_nb.models.base import GenRequest
    out = list(OpenAIBackend("mock-model", base_url=url, concurrency=c).generate([GenRequest(tuple(api_messages(i))) for i in range(n)]))
    bad = sum(g.finish_reason == "error" for _, g in out)
    if bad: raise RuntimeError(f"toolkit client: {bad} errors")
    return out


def cpu_timed(fn):
    t0, c0 = time.perf_counter(), time.process_time(); fn(); return time.perf_counter() - t0, time.process_time() - c0


# --- the table, printed as it is measured ------------------------------------------------------------------------
HEAD = ("part", "method", "median", "ratio", "of the bound", "goal")


class Report:
    """The rows of one bench script: each printed the moment it is measured, then all of them as one aligned table
    whose last column says which goal each row met or missed (the goals are this project's targets; a row without
    one only informs)"""
    def __init__(self): self.rows = []

    def add(self, part, method, median, ratio="", bound="", goal:str="", met:bool|None=None):
        "Record one row and print it now; `goal` says the target, `met` whether this run reached it (None: not judged)"
        verdict = "" if not goal else f"{goal}: {'met' if met else 'MISSED'}" if met is not None else f"{goal}: not measured"
        row = (part, method, median, ratio, bound, verdict)
        self.rows.append(row)
        print("  row | " + " | ".join(str(x) for x in row if x != ""), flush=True)
        return row

    def missed(self)->list:
        return [r for r in self.rows if r[5].endswith("MISSED")]

    def table(self)->str:
        return table(self.rows)

    def summary(self)->str:
        judged = [r for r in self.rows if r[5] and not r[5].endswith("not measured")]
        bad = self.missed()
        if not judged: return "no row had a goal to judge"
        return (f"{len(judged) - len(bad)} of {len(judged)} goals met" + ("" if not bad else "; missed: " +
                "; ".join(f"{r[0]}, {r[1]} ({r[5].removesuffix(': MISSED')})" for r in bad)))


def table(rows, head=HEAD):
    rows = [tuple(r) + ("",) * (len(head) - len(r)) for r in rows]
    w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(str(x).ljust(w[i]) for i, x in enumerate(r)) + " |"
    return "\n".join([line(head), "| " + " | ".join("-" * x for x in w) + " |"] + [line(r) for r in rows])


def stop_on_signals():
    """SIGTERM and SIGHUP (a `timeout`, a closed terminal, a scheduler) end the script as Ctrl-C does, through its
    `finally` blocks and `atexit`: servers and workers it started are stopped, not left running"""
    import signal
    def handler(signum, frame):
        signal.signal(signum, signal.SIG_IGN)                  # once: the clean-up is not interrupted by a second one
        raise SystemExit(128 + signum)
    for s in (signal.SIGTERM, signal.SIGHUP): signal.signal(s, handler)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (medians over them)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the benchmark model")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary (output rows) of the benchmark model, as Llama 2's")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--prompts", type=int, default=48, help="prompts per scoring call (a --limit 16 run)")
    ap.add_argument("--gen-prompts", type=int, default=24, help="prompts per generation call")
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per generated reply")
    ap.add_argument("--concurrency", default="1,4,16,64,256", help="API concurrency levels")
    ap.add_argument("--e2e-limit", type=int, default=12, help="items of the end-to-end `medsafe run --scoring logprob` (x 3 conditions)")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: hflm, e2e, api, vllm, bf16")
    ap.add_argument("--scale", action="store_true", help="also run bench/bench_scale.py (the verbs on 360,756 rows; minutes) and print its table")
    args, _ = ap.parse_known_args()                           # `make bench` passes bench_real.py's options too
    skip = set(filter(None, args.skip.split(",")))
    t_start = time.perf_counter()
    import torch
    if args.threads: torch.set_num_threads(args.threads)
    from medsafe_nb.models.base import GenRequest, ScoreRequest
    from medsafe_nb.models.hf import HFBackend
    model, msgs = setup(-(-max(args.prompts, args.gen_prompts) // 3), args.layers, args.vocab)
    score_msgs, gen_msgs = msgs[:args.prompts], msgs[:args.gen_prompts]
    fast = HFBackend(str(model), max_new_tokens=args.new_tokens)          # the defaults
    old = HFBackend(str(model), batch_size=8, max_new_tokens=args.new_tokens)   # a fixed batch of 8
    one = HFBackend(str(model), batch_size=1, max_new_tokens=args.new_tokens)   # the plan the defaults must never lose to
    bf16 = HFBackend(str(model), dtype="bfloat16", max_new_tokens=args.new_tokens) if "bf16" not in skip and fast.dtype != "bfloat16" else None
    plain = HFBackend(str(model), max_new_tokens=args.new_tokens, linear_kernels="torch")   # nn.Linear: the naive loops' model, as a user loads it
    lm, tok, shape = plain.lm, fast.tokenizer, Shape(fast.lm)
    score_reqs = [ScoreRequest(m, it.keys) for it, m in score_msgs]
    gen_reqs = [GenRequest(m, max_new_tokens=args.new_tokens) for _, m in gen_msgs]
    texts = [fast.prompt_text(m, thinking=False) + r.prefix for (_, m), r in zip(score_msgs, score_reqs)]
    keys = [it.keys for it, _ in score_msgs]
    gen_texts = [fast.prompt_text(m) for _, m in gen_msgs]
    lengths = [len(e) for e in fast._encode(texts)]
    gen_lengths = [len(e) for e in fast._encode(gen_texts)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"model: Llama hidden {shape.d}, {shape.layers} layers, {shape.params / 1e6:.1f} M non-embedding parameters, {fast.dtype}")
    print(f"scoring: {len(texts)} prompts, {min(lengths)}-{max(lengths)} tokens (median {med(lengths):.0f}); "
          f"generation: {len(gen_texts)} prompts x {args.new_tokens} new tokens; {args.rounds} interleaved rounds", flush=True)

    hflm = None
    if "hflm" not in skip:
        py = ROOT / ".venv-harness" / "bin" / "python"
        if py.exists():
            try: hflm = HFLMWorker(str(py), model, {"letter": (texts, keys)}, args.threads)
            except Exception as e: print(f"lm-eval HFLM: not measured ({e}); run `make harness-env`")
        else: print("lm-eval HFLM: not measured: no .venv-harness (run `make harness-env`)")

    R = {k: [] for k in ("peak", "peak_bf16", "bw", "score", "score_b1", "score_b8", "score_torch", "score_naive", "score_hflm", "score_bf16", "gen", "gen_naive")}
    answers = {}
    for r in range(args.rounds):
        R["peak_bf16"].append(matmul_peak(torch.bfloat16)); R["bw"].append(memory_bandwidth())
        runs = [("score", lambda: best_keys(dict(fast.score(score_reqs)))),
                ("score_b1", lambda: best_keys(dict(one.score(score_reqs)))),
                ("score_b8", lambda: best_keys(dict(old.score(score_reqs)))),
                ("score_torch", lambda: best_keys(dict(plain.score(score_reqs)))),
                ("score_naive", lambda: naive_score(lm, tok, texts, keys))]
        if hflm: runs.append(("score_hflm", lambda: hflm.run("letter")))
        if bf16: runs.append(("score_bf16", lambda: best_keys(dict(bf16.score(score_reqs)))))
        runs += [("gen", lambda: [g.text for _, g in sorted(fast.generate(gen_reqs))]),
                 ("gen_naive", lambda: naive_generate(lm, tok, gen_texts, args.new_tokens))]
        if r % 2: runs.reverse()                               # alternate the order between rounds
        for name, fn in runs:
            settle()                                                     # the lm-eval worker's threads, should they still spin
            R["peak"].append(matmul_peak(torch.float32, seconds=0.15))   # before every method: the best one is the peak
            if name == "score_hflm": dt, out = fn()
            else: dt, out = timed(fn)
            R[name].append(dt); answers.setdefault(name, out)
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in R.items() if v and k.startswith(("score", "gen"))), flush=True)
    if hflm: hflm.close()

    peak, bw = max(R["peak"]), max(R["bw"])          # the machine's limits: the best of all samples
    peak_of = {"float32": peak, "bfloat16": max(R["peak_bf16"])}   # MFU counts against the peak of the precision used
    flops = sum(shape.prefill(n) for n in lengths)
    rep = Report()
    ref = med(R["score_hflm"]) if R["score_hflm"] else None
    for key, label in (("score", "toolkit, defaults (auto batch)"), ("score_b1", "toolkit, batch 1"), ("score_b8", "toolkit, fixed batch 8"),
                       ("score_torch", "toolkit, linear_kernels=torch (nn.Linear)"),
                       ("score_naive", "naive loop (full forward per prompt)"), ("score_hflm", "lm-eval HFLM loglikelihood, bs 1"),
                       ("score_bf16", "toolkit, dtype=bfloat16 (opt-in)")):
        if not R[key]: continue
        dt = med(R[key])
        agree = sum(a == b for a, b in zip(answers[key], answers["score"]))
        p = peak_of.get("bfloat16" if key == "score_bf16" else fast.dtype, peak)
        mfu = flops / dt / p
        rep.add(f"scoring, {len(texts)}-prompt call", label, f"{len(texts) / dt:.2f} prompts/s",
                (f"{ref / dt:.2f}x HFLM, " if ref else "") + f"answers {agree}/{len(texts)}",
                f"MFU {mfu:.2f} ({'bf16' if p is not peak else 'fp32'} peak)", *(("MFU >= 0.75", mfu >= 0.75) if key == "score" else ()))
    gen_bound = shape.roofline(gen_lengths, args.new_tokens, peak_of.get(fast.dtype, peak), bw)
    n_new = len(gen_texts) * args.new_tokens
    same = sum(a == b for a, b in zip(answers["gen"], answers["gen_naive"]))
    for key, label in (("gen", "toolkit, defaults (auto batch)"), ("gen_naive", "naive per-prompt generate")):
        dt = med(R[key])
        rep.add(f"generation, {len(gen_texts)} x {args.new_tokens} tokens", label, f"{n_new / dt:.1f} tok/s",
                f"{med(R['gen_naive']) / dt:.2f}x naive" + (f", texts {same}/{len(gen_texts)}" if key == "gen" else ""),
                f"{gen_bound / dt:.2f} of roofline", *((">= 0.60 of roofline", gen_bound / dt >= 0.6) if key == "gen" else ()))
    print(f"  peak fp32 {peak / 1e9:.0f} GFLOP/s (median sample {med(R['peak']) / 1e9:.0f}), bf16 {max(R['peak_bf16']) / 1e9:.0f} GFLOP/s, memory {bw / 1e9:.1f} GB/s "
          f"(roofline of the generation job: {gen_bound:.2f} s)", flush=True)

    if "e2e" not in skip: bench_e2e(rep, model, args.rounds, args.e2e_limit)
    if "api" not in skip: bench_api(rep, [int(c) for c in args.concurrency.split(",")], max(args.rounds, API_ROUNDS))
    if "vllm" not in skip: bench_vllm(rep, model, fast, score_reqs, gen_reqs, args.rounds)
    print()
    print(rep.table())
    print(rep.summary())
    if args.scale:
        print("\npaper-scale verbs (bench/bench_scale.py):", flush=True)
        subprocess.run([sys.executable, str(ROOT / "bench" / "bench_scale.py")], check=False)
    else: print("\n(paper-scale verbs on 360,756 rows: `python bench/bench_scale.py`, or `make bench BENCH_ARGS=--scale`)")
    print(f"\n(medians of interleaved rounds; bounds measured in this run, the best of all samples: fp32 matmul peak "
          f"{peak / 1e9:.0f} GFLOP/s (bf16 {max(R['peak_bf16']) / 1e9:.0f}), memory bandwidth {bw / 1e9:.1f} GB/s; "
          f"{torch.get_num_threads()} thread(s); {time.perf_counter() - t_start:.0f} s in all)")


def bench_e2e(rep, model, rounds, limit):
    "`medsafe run --scoring logprob --limit N` as a user types it (model load included), defaults against --batch-size 1"
    import pandas as pd
    tmp = Path(tempfile.mkdtemp(prefix="medsafe-bench-e2e-"))
    R, got = {"auto": [], "1": []}, {}
    for r in range(rounds):
        for b in (("auto", "1") if r % 2 == 0 else ("1", "auto")):
            out = tmp / f"run-{b}-{r}"                        # a fresh folder and ledger: every prompt is computed
            cmd = [str(Path(sys.executable).parent / "medsafe"), "run", "--model", f"hf:{model}", "--scoring", "logprob",
                   "--limit", str(limit), "--out", str(out), "--no-progress", *(["--batch-size", "1"] if b == "1" else [])]
            t0 = time.perf_counter(); p = subprocess.run(cmd, capture_output=True, text=True); dt = time.perf_counter() - t0
            if p.returncode: print(f"end to end ({b}): exit {p.returncode}: {p.stderr[-300:]}"); return
            R[b].append(dt)
            got.setdefault(b, pd.read_parquet(out / "predictions.parquet").sort_values(["item_id", "condition"]))
    a, o = got["auto"], got["1"]
    same = int((a.pred.fillna("").to_numpy() == o.pred.fillna("").to_numpy()).sum())
    diff = float((a.p_gold - o.p_gold).abs().max()) if "p_gold" in a else float("nan")
    n = len(a)
    part, ratio = f"end to end, `medsafe run --scoring logprob --limit {limit}` ({n} prompts)", med(R["1"]) / med(R["auto"])
    rep.add(part, "defaults (auto batch)", spread(R["auto"]), f"{ratio:.2f}x batch 1, answers {same}/{n}, max |dp_gold| {diff:.1e}; "
            + auto_plan_note(a.prompt_tokens.astype(int).tolist()), "", ">= 1.00x batch 1, same answers", ratio >= 1.0 and same == n)
    rep.add(part, "--batch-size 1", spread(R["1"]))


def spread(times:list)->str:
    "The median of a method's rounds, and their range"
    return f"{med(times):.1f} s (rounds {min(times):.1f}-{max(times):.1f})"


def auto_plan_note(lengths:list)->str:
    "How many of these prompts the automatic CPU scoring plan puts in a batch with others (none: it is batch 1's plan)"
    from medsafe_nb.models.hf_plan import AUTO_BATCH, plan_batches
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    paired = sum(len(b) for b in plan_batches(order, lengths, *AUTO_BATCH["cpu", "score"]) if len(b) > 1)
    return (f"{paired} of {len(lengths)} prompts batched with others" if paired else
            "the automatic plan is batch 1's here (no two prompts fit its limits): the time ratio is run-to-run noise")


def bench_api(rep, levels, rounds, delay=0.05):
    server = subprocess.Popen([sys.executable, "-m", "medsafe_nb.testing.mockserver", "--port", "0", "--quiet", "--delay", str(delay)],
                              stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split(" at ")[1].split(" ")[0]
        clients = [("toolkit", toolkit_client), ("minimal2", minimal_httpx2), ("minimal", minimal_client)]
        for _, fn in clients: fn(url, 2, 1)                                   # warm up
        R = {(c, k): [] for c in levels for k, _ in clients}
        for r in range(rounds):
            for c in levels:
                n = min(max(32, 2 * c), 512)
                order = clients[r % 3:] + clients[:r % 3]                       # rotate the order between rounds
                for k, fn in order:
                    dt, cpu = cpu_timed(lambda: fn(url, n, c))
                    R[c, k].append((n / dt, cpu / n))
            print(f"  api round {r + 1} done", flush=True)
        for c in levels:
            rps = {k: med(x[0] for x in R[c, k]) for k, _ in clients}
            cpu = {k: med(x[1] for x in R[c, k]) for k, _ in clients}
            ideal = min(c, min(max(32, 2 * c), 512)) / delay
            for k, label in (("toolkit", "toolkit OpenAI backend (httpx2)"), ("minimal2", "minimal asyncio client, httpx2"),
                             ("minimal", "minimal asyncio client, httpx")):
                r_rps, r_cpu = rps[k] / rps["minimal2"], cpu[k] / cpu["minimal2"]
                rep.add(f"API, concurrency {c}", label, f"{rps[k]:.0f} req/s, {cpu[k] * 1000:.1f} ms CPU/req",
                        f"{r_rps:.2f}x minimal httpx2 req/s, {r_cpu:.2f}x its CPU" if k == "toolkit" else "", f"{rps[k] / ideal:.2f} of ideal ({ideal:.0f} req/s)",
                        *((">= 0.9x req/s, <= 1.2x CPU", r_rps >= 0.9 and r_cpu <= 1.2) if k == "toolkit" else ()))
    finally:
        server.terminate(); server.wait(10)


def bench_vllm(rep, model, fast, score_reqs, gen_reqs, rounds):
    from medsafe_nb.models.vllm import find_vllm_python, vllm_backend
    try: find_vllm_python()
    except Exception as e:
        print(f"vLLM: not measured ({e})"); return
    out = Path(tempfile.mkdtemp(prefix="medsafe-bench-vllm-"))
    import torch
    n = torch.get_num_threads()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if n == 1 else f"0-{n - 1}")   # as many threads as in-process
    t0 = time.perf_counter()
    try: v = vllm_backend(f"hf:{model}", out=out, model_args={"max_model_len": 4096}, max_new_tokens=gen_reqs[0].max_new_tokens,
                          startup_timeout=480)
    except Exception as e:
        print(f"vLLM: not measured: the server did not start ({type(e).__name__}: {str(e)[:300]}); log in {out}"); return
    print(f"  vLLM server healthy after {time.perf_counter() - t0:.0f} s", flush=True)
    try:
        R = {k: [] for k in ("v_score", "i_score", "v_gen", "i_gen")}
        got = {}
        for r in range(rounds):
            runs = [("v_score", lambda: best_keys(dict(v.score(score_reqs)))), ("i_score", lambda: best_keys(dict(fast.score(score_reqs)))),
                    ("v_gen", lambda: [g.text for _, g in sorted(v.generate(gen_reqs))]), ("i_gen", lambda: [g.text for _, g in sorted(fast.generate(gen_reqs))])]
            for k, fn in (runs if r % 2 == 0 else runs[::-1]):
                settle(); dt, o = timed(fn); R[k].append(dt); got.setdefault(k, o)
        n_new = len(gen_reqs) * gen_reqs[0].max_new_tokens
        s_agree = sum(a == b for a, b in zip(got["v_score"], got["i_score"]))
        g_agree = sum(a == b for a, b in zip(got["v_gen"], got["i_gen"]))
        rep.add(f"vLLM, scoring {len(score_reqs)} prompts", "vLLM server (top logprobs), concurrency 64", f"{len(score_reqs) / med(R['v_score']):.2f} prompts/s",
                f"{med(R['i_score']) / med(R['v_score']):.2f}x in-process, answers {s_agree}/{len(score_reqs)}", "top-100 of the vocabulary")
        rep.add(f"vLLM, generation {len(gen_reqs)} x {gen_reqs[0].max_new_tokens}", "vLLM server, concurrency 64", f"{n_new / med(R['v_gen']):.1f} tok/s",
                f"{med(R['i_gen']) / med(R['v_gen']):.2f}x in-process, texts {g_agree}/{len(gen_reqs)}")
    finally:
        v.close()


if __name__ == "__main__":
    sys.exit(main())
