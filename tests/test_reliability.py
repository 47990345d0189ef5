"""The reliability suite (issue 13): hostile inputs, hostile servers, kill -9 at random moments, concurrent writers and a
secret scan of every file `run` and `metrics` write. It prints its figures; every count of failures must be 0.

Runs in-process (forked children for the kills) to stay within a couple of minutes on two cores."""
import gzip, json, multiprocessing as mp, os, random, signal, socket, sqlite3, subprocess, sys, time, traceback
from pathlib import Path

import pandas as pd
import pyarrow as pa, pyarrow.parquet as pq
import pytest

from medsafe_nb.core import MedsafeError, check_manifest
from medsafe_nb.items.release import load_medmisbench, validate_report
from medsafe_nb.testing.mockserver import MockServer
from medsafe_nb.run.runner import run, run_outcome, ServerUnavailable
from medsafe_nb.metrics.io import write_metrics

pytestmark = pytest.mark.integration   # real components end to end: `make test-integration`

FIGURES = {"inputs tried": 0, "clear errors": 0, "tracebacks": 0, "hangs": 0, "rows lost": 0, "rows duplicated": 0,
           "kill trials (run)": 0, "kill trials (metrics)": 0, "secrets found": 0}
KEY = "sk-reliab-" + "Q7x" * 12
SAMPLE = load_medmisbench()
ROW = json.loads(Path(os.environ.get("MEDSAFE_SAMPLE", "") or (Path(__file__).parents[1] / "data/sample/medmisbench_sample.jsonl")).read_text().splitlines()[0])


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield FIGURES
    print("\nreliability figures: " + ", ".join(f"{k} {v}" for k, v in FIGURES.items()))


# ---------------------------------------------------------------- 1. a bad-input corpus, generated here

def _jl(*rows) -> bytes: return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def _parquet(table) -> bytes:
    import io
    buf = io.BytesIO(); pq.write_table(table, buf); return buf.getvalue()


def bad_corpus() -> dict:
    "name -> bytes (or a callable making the file at a path): every entry must give a clear error"
    r = dict(ROW)
    no_ctx = {k: v for k, v in r.items() if not k.startswith("inject")}
    c = {
        "empty.jsonl": b"", "blank.jsonl": b"   \n\t\n", "empty.csv": b"", "empty.json": b"", "blank.csv": b"\n\n",
        "utf16.jsonl": _jl(r).decode().encode("utf-16"), "utf16be.jsonl": b"\xfe\xff" + _jl(r).decode().encode("utf-16-be"),
        "utf16-nobom.jsonl": _jl(r).decode().encode("utf-16-le"), "utf32.jsonl": _jl(r).decode().encode("utf-32"),
        "latin1.csv": "question,opa,opb,answer\nCafé au lait?,x,y,A\n".encode("latin-1"),
        "latin1.jsonl": '{"question": "Café?", "opa": "x", "opb": "y", "answer": "A"}\n'.encode("latin-1"),
        "binary.jsonl": bytes(range(256)) * 8, "binary.csv": os.urandom(4096).replace(b"\n", b"\x00"),
        "binary.parquet": os.urandom(2048), "png.json": b"\x89PNG\r\n\x1a\n" + bytes(200),
        "scalar.json": b"42", "string.json": b'"hello"', "null.json": b"null", "strings.json": b'["a", "b"]',
        "nested-list.json": b"[[1, 2]]", "dict-of-scalars.json": b'{"a": 1}',
        "deep.jsonl": b"[" * 200_000 + b"]" * 200_000 + b"\n", "deep.json": b"[" * 200_000 + b"]" * 200_000,
        "deep-field.jsonl": _jl({**r})[:-2] + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        "bad-json.jsonl": b'{"question": "Q?",\n', "array-row.jsonl": b"[1, 2, 3]\n", "scalar-row.jsonl": b"7\n",
        "corrupt.jsonl.gz": b"\x1f\x8b\x08\x00" + os.urandom(100), "truncated.jsonl.gz": gzip.compress(_jl(r, r))[:-30],
        "not-gzip.jsonl.gz": _jl(r), "corrupt.parquet": b"PAR1" + os.urandom(500) + b"PAR1",
        "wrong-cols.parquet": _parquet(pa.table({"stem": ["Q?"], "a": ["x"], "gold": ["A"]})),
        "typed-cols.parquet": _parquet(pa.table({"question": ["Q?"], "opa": [["x"]], "opb": [["y"]], "answer": ["A"]})),
        "struct-question.parquet": _parquet(pa.table({"question": [{"t": "Q?"}], "answer": ["A"]})),
        "empty.parquet": _parquet(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())})),
        "surrogate.jsonl": b'{"question": "Q\\ud800?", "opa": "x", "opb": "y", "answer": "A"}\n',
        "surrogate-ctx.jsonl": _jl(r)[:-2] + b', "injecta": "ctx \\udfff"}\n',
        "question-dict.jsonl": _jl({**r, "question": {"text": "Q?"}}), "option-list.jsonl": _jl({**r, "opa": ["x", "y"]}),
        "answer-list.jsonl": _jl({**r, "answer": ["A"]}), "bool-option.jsonl": _jl({**r, "opb": True}),
        "27-options.jsonl": _jl({"question": "Which? " + " ".join(f"({chr(65+i)}) o{i}" for i in range(27)), "answer": "B"}),
        "opu.jsonl": _jl({**r, "opu": "a 21st option", "injectu": "ctx"}),
        "one-option.jsonl": _jl({**{k: v for k, v in no_ctx.items() if not k.startswith("op")}, "opa": "only", "answer": "A", "injecta": "c"}),
        "no-contexts.jsonl": _jl(no_ctx), "no-question.jsonl": _jl({k: v for k, v in r.items() if k != "question"}),
        "gold-missing.jsonl": _jl({**r, "answer": ""}), "gold-outside.jsonl": _jl({**r, "answer": "T"}),
        "dup-ids.jsonl": _jl(r, r), "bad-label.jsonl": _jl({**r, "injection_provenance": "Hearsay"}),
        "quoted-newline.csv": b'question,opa,opb,answer\n"Two\nline?",x,y,Z\n',
        "ragged.csv": b"question,opa,opb,answer\nQ?,x,y,A,extra,more\n", "dup-header.csv": b"question,question,answer\nQ,Q,A\n",
        "huge-line.jsonl": b'{"question": "' + b"x" * 3_000_000 + b'"}\n',
        "huge-csv.csv": b"question,answer\n" + b"x" * 3_000_000 + b",A\n",
        "unsupported.txt": b"hello", "no-suffix": b"hello",
    }
    c["symlink-loop.jsonl"] = lambda p: p.symlink_to(p)
    c["dangling.jsonl"] = lambda p: p.symlink_to(p.parent / "nowhere.jsonl")
    c["a-folder.jsonl"] = lambda p: p.mkdir()
    c["unreadable.jsonl"] = lambda p: (p.write_bytes(_jl(r)), p.chmod(0))
    c["empty-folder"] = lambda p: p.mkdir()
    return c


