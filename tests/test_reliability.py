"""The reliability suite: hostile inputs, hostile servers, kill -9 at random moments, concurrent writers and a
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
from medsafe_nb.run.runner import run
from medsafe_nb.run.process import run_outcome, ServerUnavailable
from medsafe_nb.metrics.io import write_metrics

pytestmark = pytest.mark.integration   # real components end to end: `make test-integration`

FIGURES = {"inputs tried": 0, "clear errors": 0, "tracebacks": 0, "hangs": 0, "rows lost": 0, "rows duplicated": 0,
           "kill trials (run)": 0, "kill trials (metrics)": 0, "secrets found": 0,
           "torchrun trials (beside a CPU burner)": 0, "torchrun aborts": 0,
           "signal trials (server)": 0, "signal trials (in-process)": 0, "graceful stops": 0, "answers lost": 0,
           "asked again after a graceful stop": 0, "stale locks": 0, "second-signal trials": 0,
           "disk-full trials": 0, "damaged ledgers tried": 0, "damaged ledgers opened": 0, "damaged ledgers changed": 0}
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


# ---------------------------------------------------------------- 5. data parallelism on a busy machine

BURNER = "import multiprocessing as mp, os\ndef spin():\n    while True: pass\nif __name__ == '__main__':\n" \
         "    ps = [mp.Process(target=spin) for _ in range(os.cpu_count() or 2)]\n    [p.start() for p in ps]; [p.join() for p in ps]\n"


def test_torchrun_ten_times_beside_a_cpu_burner(tmp_path, tiny_model_dir):
    "The two-process torchrun test, 10 times in a row while every core spins: a worker that aborts at exit fails it"
    from test_hf import test_data_parallel_two_cpu_processes as two_processes
    burner = subprocess.Popen([sys.executable, "-c", BURNER], start_new_session=True)
    failures = []
    try:
        for k in range(10):
            (tmp_path / f"t{k}").mkdir()
            try: two_processes(tmp_path / f"t{k}", tiny_model_dir)
            except (AssertionError, subprocess.TimeoutExpired) as e: failures.append(f"trial {k}: {str(e)[-600:]}")
            FIGURES["torchrun trials (beside a CPU burner)"] += 1
    finally:
        os.killpg(burner.pid, signal.SIGKILL); burner.wait()
    FIGURES["torchrun aborts"] = len(failures)
    assert failures == [], "\n".join(failures)


# ---------------------------------------------------------------- 6. SIGTERM and Ctrl-C at seeded random moments

def _wait_for_lock(out: Path, proc_alive, limit=120):
    "Until the run holds its folder's lock (its signal handlers are installed before it takes it)"
    lock, deadline = out / ".medsafe.lock", time.monotonic() + limit
    while not (lock.exists() and lock.read_text().strip()):
        assert proc_alive() and time.monotonic() < deadline, "the run never took its lock"
        time.sleep(0.01)


def _stale_locks(out: Path) -> int:
    "Lock files of OUT and its ledger that another writer cannot take now"
    from medsafe_nb.core import exclusive_lock, LockedError
    stale = 0
    for lock in (out / ".medsafe.lock", out / "ledger.sqlite.lock"):
        try:
            with exclusive_lock(lock): pass
        except LockedError: stale += 1
    return stale


def _cli_child(args):
    "A forked `medsafe` command line: exits with the command's exit code"
    sys.stdout = sys.stderr = open(os.devnull, "w")
    from medsafe_nb.cli import app
    try: app(args, standalone_mode=True)
    except SystemExit as e: os._exit(e.code if isinstance(e.code, int) else 1)
    os._exit(0)


def _check_stopped(out: Path, rc: int, signum: int) -> bool:
    "A stopped run: the shell's exit code, no manifest, the rows it wrote all in its ledger; True when it was stopped"
    if (out / "manifest.json").is_file():                                        # it finished before the signal (then printing
        assert rc in (0, -signum, 128 + signum), rc                              # its summary may have been cut short)
        return False
    assert rc == 128 + signum, rc
    assert not (out / "manifest.json").exists()                                  # uncommitted: metrics refuse it
    rec = json.loads((out / "run.json").read_text())
    kept = pd.read_parquet(out / "predictions.parquet")
    assert rec["stopped"]["signal"] == signal.Signals(signum).name and rec["stopped"]["rows_answered"] == len(kept)
    assert (kept["status"] != "error").all()
    FIGURES["graceful stops"] += 1
    return True


def test_signal_trials_against_the_server(tmp_path):
    "10 runs stopped by SIGTERM or SIGINT at seeded moments: every answer the server gave is kept, none is asked twice"
    rng, limit = random.Random(22), 10
    with MockServer(policy="hash", delay=lambda n, body: 0.02 + (n * 7919 % 13) / 100) as srv:
        ref = _api_run(tmp_path / "ref", srv.base_url, limit=limit).drop(columns="latency_s")
        for t in range(10):
            base = len(srv.completions())                    # the server's log so far (the reference run, earlier trials)
            out, signum = tmp_path / f"s{t}", (signal.SIGTERM, signal.SIGINT)[t % 2]
            args = ["run", "--model", "openai:mock-model", "--base-url", srv.base_url, "--out", str(out), "--limit", str(limit),
                    "--no-progress", "--concurrency", "4", "--stop-grace-s", "30"]
            p = mp.get_context("fork").Process(target=_cli_child, args=(args,)); p.start()
            _wait_for_lock(out, p.is_alive)
            time.sleep(rng.uniform(0.0, 1.0))                 # the seeded moment: anywhere in a run of about a second
            if p.is_alive(): os.kill(p.pid, signum)
            p.join(120); assert p.exitcode is not None, "the stopped run did not end"
            _check_stopped(out, p.exitcode, signum)
            FIGURES["stale locks"] += _stale_locks(out)
            answered = len(srv.completions()) - base
            keys = _ledger_requests(out / "ledger.sqlite")
            FIGURES["answers lost"] += answered - len(set(keys))            # an answer the server sent but the ledger lacks
            res = _api_run(out, srv.base_url, limit=limit).drop(columns="latency_s")
            check_manifest(out)
            FIGURES["rows lost"] += int(not ref.equals(res))
            FIGURES["asked again after a graceful stop"] += len(srv.completions()) - base - 3 * limit
            FIGURES["signal trials (server)"] += 1
    assert (FIGURES["answers lost"], FIGURES["asked again after a graceful stop"], FIGURES["stale locks"]) == (0, 0, 0)


def test_a_second_signal_stops_at_once(tmp_path):
    "SIGTERM twice: the process ends at once with 143; the ledger stays readable and the same command completes the run"
    with MockServer(policy="hash", delay=0.5) as srv:
        out = tmp_path / "twice"
        args = ["run", "--model", "openai:mock-model", "--base-url", srv.base_url, "--out", str(out), "--limit", "10",
                "--no-progress", "--concurrency", "2", "--stop-grace-s", "600"]
        p = mp.get_context("fork").Process(target=_cli_child, args=(args,)); p.start()
        _wait_for_lock(out, p.is_alive)
        deadline = time.monotonic() + 60
        while not srv.completions(): time.sleep(0.01); assert time.monotonic() < deadline
        os.kill(p.pid, signal.SIGTERM); time.sleep(0.1); os.kill(p.pid, signal.SIGTERM)
        p.join(30)
        assert p.exitcode == 143 and not (out / "manifest.json").exists()
        _ledger_requests(out / "ledger.sqlite")                                   # readable
        assert _stale_locks(out) == 0
        df = _api_run(out, srv.base_url, limit=10)
        assert len(df) == 30 and (df["status"] == "ok").all()
        check_manifest(out)
        FIGURES["second-signal trials"] += 1


INPROCESS_WORKER = r"""
import os, sys
from medsafe_nb.models.hf import HFBackend
_fit = HFBackend._fit
def counted(self, batch_fn, batch, on_error):
    out = _fit(self, batch_fn, batch, on_error)
    with open(os.environ["MEDSAFE_COMPUTED"], "a") as f: f.write(f"{len(out)}\n")      # every result computed, batch by batch
    return out
