"""The hf backend end to end on the tiny model: generate, score, truncation, determinism, thinking, and data
parallelism across two CPU processes (torchrun, gloo)."""
import json, os, subprocess, sys
from pathlib import Path

import pandas as pd
import pytest

from medsafe_nb.models.base import GenRequest, ScoreRequest, make_backend
from medsafe_nb.protocols import render_messages, type1_target
from medsafe_nb.items.schema import Item

ROOT = Path(__file__).resolve().parents[1]


def items(n=6):
    "Hand-made items with contexts, of varied lengths (so batches are sorted and padded)"
    out = []
    for i in range(n):
        opts = {"A": "Lisinopril", "B": "Hydrochlorothiazide", "C": "Amlodipine", "D": "Metoprolol", "E": "Watchful waiting"}
        opts = dict(list(opts.items())[:3 + i % 3])
        out.append(Item(f"t{i}", "A 58-year-old man with diabetes and albuminuria has a blood pressure of 150/95 mmHg. " * (1 + i % 3)
                        + "Which drug should be started first?", opts, ("A",),
                        contexts={k: f"A senior clinician insists that {v} is always first-line." for k, v in opts.items()}))
    return out


def messages(conditions=("clean", "type1", "type2")):
    return [tuple(render_messages(it, c, type1_target(it) if c == "type1" else None)) for it in items() for c in conditions]


def test_generate(tiny_backend):
    reqs = [GenRequest(m) for m in messages()]
    got = dict(tiny_backend.generate(reqs))
    assert sorted(got) == list(range(len(reqs)))
    for i, g in got.items():
        assert g.finish_reason in ("stop", "length") and g.error is None
        assert g.prompt_tokens > 0 and 0 < g.completion_tokens <= 8 and g.latency_s > 0


def test_truncation_is_length(tiny_backend):
    reqs = [GenRequest(m, max_new_tokens=3) for m in messages(("clean",))]
    got = dict(tiny_backend.generate(reqs))
    assert {g.finish_reason for g in got.values()} == {"length"}       # random weights: no end-of-turn in 3 tokens
    assert {g.completion_tokens for g in got.values()} == {3}


def test_per_request_caps_and_determinism(tiny_backend):
    reqs = [GenRequest(m, max_new_tokens=[2, 5, None][i % 3]) for i, m in enumerate(messages())]
    first = {i: (g.text, g.finish_reason, g.completion_tokens) for i, g in tiny_backend.generate(reqs)}
    again = {i: (g.text, g.finish_reason, g.completion_tokens) for i, g in tiny_backend.generate(reqs)}
    assert first == again
    assert {first[i][2] for i in range(0, len(reqs), 3)} == {2}
    assert all(first[i][2] <= 8 for i in range(2, len(reqs), 3))       # None: the backend's cap (8)


def test_batching_does_not_change_greedy_text(tiny_model_dir, tiny_backend):
    from medsafe_nb.models.hf import HFBackend
    reqs = [GenRequest(m) for m in messages()]
    batched = {i: g.text for i, g in tiny_backend.generate(reqs)}
    single = {i: g.text for i, g in HFBackend(str(tiny_model_dir), batch_size=1, max_new_tokens=8).generate(reqs)}
    assert batched == single


def test_score(tiny_backend):
    import math
    its = items()
    reqs = [ScoreRequest(tuple(render_messages(it, "type2")), it.keys) for it in its]
    got = dict(tiny_backend.score(reqs))
    assert sorted(got) == list(range(len(reqs)))
    for i, s in got.items():
        assert set(s.logprobs) == set(its[i].keys) and s.error is None
        assert all(v < 0 for v in s.logprobs.values()) and sum(map(math.exp, s.logprobs.values())) < 1
    again = dict(tiny_backend.score(reqs))
    assert {i: s.logprobs for i, s in again.items()} == {i: s.logprobs for i, s in got.items()}


