"""`medsafe run` end to end on this machine's offline models: the MiniLM baseline and the tiny random-weight HF model."""
import json, subprocess, sys

import pandas as pd
import pytest

from medsafe_nb.protocols import type1_target
from medsafe_nb.items.release import load_medmisbench
from medsafe_nb.core import STATUSES
from medsafe_nb.run.predictions import PREDICTION_COLUMNS

MEDSAFE = [sys.executable, "-m", "medsafe_nb.cli"]
LIMIT = 12


def medsafe(*args, check=True):
    "Run the console script in a subprocess, the way a user does"
    r = subprocess.run([*MEDSAFE, *map(str, args)], capture_output=True, text=True)
    if check and r.returncode != 0: raise AssertionError(f"medsafe {' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="module")
def minilm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "minilm"
    medsafe("run", "--data", "sample", "--model", "minilm", "--out", out, "--limit", LIMIT, "--no-progress")
    return out


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, tiny_model_dir):
    base = tmp_path_factory.mktemp("runs")
    for scoring in ("generate", "logprob"):
        medsafe("run", "--data", "sample", "--model", f"hf:{tiny_model_dir}", "--out", base / scoring, "--limit", LIMIT,
                "--scoring", scoring, "--max-new-tokens", 12, "--batch-size", 8, "--no-progress")
    return base


def test_minilm_run_writes_contract(minilm_run):
    df = pd.read_parquet(minilm_run / "predictions.parquet")
    assert list(df.columns) == PREDICTION_COLUMNS
    assert len(df) == 3 * LIMIT and not df.duplicated(["model", "item_id", "condition", "target"]).any()
    assert set(df.status) <= set(STATUSES)
    assert df.model.iloc[0] == "minilm (non-LLM baseline)"
    rec = json.loads((minilm_run / "run.json").read_text())
    assert rec["n_items"] == LIMIT and rec["is_llm"] is False and rec["counts"]["rows"] == 3 * LIMIT
    items = load_medmisbench()[:LIMIT]
    assert list(dict.fromkeys(df.item_id)) == [it.id for it in items]       # --limit takes the first N in file order


def test_tiny_hf_generate_and_logprob(tiny_runs):
    gen = pd.read_parquet(tiny_runs / "generate" / "predictions.parquet")
    lp = pd.read_parquet(tiny_runs / "logprob" / "predictions.parquet")
    assert len(gen) == len(lp) == 3 * LIMIT
    assert {"p_gold", "p_target"} <= set(lp.columns) and lp.p_gold.between(0, 1).all() and lp.p_target.notna().all()
    assert (lp.status == "ok").all() and lp.pred.notna().all()
    # random weights and a 12-token cap: the tiny model rarely names an option; every reply still gets a status
    assert set(gen.status) <= {"ok", "noanswer", "truncated"}
    assert gen.completion_tokens.max() <= 12


def test_type1_target_same_across_models(minilm_run, tiny_runs):
    frames = [pd.read_parquet(p / "predictions.parquet") for p in (minilm_run, tiny_runs / "generate", tiny_runs / "logprob")]
    targets = [f[f.condition == "type1"].set_index("item_id").target for f in frames]
    for t in targets[1:]: pd.testing.assert_series_equal(targets[0], t, check_names=False)
    items = {it.id: it for it in load_medmisbench()}
    assert all(targets[0][i] == type1_target(items[i], 0) for i in targets[0].index)


def test_rerun_asks_nothing(minilm_run):
    before = pd.read_parquet(minilm_run / "predictions.parquet")
    medsafe("run", "--data", "sample", "--model", "minilm", "--out", minilm_run, "--limit", LIMIT, "--no-progress")
    rec = json.loads((minilm_run / "run.json").read_text())
    assert rec["ledger_stats"]["asked"] == 0 and rec["ledger_stats"]["cached"] == 3 * LIMIT
    pd.testing.assert_frame_equal(before, pd.read_parquet(minilm_run / "predictions.parquet"))


def test_only_clean_correct(tmp_path, minilm_run):
    medsafe("run", "--model", "minilm", "--out", tmp_path, "--limit", LIMIT, "--only-clean-correct", "--no-progress",
            "--ledger", minilm_run / "ledger.sqlite")
    df = pd.read_parquet(tmp_path / "predictions.parquet")
    right = set(df[(df.condition == "clean") & df.correct].item_id)
    assert set(df[df.condition != "clean"].item_id) == right
    rec = json.loads((tmp_path / "run.json").read_text())
    assert rec["only_clean_correct"] is True and rec["ledger_stats"]["asked"] == 0   # shared ledger: nothing asked twice


def test_bad_arguments_exit_cleanly(tmp_path):
    r = medsafe("run", "--model", "llama:x", "--out", tmp_path, check=False)
    assert r.returncode == 2 and "unknown model spec 'llama:x'" in r.stderr and "Traceback" not in r.stderr
    r = medsafe("run", "--model", "minilm", "--out", tmp_path, "--data", tmp_path / "missing.jsonl", check=False)
    assert r.returncode == 2 and "no such file or folder" in r.stderr


def test_metrics_cli_on_runs(tmp_path, minilm_run, tiny_runs):
    medsafe("metrics", minilm_run, tiny_runs / "generate", "--out", tmp_path, "--n-boot", 200)
    t1 = pd.read_csv(tmp_path / "table1.csv")
    assert set(t1.model) >= {"minilm (non-LLM baseline)"} and {"table1.csv", "breakdowns.csv", "mcnemar.csv"} <= {p.name for p in tmp_path.iterdir()}
