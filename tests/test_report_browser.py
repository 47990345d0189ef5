"""The results report (`medsafe report`) in a real browser: headless Chromium (Debian `chromium`) driven by playwright, from file://.

Two runs go into one report: the MiniLM baseline and a scripted model whose replies include markup. Every filter must
narrow the rows to the count computed from the predictions tables, the text search must find what pandas finds, the
markup must show as text and never run, nothing may be fetched, and the console must stay free of errors.
`make browser` installs what this needs; without it the test skips and says why.
"""
from pathlib import Path
import pandas as pd
import pytest
from conftest import browser_missing, screenshot_path
from medsafe_nb import report
from medsafe_nb.models.base import Backend, Generation, register_backend
from medsafe_nb.items.release import load_medmisbench
from medsafe_nb.protocols import build_prompts
from medsafe_nb.run.runner import run

EVIL = '<img src=x onerror="window.__pwned=1">'
SCREENSHOT = screenshot_path("report.png")
FILTERS = {"model": "model", "source": "source", "condition": "condition", "status": "status", "flipped": "flipped",
           "content": "content", "provenance": "provenance"}

pytestmark = [pytest.mark.integration, pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or "")]


class MarkupBackend(Backend):
    "Gold in clean, the first option under attack; item 1 refused; item 2 answered with markup around a JSON answer"
    kind = "markup"
    def __init__(self, name, **options):
        self.model = name or "markup"
        items = load_medmisbench("all", "sample")[:12]
        self.ids = [it.id for it in items]
        self.prompts = {p.messages[-1]["content"]: p for p in build_prompts(items)}
    def generate(self, requests):
        for i, r in enumerate(requests):
            p = self.prompts[r.messages[-1]["content"]]
            if p.item_id == self.ids[1]: yield i, Generation("I cannot help with that.", "refused"); continue
            key = ",".join(p.gold) if p.condition == "clean" else p.keys[0]
            text = f'{EVIL} </script><script>window.__pwned=2</script> {{"answer": "{key}"}}' if p.item_id == self.ids[2] else f'{{"answer": "{key}"}}'
            yield i, Generation(text, "stop")


@pytest.fixture(scope="module")
def runs(minilm_run_dir, tmp_path_factory):
    register_backend("markup", MarkupBackend)
    markup = tmp_path_factory.mktemp("markup") / "run"
    run(model="markup:model-x", data="sample", out=str(markup), limit=12, progress=False)
    return [minilm_run_dir, markup]

@pytest.fixture(scope="module")
def html_report(runs, tmp_path_factory):
    return report.write_report(runs, tmp_path_factory.mktemp("report") / "report.html", n_boot=50)

@pytest.fixture(scope="module")
def preds(runs):
    p = pd.concat([report.read_run(d)[0] for d in runs], ignore_index=True)
    return p.assign(flipped=report.flipped_rows(p))

def _open(browser, path):
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    page = ctx.new_page()
    errors, requests = [], []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("request", lambda r: requests.append(r.url))
    page.goto(Path(path).resolve().as_uri())
    page.wait_for_selector("#rows-body tr.item")
    return ctx, page, errors, requests

def _count(page)->int: return int(page.locator("#count").get_attribute("data-n"))

def _search(page, text:str, want:int):
    "Type into the search box and wait until the (debounced) filter shows `want` rows: no fixed sleep"
    page.fill("#search", text)
    page.wait_for_function("w => Number(document.querySelector('#count').dataset.n) === w", arg=want, timeout=60_000)

def _value(v)->str:
    if isinstance(v, (bool,)) or str(v) in ("True", "False"): return str(v).lower()
    return "" if v is None or (isinstance(v, float) and pd.isna(v)) else str(v)


def test_filters_search_and_escaping(browser, html_report, preds):
    ctx, page, errors, requests = _open(browser, html_report)
    n = len(preds)
    assert _count(page) == n and n == 24 * 3 + 12 * 3
    assert page.locator("#rows-body tr.item").count() == 50          # one page of rows
    page.click("#next")
    assert page.locator("#rows-body tr.item").count() == min(50, n - 50)
    page.click("#prev")
    # every filter, every value: the rows shown are those pandas selects
    for fid, col in FILTERS.items():
        values = preds[col].map(_value)
        for v in sorted(values.unique()):
            page.select_option(f"#f-{fid}", value=v)
            want = int((values == v).sum())
            assert _count(page) == want, (fid, v)
            assert page.locator("#rows-body tr.item").count() == min(50, want), (fid, v)
        page.select_option(f"#f-{fid}", value="*")
    assert _count(page) == n
    # filters combine
    page.select_option("#f-condition", value="type1")
    page.select_option("#f-flipped", value="true")
    assert _count(page) == int(((preds.condition == "type1") & preds.flipped).sum()) > 0
    page.select_option("#f-condition", value="*"); page.select_option("#f-flipped", value="*")
    # text search (item ids and replies), case-insensitive
    item = preds.item_id.iloc[5]
    want = int(preds.item_id.str.contains(item, regex=False).sum())
    _search(page, item.upper(), want)
    assert _count(page) == want == 6
    hits = int(preds.raw.fillna("").str.lower().str.contains("window.__pwned", regex=False).sum())
    _search(page, "WINDOW.__PWNED", hits)
    assert _count(page) == hits == 3
    # the markup is shown as text, in the table and in the opened row, and never runs
    page.locator("#rows-body tr.item").first.click()
    detail = page.locator("#rows-body tr.detail").inner_text()
    assert EVIL in detail and "read by: json" in detail and "[user]" not in detail and "Question:" in detail
    assert page.locator("#rows img").count() == 0 and page.locator("#rows script").count() == 0
    assert page.evaluate("typeof window.__pwned") == "undefined"
    _search(page, "", n)
    assert _count(page) == n
    # offline: the page fetched nothing but itself (figures are data: URIs); the console is clean
    assert [u for u in requests if not u.startswith(("file://", "data:"))] == []
    assert errors == []
    ctx.close()


def test_tables_beside_the_paper(browser, html_report):
    ctx, page, errors, _ = _open(browser, html_report)
    rows = page.locator("#table1 + p + table tbody tr")
    assert page.locator("tr.run").count() == 2                        # the baseline and one language model: no Mean over one model
    assert "no Mean row" in page.locator("body").inner_text()
    assert page.locator("tr.paper").count() > 0
    assert "[" in page.locator("tr.run").first.inner_text()           # intervals shown
    assert page.locator("figure img").count() >= 4
    assert all(page.locator("figure img").nth(i).evaluate("i => i.complete && i.naturalWidth > 0")
               for i in range(page.locator("figure img").count()))
    assert rows.count() >= 3 and errors == []
    ctx.close()


def test_screenshot(browser, minilm_run_dir, tmp_path):
    "The picture in the docs: the MiniLM sample run's row browser, one Type 1 row opened"
    out = report.write_report([minilm_run_dir], tmp_path / "minilm.html", n_boot=50)
    ctx, page, errors, _ = _open(browser, out)
    page.select_option("#f-condition", value="type1")
    page.select_option("#f-flipped", value="true")
    page.locator("#rows-body tr.item").first.click()
    page.locator("#browser").scroll_into_view_if_needed()
    page.evaluate("document.getElementById('browser').scrollIntoView()")
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT))
    assert SCREENSHOT.stat().st_size > 10_000 and errors == []
    ctx.close()