HFBackend._fit = counted
from medsafe_nb.cli import app
app(sys.argv[1:])
"""


def test_signal_trials_in_process(tmp_path, tiny_model_dir):
    "10 runs of the tiny model in process, stopped at seeded moments: every result computed is kept, none is computed twice"
    rng = random.Random(23)
    (tmp_path / "worker.py").write_text(INPROCESS_WORKER)
    common = dict(model=f"hf:{tiny_model_dir}", limit=12, max_new_tokens=6, batch_size=2, progress=False)
    ref = run(out=str(tmp_path / "ref"), **common)
    for t in range(10):
        out, signum = tmp_path / f"p{t}", (signal.SIGINT, signal.SIGTERM)[t % 2]
        computed = tmp_path / f"p{t}.computed"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MEDSAFE_COMPUTED": str(computed)}
        p = subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), "run", "--model", common["model"], "--out", str(out),
                              "--limit", "12", "--max-new-tokens", "6", "--batch-size", "2", "--no-progress"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if t == 0: _wait_for_lock(out, lambda: p.poll() is None)          # one stop before the model is even loaded
        else:
            deadline = time.monotonic() + 240
            while not computed.exists() and p.poll() is None and time.monotonic() < deadline: time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 2.0))                 # the seeded moment: anywhere in about 18 batches
        if p.poll() is None: p.send_signal(signum)
        _, err = p.communicate(timeout=300)
        try: stopped = _check_stopped(out, p.returncode, signum)
        except AssertionError as e: raise AssertionError(f"trial {t}: {e}\n{err[-3000:]}") from None
        if stopped: assert "Run the same command again to resume" in err, err[-2000:]
        FIGURES["stale locks"] += _stale_locks(out)
        done = sum(int(x) for x in computed.read_text().split()) if computed.exists() else 0
        kept = len(_ledger_requests(out / "ledger.sqlite"))
        FIGURES["answers lost"] += done - kept                                  # computed, never stored
        res = run(out=str(out), **common)
        check_manifest(out)
        rec = json.loads((out / "run.json").read_text())
        final = len(_ledger_requests(out / "ledger.sqlite"))
        FIGURES["asked again after a graceful stop"] += done + rec["ledger_stats"]["asked"] - final   # computations beyond the distinct results
        cols = ["item_id", "condition", "target", "pred", "status", "raw"]
        if not ref[cols].equals(res[cols]): print(f"trial {t} DIFF", ref[cols].compare(res[cols]).head(6).to_dict("records"), err[-1500:])
        FIGURES["rows lost"] += int(not ref[cols].equals(res[cols]))
        FIGURES["signal trials (in-process)"] += 1
    assert (FIGURES["answers lost"], FIGURES["asked again after a graceful stop"], FIGURES["stale locks"], FIGURES["rows lost"]) == (0, 0, 0, 0)


# ---------------------------------------------------------------- 7. a full disk

@pytest.fixture
def small_disk(tmp_path):
    "A 160 KiB tmpfs at tmp_path/disk (unmounted after): `grow()` frees space by enlarging it"
    d = tmp_path / "disk"; d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode: pytest.skip(f"cannot mount a small tmpfs here (needs root and mount rights): {(r.stderr or r.stdout).strip()}")
    try: yield d, lambda: subprocess.run(["mount", "-o", "remount,size=16m", str(d)], check=True)
    finally: subprocess.run(["umount", "-l", str(d)])


@pytest.mark.parametrize("where", ["ledger", "out"])
def test_disk_full(tmp_path, small_disk, where):
    "The ledger's disk, or the run folder's, fills up: a clear error naming the path, a readable ledger, a rerun that completes"
    disk, grow = small_disk
    out = disk / "run" if where == "ledger" else disk / "run"
    ledger = None if where == "ledger" else str(tmp_path / "ledger.sqlite")          # "out": only the run folder is small
    limit = 40 if where == "ledger" else 10
    if where == "out": (disk / "filler").write_bytes(b"x" * (150 * 1024))         # what is left: room for the locks, not the table
    with MockServer(policy="hash") as srv:
        ref = _api_run(tmp_path / "ref", srv.base_url, limit=limit).drop(columns="latency_s")
        with pytest.raises(MedsafeError) as e: _api_run(out, srv.base_url, limit=limit, ledger=ledger)
        msg = str(e.value)
        full_path = (out / "ledger.sqlite") if where == "ledger" else (out / "predictions.parquet")
        assert str(full_path) in msg and ("disk is full" in msg or "no space left" in msg), msg
        kept = _ledger_requests(Path(ledger) if ledger else out / "ledger.sqlite")     # readable
        assert len(kept) == len(set(kept)) > 0
        assert not (out / "manifest.json").exists()
        grow()
        if where == "out": (disk / "filler").unlink()
        res = _api_run(out, srv.base_url, limit=limit, ledger=ledger).drop(columns="latency_s")
        check_manifest(out)
        FIGURES["rows lost"] += int(not ref.equals(res))
        assert ref.equals(res)
    FIGURES["disk-full trials"] += 1


# ---------------------------------------------------------------- 8. a damaged ledger

def _damaged(data: bytes, rng) -> dict:
    "name -> bytes: the ways a ledger file gets damaged"
    n = len(data)
    cut = lambda k: data[:k]
    return {"truncated-half": cut(n // 2), "truncated-odd": cut(n - 1234), "truncated-header": cut(60),
            "header-zeroed": bytes(100) + data[100:], "header-garbage": rng.randbytes(100) + data[100:],
            "page-2-zeroed": data[:4096] + bytes(4096) + data[8192:], "page-1-body-garbage": data[:100] + rng.randbytes(3996) + data[4096:],
            "middle-garbage": data[:n // 2] + rng.randbytes(8192) + data[n // 2 + 8192:],
            "tail-garbage": data[:n - 8192] + rng.randbytes(8192), "random-bytes": rng.randbytes(n),
            "scattered": bytes(b if rng.random() > 0.01 else rng.randrange(256) for b in data)}


def test_damaged_ledgers(tmp_path):
    "Each damaged ledger is refused at open with a clear error naming it, left as it was, and salvage recovers the readable rows"
    from medsafe_nb.run.ledger import Ledger
    from medsafe_nb.run.ledger_file import LedgerError
    from medsafe_nb.run.salvage import salvage_ledger
    rng = random.Random(int(os.environ.get("MEDSAFE_DAMAGE_SEED", "4")))
    with MockServer(policy="hash") as srv:
        ref = _api_run(tmp_path / "ref", srv.base_url, limit=30).drop(columns="latency_s")
        good = (tmp_path / "ref" / "ledger.sqlite").read_bytes()
        n = len(_ledger_requests(tmp_path / "ref" / "ledger.sqlite"))
        for name, data in _damaged(good, rng).items():
            p = tmp_path / f"{name}.sqlite"; p.write_bytes(data)
            FIGURES["damaged ledgers tried"] += 1
            try:
                with Ledger(p): FIGURES["damaged ledgers opened"] += 1; print("opened a damaged ledger:", name)
            except LedgerError as e: assert str(p) in str(e), str(e)
            r = subprocess.run([sys.executable, "-m", "medsafe_nb.cli", "ledger", "check", str(p)], capture_output=True, text=True, timeout=60)
            assert r.returncode == 1 and str(p) in r.stderr and "Traceback" not in r.stderr, (name, r.stderr[-500:])
            FIGURES["damaged ledgers changed"] += int(p.read_bytes() != data)
            try: report = salvage_ledger(p, tmp_path / f"{name}.salvaged.sqlite")
            except LedgerError as e: print(f"{name}: nothing to salvage ({e})"); continue
            assert report["rows_kept"] <= n and p.read_bytes() == data
            print(f"{name}: salvaged {report['rows_kept']} of {n} rows")
            out = tmp_path / f"{name}.run"                                             # the way on: rerun with the salvaged ledger
            res = _api_run(out, srv.base_url, limit=30, ledger=str(tmp_path / f"{name}.salvaged.sqlite")).drop(columns="latency_s")
            if not ref.equals(res):
                dif = [(i, c, ref.at[i, c], res.at[i, c]) for i in ref.index for c in ref.columns if not (ref.at[i, c] == res.at[i, c] or (pd.isna(ref.at[i, c]) and pd.isna(res.at[i, c])))]
                print(name, "DIFF", dif[:6], len(ref), len(res))
            FIGURES["rows lost"] += int(not ref.equals(res))
    assert (FIGURES["damaged ledgers opened"], FIGURES["damaged ledgers changed"]) == (0, 0)
