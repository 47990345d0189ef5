"""The docs site (`make docs`, tools/render_docs.py) in a real browser: headless Chromium driven by playwright, from file://.

The site is rendered from this checkout's notebooks into a temporary folder (with the executed analysis notebooks of
`make figures` when they are there, as `make docs` does). Every page must open with no console error and no failed
or outside request, every image must load, every link inside the site must reach a page (and its anchor), and the
navigation alone must reach every notebook. `make browser` installs what this needs; without it the test skips and says why.
"""
import importlib.util, sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from conftest import browser_missing

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.integration, pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or "")]


def _render_docs():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "tools" / "render_docs.py")
    mod = sys.modules["render_docs"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Anchors(HTMLParser):
    "The ids and names a page defines (the targets of `page.html#anchor`)"
    def __init__(self):
        super().__init__(); self.found = set()
    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ("id", "name") and v: self.found.add(v)


def _anchors(path:Path)->set:
    p = _Anchors(); p.feed(path.read_text(encoding="utf-8")); return p.found


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    "This checkout's site, rendered as `make docs` renders it: (folder, pages)"
    rd = _render_docs()
    executed = ROOT / "figures" / "executed"
    pages = rd.site_pages(ROOT, executed if executed.is_dir() else None)
    out = tmp_path_factory.mktemp("docs") / "_docs"
    rd.render_site(pages, out, ROOT, log=None)
    return out, pages


@pytest.fixture(scope="module")
def visits(site, browser):
    "Every page opened in Chromium once: {page: (console errors, outside or failed requests, broken images, link targets, nav links)}"
    out, pages = site
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, java_script_enabled=True)
    seen = {}
    try:
        for p in pages:
            page = ctx.new_page()
            errors, outside = [], []
            page.on("console", lambda m, e=errors: e.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda x, e=errors: e.append(f"pageerror: {x}"))
            page.on("request", lambda r, o=outside: o.append(r.url) if not r.url.startswith(("file:", "data:", "about:")) else None)
            page.on("requestfailed", lambda r, o=outside: o.append(f"failed: {r.url}"))
            page.goto((out / p.out).as_uri(), wait_until="load")
            broken = page.evaluate("""() => Array.from(document.images)
                .filter(i => !i.complete || i.naturalWidth === 0).map(i => i.getAttribute('src'))""")
            links = page.evaluate("() => Array.from(document.querySelectorAll('a[href]')).map(a => a.href)")
            nav = page.evaluate("() => Array.from(document.querySelectorAll('nav.site a[href]')).map(a => a.href)")
            n_images = page.evaluate("() => document.images.length")
            seen[p.out] = dict(errors=errors, outside=outside, broken=broken, links=links, nav=nav, images=n_images)
            page.close()
    finally: ctx.close()
    return seen


def _local(url:str, out:Path)->tuple[Path, str]|None:
    "A file:// link inside the site as (file, anchor as written); None for a link that leaves the site"
    u = urlsplit(url)
    if u.scheme != "file": return None
    path = Path(unquote(u.path))
    return (path, u.fragment) if path.resolve().is_relative_to(out.resolve()) else None


def test_every_notebook_has_a_page(site):
    "every notebook of nbs/ (index, lanes, analysis) and the design notes are pages of the site"
    out, pages = site
    notebooks = {p.resolve() for p in (ROOT / "nbs").rglob("*.ipynb")
                 if not any(part.startswith((".", "_")) for part in p.relative_to(ROOT / "nbs").parts)}
    assert notebooks and notebooks <= {p.src.resolve() for p in pages}
    assert (ROOT / "docs" / "design.md").resolve() in {p.src.resolve() for p in pages}
    assert all((out / p.out).is_file() for p in pages)


def test_pages_open_without_console_errors(visits):
    "no page logs a console error or a script error, and none asks for anything outside the site (the site works offline)"
    bad = {name: v["errors"] + v["outside"] for name, v in visits.items() if v["errors"] or v["outside"]}
    assert not bad, bad


def test_every_image_loads(visits):
    "every <img> of every page has loaded (a broken relative path shows as an image of width 0)"
    assert sum(v["images"] for v in visits.values()) > 0
    bad = {name: v["broken"] for name, v in visits.items() if v["broken"]}
    assert not bad, bad


def test_internal_links_resolve(site, visits):
    "every link inside the site points at a file of the site, and every #anchor at an id or name of that page"
    out, _ = site
    anchors, bad, checked = {}, [], 0
    for name, v in visits.items():
        for url in v["links"]:
            target = _local(url, out)
            if target is None: continue
            path, frag = target
            checked += 1
            if path.is_dir() or not path.is_file(): bad.append(f"{name}: {url} (no such file)"); continue
            if frag and path.suffix == ".html":
                if path not in anchors: anchors[path] = _anchors(path)
                if not {frag, unquote(frag)} & anchors[path]: bad.append(f"{name}: {url} (no anchor #{frag})")   # as the browser matches: as written, then decoded
    assert checked > len(visits), checked            # the navigation alone links every page from every page
    assert not bad, bad


def test_navigation_reaches_every_notebook(site, visits):
    "following only the navigation from the home page reaches every page, so every notebook"
    out, pages = site
    start = (out / "index.html").resolve()
    reached, todo = {start}, [start]
    while todo:
        here = todo.pop()
        for url in visits[here.relative_to(out.resolve()).as_posix()]["nav"]:
            target = _local(url, out)
            if target and target[0].resolve() not in reached and target[0].is_file():
                reached.add(target[0].resolve()); todo.append(target[0].resolve())
    missing = [p.out for p in pages if (out / p.out).resolve() not in reached]
    assert not missing, missing
