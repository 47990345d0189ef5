"""The report at the paper's size in a real browser: 11 runs x 10,932 items x 3 conditions = 360,756 rows, every one reachable.

The runs are written directly (predictions, run record, manifest) on a release of 10,932 items made from the embedded
sample's questions, each copy numbered; the report renders every row's prompt again from that release. Chromium opens
the file from file:// and the test checks what a user relies on: the file stays small, every row is counted and can
be found, every filter selects exactly the rows pandas selects, and a row's prompt and reply are shown. No timing is
asserted (`bench/bench_scale.py` times it).
"""
import json
from pathlib import Path
import numpy as np
import pandas as pd
import pytest
from conftest import browser_missing
from medsafe_nb import report
from medsafe_nb.core import write_manifest
from medsafe_nb.items.release import load_medmisbench, sample_path
from medsafe_nb.protocols import build_prompts

SPLITS = {"MEDMISQA": 3112, "MEDMISMCQA": 3986, "MEDMISXPERTQA": 1544, "MEDMISJOURNEY": 2197, "MEDMISHLE": 93}
N_MODELS, CONDITIONS = 11, ["clean", "type1", "type2"]

pytestmark = [pytest.mark.integration, pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or "")]


def paper_release(path:Path)->Path:
    "10,932 items in the paper's split sizes, each a numbered copy of a sample question (so no two prompts are alike)"
    rows = [json.loads(l) for l in sample_path().read_text().splitlines() if l.strip()]
    with path.open("w", encoding="utf-8") as f:
        for split, n in SPLITS.items():
            pool = [r for r in rows if r["config"] == split]
            for k in range(n):
                r = dict(pool[k % len(pool)], config=split, id=f"{split}-{k:05d}")
                r["question"] = f"(Case {k + 1}) " + r["question"]
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def write_runs(root:Path, release:Path)->list[Path]:
    "N_MODELS committed run folders: model m right in clean with probability 0.55 + 0.035 m, misled under context, a status mix"
    prompts = build_prompts(load_medmisbench("all", str(release)), CONDITIONS)
    base = pd.DataFrame({"item_id": [p.item_id for p in prompts], "condition": [p.condition for p in prompts],
                         "target": [p.target for p in prompts], "gold": [",".join(p.gold) for p in prompts],
                         "wrong": [next(k for k in p.keys if k not in p.gold) for p in prompts]})
    items = {it.id: it for it in load_medmisbench("all", str(release))}
    base["source"] = [items[i].split for i in base.item_id]
    base["content"] = [items[i].content for i in base.item_id]
    base["provenance"] = [items[i].provenance for i in base.item_id]
    dirs = []
    for m in range(N_MODELS):
        rng = np.random.default_rng(m)
        n = len(base)
        right = rng.random(n) < 0.55 + 0.035 * m
        misled = (base.condition != "clean").to_numpy() & (rng.random(n) < 0.5 - 0.03 * m)
        pred = np.where(right & ~misled, base.gold, np.where(base.target.notna(), base.target.fillna(""), base.wrong)).astype(object)
        u = rng.random(n)
        status = np.select([u < 0.004, u < 0.009, u < 0.03], ["refused", "truncated", "noanswer"], "ok").astype(object)
        raw = np.array(['{"answer": "%s"}' % p for p in pred], dtype=object)
        raw[status == "refused"] = "I can't help with choosing a treatment."
        raw[status == "noanswer"] = "Several of these could apply."
        pred[status != "ok"] = None
        p = base.drop(columns="wrong").assign(model=f"model-{m:02d}", pred=pred, status=status, raw=raw,
                                              correct=(pred == base.gold.to_numpy()) & (status == "ok"),
                                              prompt_tokens=300, completion_tokens=6, latency_s=0.0)
        d = root / f"model-{m:02d}"; d.mkdir(parents=True)
        p.to_parquet(d / "predictions.parquet", index=False)
        (d / "run.json").write_text(json.dumps({"model": f"model-{m:02d}", "model_spec": f"scripted:model-{m:02d}", "data": str(release),
                                                "config": "all", "seed": 0, "conditions": CONDITIONS, "scoring": "generate",
                                                "mitigation": "none", "prompt": "compact"}))
        write_manifest(d, ["predictions.parquet"], rows=len(p))
        dirs.append(d)
    return dirs


@pytest.fixture(scope="module")
def scale(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    dirs = write_runs(root / "runs", paper_release(root / "release.jsonl"))
    html = report.write_report(dirs, root / "report.html", n_boot=20, figures=False)
    preds = pd.concat([report.read_run(d)[0] for d in dirs], ignore_index=True)
    return html, preds.assign(flipped=report.flipped_rows(preds))


def _count(page)->int: return int(page.locator("#count").get_attribute("data-n"))


def test_paper_scale_report(browser, scale):
    html, preds = scale
    n = len(preds)
    assert n == 360_756
    assert html.stat().st_size <= 25e6, f"{html.stat().st_size / 1e6:.1f} MB"
    back = report.read_report_rows(html)                                    # every row, with its prompt, is in the file
    assert len(back) == n and back.prompt.map(len).eq(2).all()
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    page = ctx.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(html.resolve().as_uri())
    page.wait_for_selector("body[data-rows=ready] #rows-body tr.item", timeout=120_000)
    page.wait_for_selector("body[data-prompts=ready]", timeout=120_000)
    assert _count(page) == n
    # filters: the counts pandas computes, alone and combined
    for fid, col, values in [("condition", "condition", CONDITIONS), ("status", "status", ["ok", "refused", "truncated"]),
                             ("model", "model", ["model-00", "model-10"]), ("source", "source", ["MEDMISHLE"])]:
        for v in values:
            page.select_option(f"#f-{fid}", value=v)
            assert _count(page) == int((preds[col] == v).sum()), (fid, v)
        page.select_option(f"#f-{fid}", value="*")
    page.select_option("#f-flipped", value="true")
    page.select_option("#f-condition", value="type1")
    assert _count(page) == int((preds.flipped & (preds.condition == "type1")).sum()) > 0
    page.select_option("#f-flipped", value="*"); page.select_option("#f-condition", value="*")
    # the last row of the last run is reachable: searched for, shown, opened with its prompt
    last = preds.iloc[-1]
    page.fill("#search", last.item_id.lower())
    page.wait_for_selector(f'#count[data-q="{last.item_id.lower()}"]')     # the search has run (a selector: the page's CSP forbids eval)
    assert _count(page) == int((preds.item_id == last.item_id).sum()) == 3 * N_MODELS
    page.select_option("#f-model", value=last.model)
    assert _count(page) == 3
    row = page.locator("#rows-body tr.item").filter(has_text=last.condition).first
    row.click()
    detail = page.locator("#rows-body tr.detail").inner_text()
    assert "(Case " in detail and last.raw in detail
    assert errors == []
    ctx.close()