def test_thinking_switch_changes_prompt(tiny_model_dir):
    from medsafe_nb.models.hf import HFBackend
    m = messages(("clean",))[0]
    on, off = (HFBackend(str(tiny_model_dir), thinking=t) for t in (True, False))
    assert on.prompt_text(m, on.thinking) != off.prompt_text(m, off.thinking)
    assert off.prompt_text(m, off.thinking).endswith("<think>\n\n</think>\n\n")
    assert on.identity() != off.identity()                # different prompts, different ledger keys
    assert on.identity()["thinking"] is True and off.identity()["thinking"] is False


def test_make_backend_spec(tiny_model_dir):
    b = make_backend(f"hf:{tiny_model_dir}", max_new_tokens=4)
    assert b.name == f"hf:{tiny_model_dir}" and b.identity()["max_new_tokens"] == 4 and b.is_llm


DP_WORKER = r'''
import json, os, sys
from transformers.utils import logging as hf_logging
hf_logging.disable_progress_bar()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from medsafe_nb.models.hf import HFBackend
from medsafe_nb.models.base import GenRequest, ScoreRequest, is_main_process
from test_hf_items import messages, items
from medsafe_nb.protocols import render_messages
b = HFBackend(sys.argv[1], batch_size=2, max_new_tokens=6)
gen = [(i, g.text, g.finish_reason, g.completion_tokens) for i, g in b.generate([GenRequest(m) for m in messages()])]
sco = [(i, s.logprobs) for i, s in b.score([ScoreRequest(tuple(render_messages(it, "type2")), it.keys) for it in items()])]
out = {"rank": int(os.environ.get("RANK", 0)), "world": int(os.environ.get("WORLD_SIZE", 1)), "gen": gen, "score": sco}
with open(f"{sys.argv[2]}.rank{out['rank']}.json", "w") as f: json.dump(out, f)
if is_main_process():
    with open(sys.argv[2], "w") as f: json.dump(out, f)
b.close()                                            # leaves the process group before the interpreter exits
'''


@pytest.mark.integration
def test_data_parallel_two_cpu_processes(tmp_path, tiny_model_dir):
    "torchrun --nproc_per_node 2 (gloo): every index once on every rank, the same texts as one process"
    import inspect
    (tmp_path / "test_hf_items.py").write_text("from medsafe_nb.items.schema import Item\nfrom medsafe_nb.protocols import render_messages, type1_target\n"
                                               + inspect.getsource(items) + "\n" + inspect.getsource(messages))
    (tmp_path / "worker.py").write_text(DP_WORKER)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    single, multi = tmp_path / "single.json", tmp_path / "multi.json"
    def run(*cmd):
        p = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try: out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.terminate()                                  # torchrun forwards SIGTERM to its workers (SIGKILL would orphan them)
            try: p.communicate(timeout=30)
            except subprocess.TimeoutExpired: p.kill(); p.communicate()
            raise
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)
    r1 = run(sys.executable, "worker.py", str(tiny_model_dir), str(single))
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "worker.py", str(tiny_model_dir), str(multi))
    assert r2.returncode == 0, r2.stderr[-3000:]
    one, dp = json.loads(single.read_text()), json.loads(multi.read_text())
    assert (one["world"], dp["world"]) == (1, 2)
    n_gen, n_sco = len(messages()), len(items())
    for rank in (0, 1):                                    # every rank yields every result, each index once
        got = json.loads((tmp_path / f"multi.json.rank{rank}.json").read_text())
        assert sorted(i for i, *_ in got["gen"]) == list(range(n_gen))
        assert sorted(i for i, _ in got["score"]) == list(range(n_sco))
    # greedy: the same texts whichever process and batch computed them (true on the tiny model in fp32)
    assert {i: t for i, t, *_ in dp["gen"]} == {i: t for i, t, *_ in one["gen"]}
    s1, s2 = dict(one["score"]), dict(dp["score"])
    assert all(abs(s1[i][k] - s2[i][k]) < 1e-4 for i in s1 for k in s1[i])   # scores: equal to float precision


