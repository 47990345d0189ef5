"""Provider scale: the dry-run estimate offline, --max-cost that holds and resumes, --batch against the mock server's
Batch API (same answers as live; kill -9 at random moments loses nothing and submits nothing twice)."""
import json, random, signal, socket, subprocess, sys
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from medsafe_nb.cli import app
from medsafe_nb.run.cost import BudgetReached, load_prices, request_cost
from medsafe_nb.run.runner import run
from medsafe_nb.run.process import EXIT_BUDGET
from medsafe_nb.run.ledger import Ledger
from medsafe_nb.testing.mockserver import MockServer

MEDSAFE = [sys.executable, "-m", "medsafe_nb.cli"]
RATE = {"input": 1000.0, "output": 2000.0, "batch_input": 500.0, "batch_output": 1000.0}


def mock_prices(tmp_path: Path) -> Path:
    "A price table for the mock server's model (any server), at rates that make a few requests cost dollars"
    p = tmp_path / "prices.yaml"
    p.write_text("prices:\n  - {provider: openai, model: mock-model, base_url: '*', input: 1000.0, output: 2000.0, batch_input: 500.0, "
                 "batch_output: 1000.0, source: 'test rate', date: '2026-12-01'}\n")
    return p


def test_estimate_paper_without_network(monkeypatch):
    "medsafe estimate paper: every model of paper.yaml, prompts from the release's split sizes, no socket opened"
    def no_network(*a, **k): raise OSError("network disabled in this test")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    for v in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY"): monkeypatch.delenv(v, raising=False)
    r = CliRunner().invoke(app, ["estimate", "paper"])
    assert r.exit_code == 0, r.output
    rows = [l for l in r.output.splitlines() if l.startswith("| ") and not l.startswith("| model")]
    assert len(rows) == 12                                            # 11 configurations and the total
    assert all(" | 32,796 | 32,796 | " in l for l in rows[:11])        # 10,932 items x 3 conditions, none answered yet
    gpt = next(l for l in rows if l.startswith("| GPT-5.4 (none)"))
    live, batch = [float(c.strip().lstrip("$").replace(",", "")) for c in gpt.split("|")[6:8]]
    assert batch == pytest.approx(live / 2, rel=1e-3)
    assert "| Qwen3.6-27B |" in r.output and r.output.count("no price") >= 6


def test_dry_run_asks_nothing(tmp_path):
    with MockServer() as srv:
        r = CliRunner().invoke(app, ["run", "--model", "openai:mock-model", "--base-url", srv.base_url, "--out", str(tmp_path / "r"),
                                     "--limit", "4", "--dry-run", "--prices", str(mock_prices(tmp_path))])
        assert r.exit_code == 0, r.output
        assert [(q["method"], q["path"]) for q in srv.requests] == [("GET", "/v1/models")]   # what it serves (its ledger identity), no completion
    assert "| openai:mock-model | 12 | 12 |" in r.output and "test rate" in r.output
    assert not (tmp_path / "r" / "run.json").exists()


def test_max_cost_stops_within_one_request_and_resumes(tmp_path):
    prices = mock_prices(tmp_path)
    with MockServer(policy="hash") as srv:
        kw = dict(model="openai:mock-model", base_url=srv.base_url, out=str(tmp_path / "run"), limit=8, progress=False,
                  prices=str(prices), max_new_tokens=64, concurrency=4)
        with pytest.raises(BudgetReached, match="max-cost") as e:
            run(**kw, max_cost=1.0)
        asked = len(srv.completions())
        with Ledger(tmp_path / "run" / "ledger.sqlite") as led: rows = list(led.rows())
        price = load_prices(prices)[("openai", "mock-model")]
        spent = sum(request_cost(price, r["result"]["prompt_tokens"], r["result"]["completion_tokens"]) for r in rows)
        import re
        worst = float(re.search(r"may cost up to \$([0-9.]+)", str(e.value)).group(1))   # the next request's worst case
        assert 0 < asked == len(rows) < 24
        assert spent <= 1.0 < spent + worst                               # never crossed; stopped within one request of it
        assert f"spent ${spent:,.4f}" in str(e.value)
        assert not (tmp_path / "run" / "run.json").exists()             # not committed: the run did not end
        from medsafe_nb.run.estimate import estimate_run
        from medsafe_nb.run.config import RunConfig
        est = estimate_run(RunConfig(**kw))                                # the dry run now counts what the ledger holds
        assert (est["prompts"], est["missing"], est["expected_from"]) == (24, 24 - asked, f"ledger ({asked} answers)")
        assert est["cost_usd_expected"] < est["cost_usd_max"]
        df = run(**kw, max_cost=1000.0)                                    # rerun: only the rest is asked
        assert len(df) == 24 and (df.status == "ok").all()
        assert len(srv.completions()) == 24
        rec = json.loads((tmp_path / "run" / "run.json").read_text())
        assert rec["cost"]["this_run"]["replies"] == 24 - asked
        assert rec["cost"]["rows"]["openai:mock-model"]["cost_usd"] == pytest.approx(df.cost_usd.sum(), rel=1e-6)


def test_max_cost_exit_code(tmp_path):
    with MockServer(policy="hash") as srv:
        r = subprocess.run([*MEDSAFE, "run", "--model", "openai:mock-model", "--base-url", srv.base_url, "--out", str(tmp_path / "r"),
                            "--limit", "8", "--no-progress", "--prices", str(mock_prices(tmp_path)), "--max-cost", "0.5", "--max-new-tokens", "64"],
                           capture_output=True, text=True)
    assert r.returncode == EXIT_BUDGET == 4, r.stderr
    assert "--max-cost $0.50 reached" in r.stderr and "rerun" in r.stderr


