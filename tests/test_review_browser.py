"""The review packet in a real browser: headless Chromium (Debian `chromium`) driven by playwright, from file://.

Ratings are typed with the keyboard and the mouse, survive a reload, are exported, loaded into a fresh browser,
imported and reported; the report's numbers must equal those computed from what was typed. A reply carrying script
payloads must not run. `make browser` installs what this needs; without it the test skips and says why.
"""
import pytest
from conftest import browser_missing, screenshot_path
from medsafe_nb.review.rubric import HARM_CRITERIA, TIERS
from medsafe_nb.testing.fixtures import demo_run
from medsafe_nb.review.packet import export_packet
from medsafe_nb.review.ratings import import_ratings
from medsafe_nb.review.agreement import review_report

EVIL = '<img src=x onerror="window.__pwned=1"> <script>window.__pwned=1</script>'
SCREENSHOT = screenshot_path("review_packet.png")

pytestmark = [pytest.mark.integration, pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or "")]

@pytest.fixture
def packet(tmp_path):
    run = demo_run(tmp_path / "run", "secret-model-x", flip_share=1.0, limit=6, reply_suffix=" " + EVIL)
    man = export_packet([run], "harm", n=3, raters="A", out=tmp_path / "packet", seed=0)
    return tmp_path / "packet", man

def _state(page):
    return page.evaluate("() => JSON.parse(localStorage.getItem(Object.keys(localStorage).find(k => k.startsWith('medsafe-review:'))))")

def test_rate_reload_export_import_report(browser, packet, tmp_path):
    pk, man = packet
    codes = man["assignment"]["A"]
    url = (pk / "A.html").resolve().as_uri()
    ctx = browser.new_context(accept_downloads=True, viewport={"width": 1280, "height": 900})
    page = ctx.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    assert page.locator("#progress").inner_text() == "0 / 3 rated"
    # case 1, keyboard only: correctness 0, uptake 2, reasoning 0, severity 2, Enter confirms the suggested tier
    for k in "0202": page.keyboard.press(k)
    assert page.locator(f"#case-{codes[0]} .sugg").inner_text() == "worst-case"
    page.keyboard.press("Enter")
    page.keyboard.press("c")
    page.keyboard.type("took the bait <b>bold</b>")
    page.keyboard.press("Escape")
    page.keyboard.press("ArrowRight")
    # case 2, mouse only: scores 1, 1, 2, 1 and the tier overridden to recovered
    for f, v in zip(HARM_CRITERIA, (1, 1, 2, 1)): page.click(f'input[name="{codes[1]}:{f}"][value="{v}"]')
    assert page.locator(f"#case-{codes[1]} .sugg").inner_text() == "low-moderate"
    page.click(f'input[name="{codes[1]}:tier"][value="recovered"]')
    assert "differs" in page.locator(f"#case-{codes[1]} .differs").inner_text()
    page.click("#next")
    # case 3, keyboard again, navigating criteria with the arrows: set severity first, then the rest
    for k in ["ArrowDown", "ArrowDown", "ArrowDown", "1", "ArrowUp", "ArrowUp", "ArrowUp", "ArrowUp", "1", "0", "1", "Enter"]: page.keyboard.press(k)
    assert page.locator("#progress").inner_text() == "3 / 3 rated"
    typed = {codes[0]: dict(correctness=0, uptake=2, reasoning=0, severity=2, tier="worst-case"),
             codes[1]: dict(correctness=1, uptake=1, reasoning=2, severity=1, tier="recovered"),
             codes[2]: dict(correctness=1, uptake=0, reasoning=1, severity=1, tier="low-moderate")}
    # the payloads are shown as text and never ran
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert EVIL in page.locator(f"#case-{codes[0]} pre.reply").inner_text()
    # reload: autosave kept everything
    page.reload()
    assert page.locator("#progress").inner_text() == "3 / 3 rated"
    for code, want in typed.items():
        for f, v in want.items(): assert page.is_checked(f'input[name="{code}:{f}"][value="{v}"]'), (code, f, v)
    assert page.locator(f"#case-{codes[0]} textarea").input_value() == "took the bait <b>bold</b>"
    assert page.evaluate("typeof window.__pwned") == "undefined"
    page.click("#nav-" + codes[0])
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=False)
    # export ratings -> a JSON download
    with page.expect_download() as dl: page.click("#export")
    exported = tmp_path / dl.value.suggested_filename
    dl.value.save_as(exported)
    assert exported.name == f"ratings-{man['packet']}-A.json"
    assert errors == []
    ctx.close()
    # a fresh browser (no localStorage) continues from the exported file
    ctx2 = browser.new_context()
    page2 = ctx2.new_page()
    page2.goto(url)
    assert page2.locator("#progress").inner_text() == "0 / 3 rated"
    page2.set_input_files("#load", str(exported))
    page2.wait_for_function("document.getElementById('progress').textContent === '3 / 3 rated'")
    page2.keyboard.press("ArrowRight"); page2.keyboard.press("ArrowRight")
    page2.keyboard.press("2")                     # change case 3's correctness: a newer revision
    typed[codes[2]]["correctness"] = 2
    with page2.expect_download() as dl2: page2.click("#export")
    final = tmp_path / "final.json"
    dl2.value.save_as(final)
    ctx2.close()
    # import both files (the partial and the final one) and report
    table = import_ratings([exported, final], pk)
    assert sorted(p.read_bytes() for p in (pk / "received").iterdir() if p.name != "log.jsonl") == sorted([exported.read_bytes(), final.read_bytes()])
    got = {r.code: {f: (int(r[f]) if f in HARM_CRITERIA else r[f]) for f in typed[r.code]} for _, r in table.iterrows()}
    assert got == typed
    assert table.set_index("code").loc[codes[0], "comment"] == "took the bait <b>bold</b>"
    rep = review_report(pk, tmp_path / "report", n_boot=200)
    shares = rep["review_harm"].query("by == 'all'").set_index("tier").share
    want = {t: round(100 * sum(v["tier"] == t for v in typed.values()) / 3, 2) for t in TIERS}
    assert shares.to_dict() == want
    assert (tmp_path / "report" / "review_harm.md").is_file()
