"""Paper scale: every verb on the paper's Table 1 size, 11 runs x 10,932 items x 3 conditions = 360,756 rows.

The set is built by the real runner (`medsafe_nb.run.runner.run`) on a synthetic release of 10,932 items (the
embedded sample's questions, each copy numbered so that no two prompts are alike, in the paper's split sizes) with a
scripted backend that answers at once, deterministically from (model, item, condition): 11 model configurations
between 55% and 90% clean accuracy, flipped by Type 1 and Type 2 context at different rates, with the status mix of
real runs (mostly a bare JSON answer, some reasoning before it, some unreadable replies, refusals and truncations). All
runs share one ledger, which then holds 360,756 answers. Each verb is then timed as a user runs it, in its own process
(`medsafe ...`), with the process's peak resident memory (`wait4`'s ru_maxrss):

- `medsafe metrics` (Table 1, breakdowns, McNemar; default bootstrap of 1,000 resamples), target <= 10 s and <= 1 GB;
- `medsafe report` (every row browsable, prompts included), target a file <= 25 MB, opened in headless Chromium in
  <= 3 s, a filter over all rows in <= 200 ms (needs `make browser`; left out without Chromium);
- `medsafe show --flipped` and `medsafe review export --kind harm --n 90`, target <= 5 s each;
- the ledger: a resumed run that finds every answer cached, target <= 10 s to decide that for all 360,756 requests
  (timed in-process: the 11 runs' requests looked up by `cached_generate` with a backend that must not be asked), and
  one whole resumed `run()` of one configuration.

Nothing is asserted; the table says which targets are met.

    .venv/bin/python bench/bench_scale.py [--quick] [--items N] [--runs R] [--keep DIR] [--skip browser,...]

`--quick` builds 3 runs of 600 items (a minute) to check the script end to end.
"""
import argparse, hashlib, json, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPLITS = {"MEDMISQA": 3112, "MEDMISMCQA": 3986, "MEDMISXPERTQA": 1544, "MEDMISJOURNEY": 2197, "MEDMISHLE": 93}
CHROMIUM = Path("/usr/bin/chromium")
from medsafe_nb.models.base import Backend, GenRequest, Generation, register_backend
MEDSAFE = Path(sys.executable).parent / "medsafe"


# --- the synthetic release ----------------------------------------------------------------------------------------
def synth_release(path:Path, n_items:int)->Path:
    "n_items rows in the release schema, split as the paper's (scaled), each a numbered copy of a sample question"
    rows = [json.loads(l) for l in (ROOT / "data" / "sample" / "medmisbench_sample.jsonl").read_text().splitlines() if l.strip()]
    by_split = {s: [r for r in rows if r["config"] == s] for s in SPLITS}
    total = sum(SPLITS.values())
    want = {s: max(1, round(n * n_items / total)) for s, n in SPLITS.items()}
    want["MEDMISMCQA"] += n_items - sum(want.values())
    with path.open("w", encoding="utf-8") as f:
        for s, n in want.items():
            pool = by_split[s] or rows
            for k in range(n):
                r = dict(pool[k % len(pool)], config=s, id=f"{s}-{k:05d}")
                r["question"] = f"(Case {s[6:].lower()} {k + 1}) " + r["question"]
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


# --- the scripted backend -----------------------------------------------------------------------------------------
REASONS = ["The key finding here is {o}.", "Given the presentation, {o} fits best.", "The context claims otherwise, but {o} follows the guideline.",
           "Considering the laboratory values and the history, the most appropriate choice is {o}.",
           "Step by step: the stem describes the classic picture, and the evidence supports {o}."]
UNREADABLE = ["I am not certain; several of these could apply depending on the clinical context.",
              "More information is needed (renal function, allergies) before choosing between these options.",
              "Both of the first two options are reasonable; it depends on local protocol."]


def _u(*parts)->float:
    "A uniform number in [0, 1) fixed by its parts"
    return int.from_bytes(hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest(), "big") / 2 ** 64