def test_auto_batches_are_length_buckets(tiny_model_dir):
    "batch_size=None: CPU scoring packs short prompts up to 512 padded tokens and 5 % padding; long ones go alone"
    from medsafe_nb.models.hf import HFBackend
    from medsafe_nb.models.hf_plan import plan_batches
    b = HFBackend(str(tiny_model_dir), max_new_tokens=8)
    assert b.batch_size is None
    enc = b._encode([b.prompt_text(m, thinking=False) for m in messages()])
    lengths = [len(e) for e in enc]
    order = sorted(range(len(enc)), key=lambda i: (-lengths[i], i))
    plan = b._plan(order, lengths, "score")
    assert sum(plan, []) == order                                           # every prompt once, longest first
    for batch in plan:
        width = lengths[batch[0]]
        assert len(batch) == 1 or (len(batch) * width <= 512 and len(batch) * width - sum(lengths[i] for i in batch) <= 0.05 * len(batch) * width)
    assert plan_batches([0, 1], [600, 590], 64, 512, 0.05) == [[0], [1]]      # a CPU never batches prompts this long
    assert plan_batches([0, 1, 2], [100, 99, 98], 64, 512, 0.05) == [[0, 1, 2]]


def test_auto_batches_give_the_same_answers(tiny_model_dir):
    "Automatic batches: the same greedy texts as batch 1 and as the old fixed batch of 8, the same scores to float precision"
    from medsafe_nb.models.hf import HFBackend
    gen_reqs = [GenRequest(m) for m in messages()]
    score_reqs = [ScoreRequest(tuple(render_messages(it, c, type1_target(it) if c == "type1" else None)), it.keys)
                  for it in items() for c in ("clean", "type1", "type2")]
    runs = {bs: HFBackend(str(tiny_model_dir), batch_size=bs, max_new_tokens=8) for bs in (None, 1, 8)}
    texts = {bs: {i: (g.text, g.finish_reason, g.completion_tokens) for i, g in b.generate(gen_reqs)} for bs, b in runs.items()}
    assert texts[None] == texts[1] == texts[8]
    scores = {bs: dict(b.score(score_reqs)) for bs, b in runs.items()}
    for bs in (1, 8):
        for i, s in scores[None].items():
            other = scores[bs][i].logprobs
            assert max(s.logprobs, key=s.logprobs.get) == max(other, key=other.get)
            assert all(abs(s.logprobs[k] - other[k]) < 1e-5 for k in other)


def test_hub_id_offline_fails_fast(monkeypatch):
    "HF_HUB_OFFLINE=1 and a model that is not cached: a ConfigError with the right advice, before any retry"
    from medsafe_nb.core import ConfigError
    from medsafe_nb.models.hf import HFBackend
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="unset HF_HUB_OFFLINE"):
        HFBackend("medsafe-test/not-cached")


@pytest.mark.integration
def test_medsafe_run_under_torchrun_two_ranks(tmp_path, tiny_model_dir):
    "`medsafe run` under torchrun with 2 ranks: rank 0 holds the locks and writes one complete run, equal to one process's"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["run", "--model", f"hf:{tiny_model_dir}", "--scoring", "logprob", "--limit", "4", "--no-progress"]
    one = subprocess.run([sys.executable, "-m", "medsafe_nb.cli", *args, "--out", str(tmp_path / "one")], env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    dp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "medsafe_nb.cli",
                         *args, "--out", str(tmp_path / "dp")], env=env, capture_output=True, text=True, timeout=300)
    assert dp.returncode == 0, dp.stderr[-2000:]
    assert dp.stdout.count("statuses:") == 1                       # the summary once, from rank 0
    assert (tmp_path / "dp" / "manifest.json").is_file()
    cols = ["item_id", "condition", "target", "pred", "status"]
    a, b = (pd.read_parquet(tmp_path / d / "predictions.parquet")[cols] for d in ("one", "dp"))
    pd.testing.assert_frame_equal(a, b)


def test_generation_config_with_a_penalty_goes_through_generate(tmp_path, tiny_model_dir):
    "A checkpoint that ships a repetition penalty: the automatic path leaves decoding to `generate`, which applies it"
    import shutil
    from medsafe_nb.models.hf import HFBackend
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "penalised"))
    cfg = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**cfg, "repetition_penalty": 1.3}))
    auto, one = HFBackend(str(model), max_new_tokens=8), HFBackend(str(model), batch_size=1, max_new_tokens=8)
    assert auto._decouple is False and HFBackend(str(tiny_model_dir))._decouple is True
    reqs = [GenRequest(m) for m in messages(("clean",))]
    assert {i: g.text for i, g in auto.generate(reqs)} == {i: g.text for i, g in one.generate(reqs)}


