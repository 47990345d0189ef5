"""`medsafe run` against a real OpenAI-compatible HTTP server on 127.0.0.1, through the official `openai` client:
end to end with rate limits and server errors, secrets kept out of every artefact, and SIGKILL + resume."""
import json, os, signal, sqlite3, subprocess, sys, time
from pathlib import Path

import pandas as pd

from medsafe_nb.testing.mockserver import MockServer
from medsafe_nb.testing.mockscript import FaultPlan, choose_context
from medsafe_nb.items.release import load_medmisbench
from medsafe_nb.protocols import build_prompts

MEDSAFE = [sys.executable, "-m", "medsafe_nb.cli"]


def medsafe(*args, env=None):
    r = subprocess.run([*MEDSAFE, *map(str, args)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, f"medsafe {' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr}"
    return r


def canon(messages) -> str:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def ledger_messages(path: Path) -> list[str]:
    "The messages of every request committed to a ledger (read-only, while another process may write)"
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try: rows = con.execute("SELECT request FROM responses").fetchall()
    finally: con.close()
    return [canon(json.loads(r)["messages"]) for (r,) in rows]


def test_end_to_end_with_429_and_500(tmp_path):
    faults = FaultPlan({"429": 0.15, "500": 0.08}, seed=3, retry_after=1)
    with MockServer(policy="context", faults=faults) as srv:
        medsafe("run", "--model", "openai:mock-model", "--base-url", srv.base_url, "--out", tmp_path,
                "--concurrency", 8, "--no-progress")
        log = srv.completions()
    items = load_medmisbench()
    df = pd.read_parquet(tmp_path / "predictions.parquet")
    assert len(df) == 3 * len(items) and (df.status == "ok").all()          # every item accounted for, none lost
    statuses = pd.Series([r["status"] for r in log]).value_counts()
    assert statuses.get(429, 0) > 0 and statuses.get(500, 0) > 0           # the faults really happened …
    assert statuses[200] == len(df)                                         # … and each prompt succeeded exactly once
    # the server's answer policy (the option the context argues for) is what the predictions record
    prompts = {(p.item_id, p.condition): p for p in build_prompts(items)}
    expect = df.apply(lambda r: choose_context(list(prompts[(r.item_id, r.condition)].messages)), axis=1)
    assert (df.pred == expect).all()
    t1 = df[df.condition == "type1"]
    assert (t1.pred == t1.target).mean() > 0.5                              # a context-following model: mostly fooled, to the target
    rec = json.loads((tmp_path / "run.json").read_text())
    assert rec["model"] == "openai:mock-model" and rec["identity"]["base_url"].startswith("http://127.0.0.1:")


def test_key_from_env_never_written(tmp_path):
    key = "sk-medsafe-test-" + "x" * 32
    env = {**os.environ, "OPENAI_API_KEY": key}
    with MockServer(policy="hash", api_key=key) as srv:
        medsafe("run", "--model", "openai:mock-model", "--base-url", srv.base_url, "--out", tmp_path, "--limit", 5,
                "--no-progress", env=env)
        assert all(r["authorized"] for r in srv.completions())             # the key reached the server …
    for f in tmp_path.rglob("*"):
        if f.is_file(): assert key.encode() not in f.read_bytes(), f"API key leaked into {f}"   # … and nothing else


def test_sigkill_then_resume(tmp_path):
    args = ["run", "--model", "openai:mock-model", "--concurrency", 4, "--limit", 40, "--no-progress"]
    import threading
    gate, held = threading.Event(), {"after": None}                        # requests past the 40th of the killed run wait here,
    def delay(n, body):                                                    # so the kill lands mid-run however busy the machine
        if held["after"] is not None and n > held["after"] + 40: gate.wait(120)
        return 0.04
    with MockServer(policy="hash", delay=delay) as srv:
        args += ["--base-url", srv.base_url]
        medsafe(*args, "--out", tmp_path / "ref")                          # the uninterrupted run
        held["after"] = len(srv.requests)
        ledger = tmp_path / "killed" / "ledger.sqlite"
        proc = subprocess.Popen([*MEDSAFE, *map(str, args), "--out", str(tmp_path / "killed")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            if ledger.exists():
                try:
                    if len(ledger_messages(ledger)) >= 30: break
                except sqlite3.OperationalError: pass
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL); proc.wait()
        gate.set()                                                         # the resume is answered at once
        committed = set(ledger_messages(ledger))
        assert 30 <= len(committed) < 120, "the kill should land mid-run"
        assert not (tmp_path / "killed" / "predictions.parquet").exists()
        mark = len(srv.completions())
        medsafe(*args, "--out", tmp_path / "killed")                       # same arguments: resume
        asked_again = [canon(r["body"]["messages"]) for r in srv.completions()[mark:]]
    assert not committed & set(asked_again), "a request committed before the kill was asked again"
    assert len(asked_again) == 120 - len(committed)                        # exactly the missing ones, once each
    ref = pd.read_parquet(tmp_path / "ref" / "predictions.parquet").drop(columns="latency_s")
    res = pd.read_parquet(tmp_path / "killed" / "predictions.parquet").drop(columns="latency_s")
    pd.testing.assert_frame_equal(ref, res)
    final = ledger_messages(ledger)
    assert len(final) == len(set(final)) == 120                            # no duplicate rows