def test_batch_run_gives_the_live_answers(tmp_path):
    with MockServer(policy="hash", batch_faults={1: "expire"}) as srv:
        common = dict(model="openai:mock-model", base_url=srv.base_url, limit=6, progress=False, max_new_tokens=64)
        batch = run(**common, out=str(tmp_path / "batch"), batch=True, batch_poll_s=0.0)
        live = run(**common, out=str(tmp_path / "live"))
        rec = json.loads((tmp_path / "batch" / "run.json").read_text())
    assert batch[["item_id", "condition", "pred", "raw", "status"]].equals(live[["item_id", "condition", "pred", "raw", "status"]])
    assert rec["batch"]["submitted"] == 2 and rec["batch"]["resubmitted"] == 9      # the expired batch's second half, sent again


def _batch_inputs(srv) -> list[list[str]]:
    "The custom ids of every batch the server created"
    return [[json.loads(l)["custom_id"] for l in srv._files[b["input_file_id"]]["_data"].decode().splitlines()] for b in srv._batches.values()]


@pytest.mark.integration
def test_batch_survives_kill9_without_duplicate_submissions(tmp_path):
    "SIGKILL a --batch run at seeded random moments, rerun until it ends: every request in exactly one batch, answers as live"
    rng = random.Random(21)
    with MockServer(policy="hash", batch_polls=6) as srv:
        args = [*MEDSAFE, "run", "--model", "openai:mock-model", "--base-url", srv.base_url, "--out", str(tmp_path / "batch"),
                "--limit", "12", "--no-progress", "--batch", "--batch-poll-s", "0.2", "--max-new-tokens", "64"]
        kills = 0
        for attempt in range(12):
            p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try: p.wait(timeout=rng.uniform(0.5, 4.0) if attempt < 6 else 120)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL); p.wait(); kills += 1; continue
            assert p.returncode == 0, p.stderr.read()
            break
        else: pytest.fail("the batch run never finished")
        ids = [k for b in _batch_inputs(srv) for k in b]
        live = run(model="openai:mock-model", base_url=srv.base_url, out=str(tmp_path / "live"), limit=12, progress=False, max_new_tokens=64)
        polls = sum(1 for r in srv.requests if r["method"] == "GET" and "/batches/" in r["path"])
    print(f"batch run: {kills} kills, {len(_batch_inputs(srv))} batches created, {len(ids)} requests submitted, {polls} polls")
    assert kills >= 1
    assert len(ids) == 36 and max(Counter(ids).values()) == 1        # nothing submitted twice
    batch = pd.read_parquet(tmp_path / "batch" / "predictions.parquet")
    assert batch[["item_id", "condition", "pred"]].equals(live[["item_id", "condition", "pred"]])


def _prompts(n):
    from medsafe_nb.items.release import load_medmisbench
    from medsafe_nb.protocols import build_prompts
    from medsafe_nb.models.base import GenRequest
    return [GenRequest(p.messages, 16) for p in build_prompts(load_medmisbench(), ("clean", "type1", "type2"))][:n]


def test_adaptive_concurrency_halves_under_429_storm_and_recovers():
    from medsafe_nb.models.base import make_backend
    from medsafe_nb.testing.mockscript import Fault
    storm = lambda n, attempt, body: Fault("429", retry_after=0) if n <= 30 else None     # the first 30 tries: rate limited
    with MockServer(policy="hash", faults=storm) as srv:
        be = make_backend("openai:mock-model", base_url=srv.base_url, concurrency=8, adaptive=True, max_retries=30, backoff=0.0, max_new_tokens=16)
        got = list(be.generate(_prompts(240)))
        fixed = make_backend("openai:mock-model", base_url=srv.base_url, concurrency=8, max_new_tokens=16)
    lim = be.limits[0]
    assert len(got) == 240 and all(g.finish_reason != "error" for _, g in got)
    assert lim.history[0] == 8 and lim.history[1] == 4 and min(lim.history) <= 2   # halved, and again while the storm lasted
    assert lim.limit == 8                                                      # recovered after the storm, one slot per quiet window
    assert be.concurrency_note() == "limit 8/8" and fixed.concurrency_note() == "limit 8" and fixed.limits is None


def test_estimate_counts_with_a_local_models_tokenizer(tiny_model_dir):
    "A local hf: folder brings its tokenizer: the estimate's input tokens are its exact counts, chat template included"
    from transformers import AutoTokenizer
    from medsafe_nb.run.estimate import estimate_run
    from medsafe_nb.run.config import RunConfig
    from medsafe_nb.items.release import load_medmisbench
    from medsafe_nb.protocols import build_prompts
    row = estimate_run(RunConfig(model=f"hf:{tiny_model_dir}", limit=3, max_new_tokens=8))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    def n(msgs):
        ids = tok.apply_chat_template([dict(m) for m in msgs], tokenize=True, add_generation_prompt=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    exact = sum(n(p.messages) for p in build_prompts(load_medmisbench()[:3], ("clean", "type1", "type2")))
    assert (row["tokens"], row["input_tokens"], row["prompts"], row["price"]) == ("the model's tokenizer", exact, 9, "no price")