class ScaleBackend(Backend):
    "Answers at once, deterministically: model m's clean accuracy, flip rates and status mix"
    kind, is_llm = "scale", True
    def __init__(self, name, **options):
        self.model = name
        m = int(name.rsplit("-", 1)[1])
        self.acc, self.flip1, self.flip2 = 0.55 + 0.035 * m, 0.55 - 0.035 * m, 0.35 - 0.02 * m
        self.gold = {}

    def identity(self): return {"kind": "scale", "model": self.model, "version": 1}

    def reply(self, q, parts):
        "(text, finish_reason) for one request"
        gold, keys = self.gold[parts.question], [k for k, _ in parts.options]
        cond, u = parts.condition, lambda *p: _u(self.model, parts.question, *p)
        right = u("clean") < self.acc
        if cond == "type1":
            target = parts.contexts[0][0]
            answer = target if right and u("flip") < self.flip1 else (gold if right else None)
        elif cond == "type2": answer = None if right and u("flip") < self.flip2 else (gold if right else None)
        else: answer = gold if right else None
        if answer is None:
            wrong = [k for k in keys if k not in gold.split(",")] or keys
            answer = wrong[int(u("wrong") * len(wrong))]
        s = u("status", cond)
        if s < 0.004: return "I can't help with choosing a treatment; please consult a clinician.", "refused"
        if s < 0.009: return "Let me think about each option in turn. " + " ".join(t for _, t in parts.options)[:600], "length"
        if s < 0.03: return UNREADABLE[int(u("un", cond) * len(UNREADABLE))], "stop"
        js = '{"answer": "%s"}' % answer
        if s < 0.16:
            opt = dict(parts.options).get(answer.split(",")[0], "")
            return REASONS[int(u("why", cond) * len(REASONS))].format(o=opt[:120]) + " " + js, "stop"
        return js, "stop"

    def generate(self, requests):
        for i, r in enumerate(requests):
            text, fr = self.reply(r, r.parts)
            yield i, Generation(text, fr, prompt_tokens=sum(len(m["content"]) for m in r.messages) // 4,
                                completion_tokens=len(text) // 4, latency_s=0.0)


def build(root:Path, n_items:int, n_runs:int)->tuple[list[Path], Path]:
    "The synthetic release and n_runs committed run folders sharing root/ledger.sqlite"
    from medsafe_nb.items.release import load_medmisbench
    from medsafe_nb.run.runner import run
    release = synth_release(root / "release.jsonl", n_items)
    items = load_medmisbench("all", str(release))
    gold = {it.question: ",".join(it.gold) for it in items}
    made = []
    def factory(name, **options):
        b = ScaleBackend(name, **options); b.gold = gold; made.append(b); return b
    register_backend("scale", factory)
    dirs = []
    for m in range(n_runs):
        d = root / "runs" / f"model-{m:02d}"
        run(model=f"scale:model-{m:02d}", data=str(release), out=str(d), ledger=str(root / "ledger.sqlite"), progress=False)
        dirs.append(d)
    return dirs, release


# --- timing -------------------------------------------------------------------------------------------------------
def verb(args:list, cwd:Path)->tuple[float, float, int, str, float]:
    "(wall seconds, peak RSS in MB, exit code, last output line, CPU seconds) of one `medsafe` command in its own process"
    t0 = time.perf_counter()
    p = subprocess.Popen([str(MEDSAFE)] + [str(a) for a in args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"})
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return (time.perf_counter() - t0, ru.ru_maxrss / 1024, p.returncode, (out.strip().splitlines() or [""])[-1][:160],
            ru.ru_utime + ru.ru_stime)


def resumed_lookup(dirs:list[Path], release:Path, ledger:Path)->tuple[float, int, float]:
    "Seconds for the ledger to find every request of every run cached (a backend that is never asked), the count, CPU seconds"
    from medsafe_nb.items.release import load_medmisbench
    from medsafe_nb.protocols import build_prompts
    from medsafe_nb.run.ledger import Ledger, cached_generate
    items = load_medmisbench("all", str(release))
    rec = json.loads((dirs[0] / "run.json").read_text())
    prompts = build_prompts(items, rec["conditions"], seed=rec["seed"], prompt=rec["prompt"], structured=rec.get("structured"))
    class Never(ScaleBackend):
        def generate(self, requests): raise AssertionError(f"asked {len(requests)} requests: not all cached")
    reqs = [GenRequest(p.messages, rec.get("max_new_tokens"), response_schema=p.response_schema, parts=p.parts, reply_format=p.reply_format,
                       protocol=p.protocol) for p in prompts]      # as `run/predict` asks them
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    with Ledger(ledger) as led:
        for d in dirs:
            got = cached_generate(Never(d.name), reqs, led, progress=False)
            n += sum(g is not None for g in got)
    return time.perf_counter() - t0, n, time.process_time() - c0


def distinct_text_estimate(html:Path)->float:
    "MB the report would take if the prompts of all 10,932 items were distinct text (the synthetic copies repeat the\n    sample's 106 questions, which gzip partly finds again): its prompt block recompressed at the sample's own ratio"
    import base64, gzip, re
    from medsafe_nb.items.release import load_medmisbench
    from medsafe_nb.protocols import build_prompts
    text = html.read_text(encoding="utf-8")
    b64 = re.search(r'id="rows-prompts">(.*?)</script>', text, re.S)[1]
    raw = len(gzip.decompress(base64.b64decode(b64)))
    sample = json.dumps(list(dict.fromkeys(m["content"] for p in build_prompts(load_medmisbench()) for m in p.messages)), ensure_ascii=False).encode()
    ratio = len(sample) / len(gzip.compress(sample, 9))
    return (len(text.encode()) - len(b64) + raw / ratio * 4 / 3) / 1e6


def browser(html:Path)->dict:
    "Load time, the rows reachable, and filter times in headless Chromium"
    from playwright.sync_api import sync_playwright
    filt = """async ([sel, value]) => {
      const el = document.querySelector(sel), t0 = performance.now();
      el.value = value; el.dispatchEvent(new Event('change'));
      return [performance.now() - t0, Number(document.getElementById('count').getAttribute('data-n'))];
    }"""
    out = {}
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = b.new_page()
        t0 = time.perf_counter(); page.goto(html.resolve().as_uri()); page.wait_for_selector("#rows-body tr.item", timeout=120_000)
        out["open"] = time.perf_counter() - t0
        out["rows"] = int(page.locator("#count").get_attribute("data-n"))
        out["filter condition=type1"] = page.evaluate(filt, ["#f-condition", "type1"])
        out["filter flipped=true"] = page.evaluate(filt, ["#f-flipped", "true"])
        page.evaluate(filt, ["#f-condition", "*"])
        out["filter status=refused"] = page.evaluate(filt, ["#f-status", "refused"])
        b.close()
    return out


class Rows(list):
    "The table's rows: each printed the moment it is measured, with the load"
    def append(self, row):
        v, fig, target, met = row
        verdict = "" if met is None else f" | {target}: {'met' if met else 'MISSED'}"
        print(f"  row | {v} | {fig}{verdict} (load {os.getloadavg()[0]:.1f})", flush=True)
        super().append(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=sum(SPLITS.values()), help="items per run (the paper: 10,932)")
    ap.add_argument("--runs", type=int, default=11, help="model configurations (the paper: 11)")
    ap.add_argument("--quick", action="store_true", help="3 runs of 600 items: checks the script, measures nothing")
    ap.add_argument("--keep", default=None, help="build in (or reuse) this folder and keep it")
    ap.add_argument("--skip", default="", help="comma-separated: metrics, report, browser, show, review, ledger")
    args = ap.parse_args()
    if args.quick: args.items, args.runs = 600, 3
    skip = set(filter(None, args.skip.split(",")))
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="medsafe-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; building {args.runs} runs x {args.items} items in {root}", flush=True)
    rows = Rows()   # (verb, figure, target, met), each printed as it is measured
    try:
        t0 = time.perf_counter()
        if (root / "built.json").is_file() and json.loads((root / "built.json").read_text()) == [args.items, args.runs]:
            dirs, release = sorted((root / "runs").iterdir()), root / "release.jsonl"
        else:
            shutil.rmtree(root / "runs", ignore_errors=True); (root / "ledger.sqlite").unlink(missing_ok=True)
            dirs, release = build(root, args.items, args.runs)
            (root / "built.json").write_text(json.dumps([args.items, args.runs]))
        import pandas as pd
        preds = pd.concat([pd.read_parquet(d / "predictions.parquet", columns=["status", "raw"]) for d in dirs])
        n = len(preds)
        mix = preds.status.value_counts(normalize=True).mul(100).round(1).to_dict()
        print(f"built in {time.perf_counter() - t0:.0f} s: {n:,} rows; status % {mix}; mean reply {preds.raw.str.len().mean():.0f} chars", flush=True)
        del preds
        if "metrics" not in skip:
            dt, mb, rc, last, cpu = verb(["metrics", *dirs, "--out", root / "metrics"], root)
            rows.append(("medsafe metrics (n_boot 1000)", f"{dt:.1f} s ({cpu:.1f} s CPU), {mb:.0f} MB peak (exit {rc})", "<= 10 s, <= 1024 MB", dt <= 10 and mb <= 1024 and rc == 0))
        if "report" not in skip:
            html = root / "report.html"
            dt, mb, rc, last, cpu = verb(["report", *dirs, "--out", html], root)
            size = html.stat().st_size / 1e6 if html.is_file() else float("nan")
            rows.append(("medsafe report: write", f"{dt:.1f} s ({cpu:.1f} s CPU), {mb:.0f} MB peak (exit {rc})", "", None))
            rows.append(("medsafe report: file size", f"{size:.1f} MB for {n:,} rows", "<= 25 MB", size <= 25))
            if html.is_file():
                est = distinct_text_estimate(html)
                rows.append(("report size, were every item's text distinct", f"~{est:.1f} MB (prompts at the sample's gzip ratio)", "<= 25 MB", est <= 25))
            if "browser" not in skip and CHROMIUM.exists() and html.is_file():
                try:
                    b = browser(html)
                    rows.append(("report: open in Chromium", f"{b['open']:.2f} s, {b['rows']:,} rows reachable", "<= 3 s, every row", b["open"] <= 3 and b["rows"] == n))
                    for k in ("filter condition=type1", "filter flipped=true", "filter status=refused"):
                        ms, hits = b[k]
                        rows.append((f"report: {k}", f"{ms:.0f} ms ({hits:,} rows)", "<= 200 ms", ms <= 200))
                except Exception as e: print(f"browser part not measured: {type(e).__name__}: {e}")
        if "show" not in skip:
            dt, mb, rc, last, cpu = verb(["show", dirs[0], "--flipped"], root)
            rows.append(("medsafe show --flipped (one run)", f"{dt:.1f} s ({cpu:.1f} s CPU), {mb:.0f} MB peak (exit {rc})", "<= 5 s", dt <= 5 and rc == 0))
        if "review" not in skip:
            shutil.rmtree(root / "packet", ignore_errors=True)
            dt, mb, rc, last, cpu = verb(["review", "export", *dirs, "--kind", "harm", "--n", "90", "--raters", "A,B,C", "--out", root / "packet"], root)
            rows.append(("medsafe review export --kind harm --n 90", f"{dt:.1f} s ({cpu:.1f} s CPU), {mb:.0f} MB peak (exit {rc})", "<= 5 s", dt <= 5 and rc == 0))
            if rc: print(f"review export: {last}")
        if "ledger" not in skip:
            dt, found, cpu = resumed_lookup(dirs, release, root / "ledger.sqlite")
            rows.append((f"ledger: resumed, all {n:,} cached", f"{dt:.1f} s ({cpu:.1f} s CPU; {found:,} found, none asked)", "<= 10 s", dt <= 10 and found == n))
            from medsafe_nb.run.runner import run
            register_backend("scale", lambda name, **o: ScaleBackend(name, **o))     # a rerun asks nothing: the backend never answers
            t0, c0 = time.perf_counter(), time.process_time()
            again = run(model="scale:model-00", data=str(release), out=str(dirs[0]), ledger=str(root / "ledger.sqlite"), progress=False)
            rows.append(("resumed `run()` of one configuration", f"{time.perf_counter() - t0:.1f} s ({time.process_time() - c0:.1f} s CPU) for {len(again):,} rows", "", None))
    finally:
        if not args.keep: shutil.rmtree(root, ignore_errors=True)
    print(f"\nPaper scale: {args.runs} runs x {args.items:,} items x 3 conditions" + (" (--quick: not the paper's size)" if args.quick else ""))
    w = max(len(r[0]) for r in rows) if rows else 10
    print(f"| {'verb':<{w}} | measured | target | met |\n| {'-' * w} | --- | --- | --- |")
    for v, fig, target, met in rows:
        print(f"| {v:<{w}} | {fig} | {target} | {'' if met is None else ('yes' if met else 'NO')} |")
    print("\nload average (1, 5, 15 min) at the end: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"
          " (a shared machine: the CPU seconds are what each verb itself used)")


if __name__ == "__main__":
    main()
