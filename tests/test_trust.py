"""What a long, expensive run can still come to without anyone noticing, each tried against the real command line and
real HTTP servers on 127.0.0.1 (ports chosen by the OS): another checkpoint behind the same served name, a budget over
reruns, batches that never end, ledgers and prediction files from elsewhere, and absurd counts."""
import json, os, shutil, signal, sqlite3, subprocess, sys, time
from pathlib import Path

import pandas as pd
import pytest

from medsafe_nb.testing.mockserver import MockServer

MEDSAFE = [sys.executable, "-m", "medsafe_nb.cli"]


def medsafe(*args, env=None, timeout=300):
    return subprocess.run([*MEDSAFE, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)


def ok(r):
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


# --- the served checkpoint -------------------------------------------------------------------------------------------

def test_another_checkpoint_under_the_same_name_is_asked_afresh(tmp_path):
    "vLLM restarted on a new checkpoint with the same --served-model-name: the rerun asks every prompt again and says why"
    run = ["run", "-m", "openai:med", "--limit", 4, "--conditions", "clean", "-o", tmp_path / "run", "--no-progress"]
    with MockServer(policy=lambda m: "A", model="med", root="/ckpt/step-1000") as first:
        port = first.port
        ok(medsafe(*run, "--base-url", first.base_url))
    with MockServer(policy=lambda m: "B", model="med", root="/ckpt/step-2000", port=port) as second:   # same port, same name
        r = ok(medsafe(*run, "--base-url", second.base_url))
        asked = len(second.completions())
    df = pd.read_parquet(tmp_path / "run" / "predictions.parquet")
    assert asked == 4 and (df.pred == "B").all()                                 # nothing of the first server's is reported
    assert "now serves /ckpt/step-2000" in r.stderr and "1000" in r.stderr and len([l for l in r.stderr.splitlines() if "now serves" in l]) == 1
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    assert rec["identity"]["served"] == "/ckpt/step-2000"
    assert rec["engine"]["served"] == {"name": "med", "checkpoint": "/ckpt/step-2000", "reported": True}
    with MockServer(policy=lambda m: "B", model="med", root="/ckpt/step-2000", port=port) as again:      # the same checkpoint: all reused
        r = ok(medsafe(*run, "--base-url", again.base_url))
        assert len(again.completions()) == 0 and "now serves" not in r.stderr


def test_urls_serving_different_checkpoints_are_refused(tmp_path):
    with MockServer(model="med", root="/ckpt/a") as a, MockServer(model="med", root="/ckpt/b") as b:
        r = medsafe("run", "-m", "openai:med", "--base-url", f"{a.base_url},{b.base_url}", "--limit", 2, "-o", tmp_path, "--no-progress")
        assert r.returncode == 2 and f"{b.base_url} serves /ckpt/b as 'med', but {a.base_url} serves /ckpt/a" in r.stderr
        assert not a.completions() and not b.completions()


def test_a_server_that_reports_no_checkpoint_is_recorded_as_such(tmp_path):
    with MockServer(model="med") as srv:
        ok(medsafe("run", "-m", "openai:med", "--base-url", srv.base_url, "--limit", 2, "--conditions", "clean", "-o", tmp_path, "--no-progress"))
    rec = json.loads((tmp_path / "run.json").read_text())
    assert "served" not in rec["identity"] and rec["engine"]["served"] == {"name": "med", "checkpoint": None, "reported": False}


# --- a budget per run folder -----------------------------------------------------------------------------------------

def _prices(tmp_path, rate="1000.0"):
    p = tmp_path / "prices.yaml"
    p.write_text("prices:\n  - provider: openai\n    model: med\n    base_url: '*'\n    source: test rates\n    date: '2026-01-01'\n"
                 f"    input: {rate}\n    output: 1000.0\n")
    return p


def test_three_reruns_spend_at_most_the_cap(tmp_path):
    "Each request costs about $0.15 here: three reruns under --max-cost 1.0 spend at most $1.00 in all, not $1.00 each"
    prices, out = _prices(tmp_path), tmp_path / "run"
    cmd = ["run", "-m", "openai:med", "--conditions", "clean", "--limit", 30, "--max-new-tokens", 32, "--prices", prices,
           "--max-cost", "1.0", "-o", out, "--no-progress"]
    with MockServer(model="med") as srv:
        codes = [medsafe(*cmd, "--base-url", srv.base_url).returncode for _ in range(3)]
        log = srv.completions()
        replies = [r["body"] for r in log if r["status"] == 200]
    assert codes == [4, 4, 4]
    spent = sum(json.loads(l)["usd"] for l in (out / "spend.jsonl").read_text().splitlines())
    assert 0.5 < spent <= 1.0 and len(replies) == len((out / "spend.jsonl").read_text().splitlines())
    with MockServer(model="med") as srv:                                          # a lower cap than already spent: no request at all
        r = medsafe(*cmd[:-5], "--max-cost", "0.25", "-o", out, "--no-progress", "--base-url", srv.base_url)
        assert r.returncode == 4 and not srv.completions() and "earlier runs of this folder" in r.stderr
        dry = ok(medsafe(*cmd, "--dry-run", "--base-url", srv.base_url))
        assert not srv.completions()
    assert f"--max-cost $1.00: ${spent:,.2f} spent in its run folder, ${1 - spent:,.2f} left; projected" in dry.stdout


def test_a_price_that_is_not_a_finite_number_is_refused(tmp_path):
    for rate in (".nan", ".inf"):
        r = medsafe("run", "-m", "openai:med", "--base-url", "http://127.0.0.1:9/v1", "--prices", _prices(tmp_path, rate),
                    "--max-cost", "1", "-o", tmp_path / "run", "--no-progress")
        assert r.returncode == 2 and "prices.yaml:7: field 'prices[0].input': expected USD per million tokens (a finite number >= 0)" in r.stderr


# --- exact token counts ----------------------------------------------------------------------------------------------

def test_estimate_counts_openai_tokens_exactly_and_labels_the_rest(tmp_path):
    params = tmp_path / "p.yaml"
    params.write_text(f"data: sample\nlimit: 4\nconditions: clean,type1\nruns_dir: {tmp_path}/runs\nfigures_dir: {tmp_path}/fig\n"
                      "models:\n  - model: openai:gpt-5.4\n  - model: openai:gpt-4-turbo\n  - model: anthropic:claude-sonnet-4-6\n  - model: tiny\n")
    r = ok(medsafe("estimate", params))
    assert "- gpt-5.4: exact (o200k_base)" in r.stdout and "- gpt-4-turbo: exact (cl100k_base)" in r.stdout
    assert "- claude-sonnet-4-6: approximate" in r.stdout and "- tiny-llama (random weights, chance control): approximate" in r.stdout


# --- batches that end ------------------------------------------------------------------------------------------------

BATCH = ["run", "-m", "openai:mock-model", "--batch", "--batch-poll-s", "0.05", "--limit", 4, "--conditions", "clean,type1",
         "--max-new-tokens", 64, "--no-progress"]


def test_a_malformed_result_line_costs_only_its_request(tmp_path):
    with MockServer(policy="hash", batch_faults={1: "garble"}, batch_polls=1) as srv:
        ok(medsafe(*BATCH, "--base-url", srv.base_url, "-o", tmp_path))
        sizes = [len(srv._files[b["input_file_id"]]["_data"].splitlines()) for b in srv._batches.values()]
    assert sizes == [8, 1] and (pd.read_parquet(tmp_path / "predictions.parquet").status == "ok").all()
    assert json.loads((tmp_path / "run.json").read_text())["batch"]["unreadable"] == 1


def test_a_batch_that_never_ends_has_a_deadline_and_a_forgotten_one_is_resubmitted(tmp_path):
    with MockServer(policy="hash", batch_polls=10**9) as srv:
        port = srv.port
        r = medsafe(*BATCH, "--base-url", srv.base_url, "-o", tmp_path, "--batch-wait-s", "0.5")
    assert r.returncode == 3 and "batch: batch_mock_1 (8 requests) still running after" in r.stderr and "run the same command again" in r.stderr
    with MockServer(policy="hash", batch_polls=1, port=port) as forgetful:         # the provider lost the batch (HTTP 404)
        ok(medsafe(*BATCH, "--base-url", forgetful.base_url, "-o", tmp_path))
        assert len(forgetful._batches) == 1
    assert len(pd.read_parquet(tmp_path / "predictions.parquet")) == 8


def test_sigint_during_a_batch_wait_stops_within_the_grace(tmp_path):
    with MockServer(policy="hash", batch_polls=10**9) as srv:
        p = subprocess.Popen([*MEDSAFE, *map(str, BATCH), "--base-url", srv.base_url, "-o", str(tmp_path), "--stop-grace-s", "2",
                              "--batch-poll-s", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not srv._batches and time.monotonic() < deadline and p.poll() is None: time.sleep(0.05)   # the batch is submitted
        assert srv._batches, p.communicate()
        t0 = time.monotonic(); p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    assert p.returncode == 130 and took < 10, (took, err)
    assert "batch_mock_1 (8 requests) stay at the provider" in err


# --- ledgers that are not ours ---------------------------------------------------------------------------------------

def test_another_applications_database_is_left_untouched(tmp_path):
    db = tmp_path / "app.sqlite"
    c = sqlite3.connect(db); c.execute("CREATE TABLE responses (id INTEGER PRIMARY KEY, body TEXT)"); c.execute("INSERT INTO responses VALUES (1, 'x')")
    c.commit(); c.close()
    before = db.read_bytes()
    r = medsafe("run", "-m", "shortcut:longest", "--limit", 2, "-o", tmp_path / "run", "--ledger", db, "--no-progress")
    assert r.returncode == 2 and "a SQLite database of another application" in r.stderr
    assert db.read_bytes() == before and not list(tmp_path.glob("app.sqlite-*"))
    assert medsafe("ledger", "check", db).returncode == 1


def test_ledger_check_reads_every_row_and_a_zero_byte_file_is_a_new_ledger(tmp_path):
    out = tmp_path / "run"
    ok(medsafe("run", "-m", "shortcut:longest", "--limit", 3, "-o", out, "--no-progress"))
    led = out / "ledger.sqlite"
    assert "intact, 9 responses" in ok(medsafe("ledger", "check", led)).stdout
    c = sqlite3.connect(led); c.execute("UPDATE responses SET result='{\"text\": 1}' WHERE rowid=2"); c.commit(); c.close()
    r = medsafe("ledger", "check", led)
    assert r.returncode == 1 and "1 of 9 responses cannot be read" in r.stderr and "medsafe ledger salvage" in r.stderr
    r = medsafe("run", "-m", "shortcut:longest", "--limit", 3, "-o", out, "--no-progress")
    assert r.returncode == 2 and "cannot be read" in r.stderr and "Traceback" not in r.stderr
    zero = tmp_path / "zero.sqlite"; zero.write_bytes(b"")
    assert "an empty file: no ledger yet" in ok(medsafe("ledger", "check", zero)).stdout
    ok(medsafe("run", "-m", "shortcut:longest", "--limit", 2, "-o", tmp_path / "r2", "--ledger", zero, "--no-progress"))
    assert "intact, 6 responses" in ok(medsafe("ledger", "check", zero)).stdout


def _as_nobody()->list|None:
    "A command prefix that runs as user nobody (so that file permissions apply), or None where that is not possible"
    if os.geteuid() != 0 or not shutil.which("setpriv"): return None
    pre = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run([*pre, sys.executable, "-c", "import medsafe_nb.cli"], capture_output=True)
    return pre if probe.returncode == 0 else None


def test_a_read_only_ledger_is_named_as_read_only(tmp_path):
    pre = _as_nobody()
    if pre is None: pytest.skip("needs root and setpriv to run a command as another user (file permissions do not bind root)")
    import tempfile
    base = Path(tempfile.mkdtemp(dir="/tmp")); os.chmod(base, 0o777)           # outside pytest's private folders: nobody can reach it
    out = base / "run"
    ok(medsafe("run", "-m", "shortcut:longest", "--limit", 2, "-o", out, "--no-progress"))
    ro = base / "ro"; ro.mkdir(); shutil.copy(out / "ledger.sqlite", ro / "ledger.sqlite")
    os.chmod(ro / "ledger.sqlite", 0o444); os.chmod(ro, 0o777)                 # the file read-only, its folder not
    r = subprocess.run([*pre, *MEDSAFE, "run", "-m", "shortcut:longest", "--limit", "2", "-o", str(base / "mine"), "--ledger",
                        str(ro / "ledger.sqlite"), "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "the ledger cannot be written (the file is read-only)" in r.stderr and "readonly database" not in r.stderr
    r = subprocess.run([*pre, *MEDSAFE, "ledger", "check", str(ro / "ledger.sqlite")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "intact" in r.stdout
    shutil.rmtree(base)


# --- prediction files from elsewhere ---------------------------------------------------------------------------------

def test_metrics_on_the_tools_own_predictions_file_gives_the_run_folders_tables(tmp_path):
    run = tmp_path / "run"
    ok(medsafe("run", "-m", "shortcut:longest", "--limit", 12, "-o", run, "--no-progress"))
    ok(medsafe("metrics", run, "-o", tmp_path / "from_run"))
    ok(medsafe("metrics", "--predictions", run / "predictions.parquet", "-o", tmp_path / "from_file"))
    names = sorted(p.name for p in (tmp_path / "from_run").glob("*.csv"))
    assert names == sorted(p.name for p in (tmp_path / "from_file").glob("*.csv")) and "usage.csv" in names
    for n in names:
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "from_file" / n).drop(columns="origin"), pd.read_csv(tmp_path / "from_run" / n))
    r = medsafe("metrics", "--predictions", run, "-o", tmp_path / "o")
    assert r.returncode == 2 and "a folder, not a predictions file" in r.stderr


def test_metrics_on_a_table_without_token_or_cost_columns(tmp_path):
    rows = ["model,item_id,condition,target,gold,pred,correct,status,prompt_tokens,completion_tokens"]
    for i, (q, g) in enumerate([("q1", "A"), ("q2", "B"), ("q3", "C")]):
        rows += [f"=cmd|calc,{q},clean,,{g},{g},true,ok,{i + 1},5", f"=cmd|calc,{q},type1,D,{g},D,false,ok,{i + 1},5"]
    (tmp_path / "hand.csv").write_text("\n".join(rows) + "\n")
    ok(medsafe("metrics", "--predictions", tmp_path / "hand.csv", "-o", tmp_path / "out"))
    usage = pd.read_csv(tmp_path / "out" / "usage.csv", dtype=str)
    assert usage.prompt_tokens.tolist() == ["12"]                                 # 1+2+3 twice, counted as numbers
    assert usage.model.tolist() == ["'=cmd|calc"]                                 # a formula-like cell is escaped in every CSV
    assert (tmp_path / "out" / "table1.csv").read_text().splitlines()[1].startswith("'=cmd|calc,")


# --- absurd counts and other silences --------------------------------------------------------------------------------

def test_absurd_counts_are_refused_at_once(tmp_path):
    t0 = time.monotonic()
    r = medsafe("run", "-m", "openai:gpt-5.4", "--samples", 1_000_000, "--dry-run", "-o", tmp_path)
    assert r.returncode == 2 and "samples: expected an integer between 1 and 10,000" in r.stderr and time.monotonic() - t0 < 60
    r = medsafe("run", "-m", "shortcut:longest", "--subset", 500, "-o", tmp_path / "s", "--no-progress")
    assert r.returncode == 2 and "subset: 500 items asked for, but the data holds 106" in r.stderr and not (tmp_path / "s" / "run.json").exists()
    r = medsafe("run", "-m", "shortcut:longest", "--conditions", "clean,clean", "-o", tmp_path / "c", "--no-progress")
    assert r.returncode == 2 and "conditions: clean given more than once" in r.stderr


def test_the_mean_row_error_names_the_flag(tmp_path):
    with MockServer(policy="hash") as srv:                                       # two language models, on different item sets
        ok(medsafe("run", "-m", "openai:m1", "--base-url", srv.base_url, "--limit", 4, "-o", tmp_path / "a", "--no-progress"))
        ok(medsafe("run", "-m", "openai:m2", "--base-url", srv.base_url, "--limit", 6, "-o", tmp_path / "b", "--no-progress"))
    r = medsafe("metrics", tmp_path / "a", tmp_path / "b", "-o", tmp_path / "m")
    assert r.returncode == 2 and "pass --mean-over shared" in r.stderr


def test_a_truncated_gguf_and_a_bad_cache_are_clear_errors(tmp_path):
    from medsafe_nb.models.gguf import smollm2_gguf
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf(), "rb") as f: cut.write_bytes(f.read(300_000))
    r = medsafe("run", "-m", f"hf:{cut}", "--limit", 1, "-o", tmp_path / "r", "--no-progress", env={**os.environ, "MEDSAFE_GGUF_CACHE": str(tmp_path / "c")})
    assert r.returncode == 2 and "cut.gguf is not a complete GGUF file" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "file").write_text("x")
    r = medsafe("run", "-m", f"hf:{cut}", "--limit", 1, "-o", tmp_path / "r", "--no-progress", env={**os.environ, "MEDSAFE_GGUF_CACHE": str(tmp_path / "file")})
    assert r.returncode == 2 and "is a file, not a folder: set MEDSAFE_GGUF_CACHE to a writable folder" in r.stderr


def test_a_read_only_gguf_cache_is_named(tmp_path):
    pre = _as_nobody()
    if pre is None: pytest.skip("needs root and setpriv to run a command as another user (file permissions do not bind root)")
    import tempfile
    from medsafe_nb.models.gguf import smollm2_gguf
    base = Path(tempfile.mkdtemp(dir="/tmp")); os.chmod(base, 0o777)
    cache = base / "cache"; cache.mkdir(); os.chmod(cache, 0o555)               # a cache nobody may write
    r = subprocess.run([*pre, *MEDSAFE, "run", "-m", "smollm2", "--limit", "1", "-o", str(base / "r"), "--no-progress"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "MEDSAFE_GGUF_CACHE": str(cache)})
    shutil.rmtree(base)
    if "cannot write the GGUF cache" not in r.stderr and f"{smollm2_gguf()}" in r.stderr: pytest.skip("the packaged GGUF is not readable by another user here")
    assert r.returncode == 2 and f"cannot write the GGUF cache {cache} (Permission denied): set MEDSAFE_GGUF_CACHE to a writable folder" in r.stderr