def _make(d: Path, name: str, what) -> Path:
    p = d / name
    what(p) if callable(what) else p.write_bytes(what)
    return p


def _clear(run_it) -> bool:
    "True when the call ends in a MedsafeError (a clear message) within the time limit; counts tracebacks and hangs"
    try: run_it()
    except MedsafeError as e:
        msg = str(e)
        return bool(msg) and "Traceback" not in msg
    except Exception:
        FIGURES["tracebacks"] += 1; traceback.print_exc(); return False
    return False


def test_bad_inputs_are_clear_errors(tmp_path):
    corpus = bad_corpus()
    assert len(corpus) >= 50
    unclear = []
    for name, what in corpus.items():
        if name == "unreadable.jsonl" and os.geteuid() == 0: continue      # root reads any file
        p = _make(tmp_path, name, what)
        FIGURES["inputs tried"] += 1
        t0 = time.monotonic()
        ok = _clear(lambda: load_medmisbench("all", str(p)))
        if time.monotonic() - t0 > 30: FIGURES["hangs"] += 1
        ok_v, report = validate_report(str(p))                   # validate agrees: never "OK" on a bad file
        if ok and not ok_v: FIGURES["clear errors"] += 1
        else: unclear.append((name, report[:200]))
    assert unclear == [], unclear


def test_errors_name_file_line_and_field(tmp_path):
    p = _make(tmp_path, "q.csv", b'question,opa,opb,answer\n"Two\nline?",x,y,Z\n')
    with pytest.raises(MedsafeError, match=r"q.csv:2: field 'answer'"): load_medmisbench("all", str(p))
    p = _make(tmp_path, "s.jsonl", _jl(ROW) + b'{"question": "Q\\ud800?", "opa": "x", "opb": "y", "answer": "A"}\n')
    with pytest.raises(MedsafeError, match=r"s.jsonl:2: field 'question': holds a lone surrogate"): load_medmisbench("all", str(p))
    p = _make(tmp_path, "w.parquet", _parquet(pa.table({"stem": ["Q?"], "opa": [["x"]], "answer": ["A"]})))
    with pytest.raises(MedsafeError, match=r"missing column\(s\) question; column\(s\) of a non-text type: opa"): load_medmisbench("all", str(p))


