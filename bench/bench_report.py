"""Report scale: write time, file size and in-browser filter/search times for a report of 10k+ rows.

A MiniLM run on the embedded sample (96 items × 3 conditions) is copied under 42 model labels: 12,096 rows with their
prompts. The browser part needs headless Chromium and playwright (`make browser`) and is left out without them.
Run: .venv/bin/python bench/bench_report.py [N_COPIES]   (prints a table; nothing is asserted)
"""
import json, shutil, sys, tempfile, time
from pathlib import Path

import pandas as pd
from medsafe_nb import report
from medsafe_nb.run.runner import run

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def copies(base:Path, n:int, root:Path)->list[Path]:
    "n copies of a run folder, each under its own model label"
    out = []
    for i in range(n):
        d = root / f"run{i:02d}"
        shutil.copytree(base, d)
        p = pd.read_parquet(d / "predictions.parquet")
        p.assign(model=f"model-{i:02d}").to_parquet(d / "predictions.parquet", index=False)
        rec = json.loads((d / "run.json").read_text()); rec["ledger"] = str(d / "ledger.sqlite")
        (d / "run.json").write_text(json.dumps(rec))
        out.append(d)
    return out


def browser_times(html:Path)->dict:
    from playwright.sync_api import sync_playwright
    js = """async ([sel, value]) => {
      const el = document.querySelector(sel), t0 = performance.now();
      if (el.tagName === 'SELECT') { el.value = value; el.dispatchEvent(new Event('change')); }
      else { el.value = value; el.dispatchEvent(new Event('input')); await new Promise(r => setTimeout(r, 200)); }
      return performance.now() - t0 - (el.tagName === 'SELECT' ? 0 : 200);
    }"""
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        page = b.new_page()
        t0 = time.perf_counter(); page.goto(html.resolve().as_uri()); page.wait_for_selector("#rows-body tr.item")
        out = {"load (s)": time.perf_counter() - t0}
        out["filter condition=type1 (ms)"] = page.evaluate(js, ["#f-condition", "type1"])
        out["filter flipped=true (ms)"] = page.evaluate(js, ["#f-flipped", "true"])
        out["first search, builds index (ms)"] = page.evaluate(js, ["#search", "insulin"])
        out["second search (ms)"] = page.evaluate(js, ["#search", "potassium"])
        out["rows shown / matched"] = f'{page.locator("#rows-body tr.item").count()} / {page.locator("#count").get_attribute("data-n")}'
        b.close()
    return out


def main(n:int=42):
    root = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    run(model="minilm", data="sample", out=str(root / "base"), progress=False)
    rows = {"MiniLM sample run (s)": time.perf_counter() - t0}
    runs = copies(root / "base", n, root)
    t0 = time.perf_counter()
    html = report.write_report(runs, root / "report.html", n_boot=200)
    rows["write_report (s)"] = time.perf_counter() - t0
    rows["rows"] = sum(len(pd.read_parquet(d / "predictions.parquet")) for d in runs)
    rows["report size (MB)"] = html.stat().st_size / 1e6
    if CHROMIUM.exists(): rows.update(browser_times(html))
    w = max(map(len, rows))
    for k, v in rows.items(): print(f"{k:<{w}}  {v:.2f}" if isinstance(v, float) else f"{k:<{w}}  {v}")
    shutil.rmtree(root)


if __name__ == "__main__": main(int(sys.argv[1]) if len(sys.argv) > 1 else 42)