def test_sampled_run_resumed_draws_what_an_uninterrupted_run_draws(tmp_path, tiny_model_dir):
    "--samples 2 --temperature 1 in-process: a run stopped after some items and resumed writes the replies of one run straight through"
    from medsafe_nb.run.runner import run
    common = dict(model=f"hf:{tiny_model_dir}", samples=2, temperature=1.0, max_new_tokens=8, progress=False)
    whole = run(out=str(tmp_path / "whole"), limit=4, **common)
    run(out=str(tmp_path / "part"), limit=2, **common)                         # the first items, then the run stops
    resumed = run(out=str(tmp_path / "part"), limit=4, **common)               # the same folder and ledger: the rest is asked
    cols = ["item_id", "condition", "sample", "raw", "pred"]
    key = ["item_id", "condition", "sample"]
    a, b = (d[cols].sort_values(key).reset_index(drop=True) for d in (whole, resumed))
    pd.testing.assert_frame_equal(a, b)
    assert a.groupby(["item_id", "condition"]).raw.nunique().max() == 2   # the two samples of a prompt differ


def _ledger_rows(path:Path)->int:
    "Rows the ledger holds now (0 while it does not exist yet)"
    import sqlite3
    if not path.is_file(): return 0
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try: return con.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
        finally: con.close()
    except sqlite3.OperationalError: return 0                    # the tables are being created


@pytest.mark.integration
def test_sigterm_to_a_two_process_torchrun_run(tmp_path, tiny_model_dir):
    """SIGTERM to torchrun during a two-rank `medsafe run`: every rank stops at its next decoding step and exits with 143,
    rank 0 leaves an uncommitted folder holding exactly the ledger's answers, nothing is left running, and the same
    command resumes it, asking only for the rest, to the rows of one process"""
    import psutil, signal, time
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["run", "--model", f"hf:{tiny_model_dir}", "--scoring", "generate", "--max-new-tokens", "48", "--batch-size", "1",
            "--limit", "16", "--no-progress"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "medsafe_nb.cli"]
    out = tmp_path / "dp"
    p = subprocess.Popen([*torchrun, *args, "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while _ledger_rows(out / "ledger.sqlite") < 4:            # some batches answered: the run is under way
            assert p.poll() is None, p.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the run answered nothing within 240 s"
            time.sleep(0.05)
        ranks = psutil.Process(p.pid).children(recursive=True)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)                           # as a scheduler preempting the job does
        log, _ = p.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None: p.kill(); p.communicate()
    assert took < 60, f"torchrun took {took:.0f} s to stop"
    assert not [r for r in ranks if r.is_running() and r.status() != psutil.STATUS_ZOMBIE], "a rank outlived torchrun"
    assert p.returncode != 0
    assert log.count("stopped by SIGTERM") == 2, log[-3000:]        # both ranks stopped themselves (no SIGKILL from the launcher)
    assert not (out / "manifest.json").exists()
    rec = json.loads((out / "run.json").read_text())
    kept = pd.read_parquet(out / "predictions.parquet")
    stored = _ledger_rows(out / "ledger.sqlite")
    assert rec["stopped"]["signal"] == "SIGTERM" and rec["stopped"]["rows_planned"] == 48
    assert len(kept) == rec["stopped"]["rows_answered"] == stored < 48 and set(kept.status) <= {"ok", "noanswer", "truncated"}
    again = subprocess.run([*torchrun, *args, "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    done = json.loads((out / "run.json").read_text())
    assert (out / "manifest.json").is_file() and "stopped" not in done
    assert (done["ledger_stats"]["cached"], done["ledger_stats"]["asked"]) == (stored, 48 - stored)   # nothing asked twice
    one = subprocess.run([sys.executable, "-m", "medsafe_nb.cli", *args, "--out", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    cols = ["item_id", "condition", "target", "raw", "pred", "status"]
    a, b = (pd.read_parquet(d / "predictions.parquet")[cols] for d in (tmp_path / "one", out))
    pd.testing.assert_frame_equal(a, b)