def test_bad_out_folders(tmp_path):
    f = tmp_path / "file"; f.write_text("x")
    assert _clear(lambda: run(model="minilm", out=str(f), limit=2, progress=False))
    ro = tmp_path / "ro"; ro.mkdir(); ro.chmod(0o500)
    if os.geteuid() != 0: assert _clear(lambda: run(model="minilm", out=str(ro / "x"), limit=2, progress=False))
    assert _clear(lambda: write_metrics([str(tmp_path)], out=str(f)))


# ---------------------------------------------------------------- 2. hostile servers

def _api_run(out, url, **kw):
    kw = {"model": "openai:mock-model", "base_url": url, "out": str(out), "limit": 4, "progress": False, "concurrency": 4, **kw}
    return run(**kw)


def test_server_down_fails_fast(tmp_path):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()   # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match="no server answers at http://127.0.0.1"):
        _api_run(tmp_path / "down", f"http://u:pw@127.0.0.1:{port}/v1?api_key=zzzz1234")
    assert time.monotonic() - t0 < 30


def test_server_that_never_answers(tmp_path):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(64)                # accepts, never reads or answers
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable): _api_run(tmp_path / "mute", f"http://127.0.0.1:{s.getsockname()[1]}/v1")
        assert time.monotonic() - t0 < 30
    finally: s.close()
    with MockServer(faults=lambda n, a, b: "hang") as srv:                    # models endpoint fine, completions hang
        t0 = time.monotonic()
        df = _api_run(tmp_path / "hang", srv.base_url, timeout=1.0, max_retries=0)
        assert time.monotonic() - t0 < 60 and (df.status == "error").all()
        assert run_outcome(df)[0] == 1                                         # an all-error run exits non-zero


@pytest.mark.parametrize("fault", ["500", "503", "drop"])
def test_circuit_breaker(tmp_path, fault):
    with MockServer(faults=lambda n, a, b: fault) as srv:
        with pytest.raises(ServerUnavailable, match="consecutive failed requests"):
            _api_run(tmp_path / fault, srv.base_url, limit=12, max_retries=0, concurrency=2)


@pytest.mark.parametrize("fault", ["429", "slow:0.2", "length", "refusal", "content_filter", "echo"])
def test_hostile_modes_end_cleanly(tmp_path, fault):
    env = {"OPENAI_API_KEY": KEY}
    old = {k: os.environ.get(k) for k in env}; os.environ.update(env)
    try:
        plan = lambda n, a, b: fault if a == 1 else None
        with MockServer(faults=plan, api_key=KEY) as srv:
            df = _api_run(tmp_path / "r", srv.base_url.replace("http://", f"http://user:{KEY}@") + "?api_key=" + KEY)
        assert len(df) == 12 and set(df.status) <= {"ok", "truncated", "refused", "noanswer", "error"}
        write_metrics([str(tmp_path / "r")], out=str(tmp_path / "m"), n_boot=20, allow_errors=True)
    finally:
        for k, v in old.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v
    FIGURES["secrets found"] += _scan(tmp_path, KEY)


def _scan(root: Path, *secrets) -> int:
    "Files under `root` holding a secret: the literal values, a user:password URL, an api_key query value"
    import re
    pat = re.compile(rb"://[^/\s:@]+:[^/\s@*]+@|api_key=(?!\*\*\*)[A-Za-z0-9]|(?i:bearer) (?!\*\*\*)[A-Za-z0-9]{8}")
    found = 0
    for f in root.rglob("*"):
        if not f.is_file(): continue
        data = f.read_bytes()
        if any(s.encode() in data for s in secrets) or pat.search(data):
            found += 1; print("secret in", f)
    return found


# ---------------------------------------------------------------- 3. kill -9 at random moments

def _child_run(out, url, limit):
    sys.stdout = sys.stderr = open(os.devnull, "w")
    run(model="openai:mock-model", base_url=url, out=str(out), limit=limit, progress=False, concurrency=4)
    os._exit(0)


def _child_metrics(dirs, out):
    sys.stdout = sys.stderr = open(os.devnull, "w")
    write_metrics(dirs, out=str(out), n_boot=200)
    os._exit(0)


def _kill_at(target, args, delay):
    p = mp.get_context("fork").Process(target=target, args=args); p.start()
    p.join(delay)
    if p.is_alive(): os.kill(p.pid, signal.SIGKILL)
    p.join()


def _ledger_requests(path):
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try: return [r[0] for r in con.execute("SELECT key FROM responses")]
    finally: con.close()


