"""Ledger reliability across processes: SIGKILL mid-run then resume, and two writers on one ledger."""
import json, os, signal, sqlite3, subprocess, sys, time
from pathlib import Path

import pytest

from medsafe_nb.run.ledger import Ledger, request_key, request_payload
from medsafe_nb.models.base import GenRequest

ROOT = Path(__file__).resolve().parents[1]

# A run in a separate process: `n` requests `q{(start+i) % distinct}`, asked of a slow backend that appends every
# question it is asked to a log file (before answering it), through cached_generate and the ledger.
WORKER = r'''
import json, os, sys, time
from dataclasses import asdict
from medsafe_nb.models.base import Backend, GenRequest, Generation
from medsafe_nb.run.ledger import Ledger, cached_generate

ledger_path, log_path, out_path, go_path = sys.argv[1:5]
start, n, distinct, delay = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]), float(sys.argv[8])

class Slow(Backend):
    kind, model = "slow", "slow-1"
    def identity(self): return {"kind": self.kind, "model": self.model, "temperature": 0}
    def generate(self, requests):
        with open(log_path, "a", encoding="utf-8") as log:
            for i, r in enumerate(requests):
                q = r.messages[-1]["content"]
                log.write(q + "\n"); log.flush()
                if delay: time.sleep(delay)
                yield i, Generation(f"answer to {q}", "stop", prompt_tokens=len(q), completion_tokens=3)

requests = [GenRequest(({"role": "user", "content": f"q{(start + i) % distinct:04d}"},)) for i in range(n)]
if go_path != "-":
    while not os.path.exists(go_path): time.sleep(0.001)
with Ledger(ledger_path) as led:
    out = cached_generate(Slow(), requests, led, progress=False)
    counts = asdict(led.last)
with open(out_path, "w") as f: json.dump({"results": [asdict(g) for g in out], "counts": counts}, f)
'''

IDENTITY = {"kind": "slow", "model": "slow-1", "temperature": 0}


@pytest.fixture
def worker(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RANK", None)
    def start(ledger, log, out, go="-", first=0, n=200, distinct=150, delay=0.0):
        args = [sys.executable, str(script), str(ledger), str(log), str(out), str(go), str(first), str(n), str(distinct), str(delay)]
        return subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return start


def _finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def _committed(ledger_path):
    "request content -> number of rows holding it, read with plain sqlite3"
    con = sqlite3.connect(ledger_path)
    try: rows = con.execute("SELECT key, request FROM responses").fetchall()
    finally: con.close()
    out = {}
    for key, req in rows:
        q = json.loads(req)["messages"][-1]["content"]
        assert key == request_key(IDENTITY, "generate", json.loads(req))
        out[q] = out.get(q, 0) + 1
    return out


def test_kill_and_resume(tmp_path, worker):
    "A run SIGKILLed mid-way resumes: nothing committed is asked again, results equal an uninterrupted run's"
    n, distinct = 200, 150
    expected = {f"q{i % distinct:04d}" for i in range(n)}
    # the reference: one uninterrupted run into its own ledger
    _finish(worker(tmp_path / "ref.sqlite", tmp_path / "ref.log", tmp_path / "ref.json", n=n, distinct=distinct))
    reference = json.loads((tmp_path / "ref.json").read_text())
    assert sorted(_lines(tmp_path / "ref.log")) == sorted(expected)          # duplicates within the run asked once

    ledger, log1, log2 = tmp_path / "run/ledger.sqlite", tmp_path / "run1.log", tmp_path / "run2.log"
    proc = worker(ledger, log1, tmp_path / "run1.json", n=n, distinct=distinct, delay=0.02)
    deadline = time.monotonic() + 120
    while len(_lines(log1)) < 40:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "worker made no progress"
        time.sleep(0.005)
    assert proc.poll() is None, "the worker finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "run1.json").exists()

    committed = _committed(ledger)
    asked1 = _lines(log1)
    assert 0 < len(committed) < distinct, len(committed)
    assert set(committed) <= set(asked1)                                      # only asked requests were committed
    assert all(c == 1 for c in committed.values())

    _finish(worker(ledger, log2, tmp_path / "run2.json", n=n, distinct=distinct))
    asked2 = _lines(log2)
    assert not set(asked2) & set(committed), "requests committed before the kill were asked again"
    assert sorted(asked2) == sorted(expected - set(committed))                # each missing one asked exactly once
    resumed = json.loads((tmp_path / "run2.json").read_text())
    assert resumed["results"] == reference["results"]
    assert resumed["counts"]["asked"] == distinct - len(committed)
    assert resumed["counts"]["cached"] == sum(1 for i in range(n) if f"q{i % distinct:04d}" in committed)

    final = _committed(ledger)
    assert set(final) == expected and all(c == 1 for c in final.values())   # exactly one row per distinct request
    with Ledger(ledger) as led:
        assert len(led) == distinct
        assert led.stats()["by_model"] == {"slow-1": distinct}

    # a third run asks nothing at all
    _finish(worker(ledger, tmp_path / "run3.log", tmp_path / "run3.json", n=n, distinct=distinct))
    assert _lines(tmp_path / "run3.log") == []
    assert json.loads((tmp_path / "run3.json").read_text())["results"] == reference["results"]


@pytest.mark.parametrize("round", range(3))
def test_two_writers(tmp_path, worker, round):
    "Two processes create and fill one fresh ledger at the same moment: no errors, every row present once"
    ledger, go = tmp_path / "shared/ledger.sqlite", tmp_path / "go"
    a = worker(ledger, tmp_path / "a.log", tmp_path / "a.json", go=go, first=0, n=300, distinct=10_000)
    b = worker(ledger, tmp_path / "b.log", tmp_path / "b.json", go=go, first=200, n=300, distinct=10_000)
    time.sleep(0.5)                                                           # both interpreters up and waiting
    go.touch()
    _finish(a); _finish(b)
    expected = {f"q{i:04d}" for i in range(500)}                              # 0..299 and 200..499 overlap on 100
    rows = _committed(ledger)
    assert set(rows) == expected and all(c == 1 for c in rows.values())
    for name, first in (("a", 0), ("b", 200)):
        res = json.loads((tmp_path / f"{name}.json").read_text())["results"]
        assert [r["text"] for r in res] == [f"answer to q{i:04d}" for i in range(first, first + 300)]


def test_key_is_stable_across_processes(tmp_path):
    "The same request has the same key in a fresh interpreter with another hash seed"
    payload = request_payload(GenRequest(({"role": "user", "content": "Quel est le traitement ? é"},), max_new_tokens=64))
    code = ("import json,sys; from medsafe_nb.run.ledger import request_key; "
            "print(request_key(json.loads(sys.argv[1]), 'generate', json.loads(sys.argv[2])))")
    env = {**os.environ, "PYTHONHASHSEED": "987", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(IDENTITY), json.dumps(payload)],
                         capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert out == request_key(IDENTITY, "generate", payload)