def test_kill_run_and_resume(tmp_path):
    rng, limit = random.Random(13), 10
    with MockServer(policy="hash", delay=0.02) as srv:
        ref = _api_run(tmp_path / "ref", srv.base_url, limit=limit).drop(columns="latency_s")
        for t in range(10):
            out = tmp_path / f"k{t}"
            for _ in range(2): _kill_at(_child_run, (out, srv.base_url, limit), rng.uniform(0.05, 1.2))
            if (out / "manifest.json").exists(): check_manifest(out)          # a committed folder is always consistent
            res = _api_run(out, srv.base_url, limit=limit).drop(columns="latency_s")
            keys = _ledger_requests(out / "ledger.sqlite")
            FIGURES["rows lost"] += abs(len(ref) - len(res)) + int(not ref.equals(res))
            FIGURES["rows duplicated"] += len(keys) - len(set(keys)) + (len(keys) - 3 * limit)
            FIGURES["kill trials (run)"] += 1
            check_manifest(out)
    assert FIGURES["rows lost"] == 0 and FIGURES["rows duplicated"] == 0


def test_kill_metrics(tmp_path):
    rng = random.Random(7)
    with MockServer(policy="hash") as srv:
        runs = [str(tmp_path / m) for m in ("a", "b")]
        _api_run(runs[0], srv.base_url, limit=12); _api_run(runs[1], srv.base_url, limit=12, label="second")
    good, _ = write_metrics(runs, out=str(tmp_path / "ref"), n_boot=200)
    ref = {f.name: f.read_bytes() for f in (tmp_path / "ref").iterdir()}
    out = tmp_path / "m"
    for t in range(10):
        _kill_at(_child_metrics, (runs, out), rng.uniform(0.0, 1.5))
        if out.exists():                                                     # all tables, each identical to a full write
            assert {f.name: f.read_bytes() for f in out.iterdir()} == ref
        FIGURES["kill trials (metrics)"] += 1
    write_metrics(runs, out=str(out), n_boot=200)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == ref
    assert [p.name for p in tmp_path.glob(".m.metrics-*")] == []              # stale temporary folders cleaned


# ---------------------------------------------------------------- 4. concurrent runs, another model, the ledger of another app

def test_concurrent_runs_on_one_folder(tmp_path):
    with MockServer(policy="hash", delay=0.05) as srv:
        out = tmp_path / "same"
        p = mp.get_context("fork").Process(target=_child_run, args=(out, srv.base_url, 8)); p.start()
        deadline = time.time() + 30
        while not (out / ".medsafe.lock").exists() or not (out / ".medsafe.lock").read_text().strip():
            time.sleep(0.02); assert time.time() < deadline
        with pytest.raises(MedsafeError, match=rf"in use by another medsafe process \(PID {p.pid}\)"):
            _api_run(out, srv.base_url, limit=8)
        p.join(60)
        assert p.exitcode == 0
        assert len(srv.completions()) == 24                                 # every request sent once, not twice
        with pytest.raises(MedsafeError, match="holds the run of another model"):
            run(model="minilm", out=str(out), limit=2, progress=False)
        run(model="minilm", out=str(out), limit=2, progress=False, overwrite=True)
    other = tmp_path / "app.db"
    con = sqlite3.connect(other); con.execute("CREATE TABLE users (name TEXT)"); con.commit(); con.close()
    before = other.read_bytes()
    with pytest.raises(MedsafeError, match="another application"):
        run(model="minilm", out=str(tmp_path / "x"), ledger=str(other), limit=2, progress=False)
    assert other.read_bytes() == before and not list(tmp_path.glob("app.db-*"))


def test_secret_scan_of_everything_written(tmp_path):
    "The CLI end to end with the key in the environment, a credentialed URL and a header-echoing server: no secret in any file"
    env = {**os.environ, "OPENAI_API_KEY": KEY, "MY_SERVICE_TOKEN": "tok-" + "z9" * 10}
    with MockServer(faults=lambda n, a, b: "echo", api_key=KEY) as srv:
        url = srv.base_url.replace("http://", f"http://me:{KEY}@") + f"?api_key={KEY}"
        r = subprocess.run([sys.executable, "-m", "medsafe_nb.cli", "run", "--model", "openai:mock-model", "--base-url", url,
                            "--out", str(tmp_path / "run"), "--limit", "3", "--no-progress", "--log-prompts"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    r2 = subprocess.run([sys.executable, "-m", "medsafe_nb.cli", "metrics", str(tmp_path / "run"), "--out", str(tmp_path / "metrics"),
                         "--n-boot", "20", "--allow-errors"], capture_output=True, text=True, env=env, timeout=120)
    assert r2.returncode == 0, r2.stderr
    (tmp_path / "logs.txt").write_text(r.stdout + r.stderr + r2.stdout + r2.stderr)
    found = _scan(tmp_path, KEY, env["MY_SERVICE_TOKEN"])
    FIGURES["secrets found"] += found
    assert found == 0
