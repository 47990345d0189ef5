"`make docs` (tools/render_docs.py): nbdev directives stripped, hidden cells gone, no prompts, images that resolve"
import importlib.util, re, sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_notebook, new_code_cell, new_markdown_cell, new_output
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("render_docs", ROOT / "tools" / "render_docs.py")
rd = sys.modules["render_docs"] = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(rd)

# a 1x1 PNG
PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")


def _nb(path:Path, *cells):
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(new_notebook(cells=list(cells)), path)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    "A tiny project (index, a library notebook, one with an image, an executed analysis notebook, docs/design.md) rendered"
    root = tmp_path_factory.mktemp("proj")
    nbs = root / "nbs"
    (nbs / "images").mkdir(parents=True); (nbs / "images" / "pic.png").write_bytes(PNG)
    (root / "figures").mkdir(); (root / "figures" / "plot.png").write_bytes(PNG)
    (root / "docs").mkdir()
    (root / "docs" / "design.md").write_text("# Design\n\n## The science in one screen\n\n### Metrics\n\nASR and TASR.\n")
    _nb(nbs / "index.ipynb", new_markdown_cell("# demo_pkg\n\n![a plot](figures/plot.png)\n\nSee [metrics](nbs/10_lib.ipynb)."))
    lib_out = new_output("execute_result", data={"text/plain": "42"}, execution_count=3)
    _nb(nbs / "10_lib.ipynb",
        new_markdown_cell("# Library\n> one module\n\nThe metrics are the paper's ([design](../docs/design.md#metrics))."),
        new_code_cell("#| default_exp lib"),
        new_code_cell("#| hide\nHIDDEN_MARKER = 1"),
        new_code_cell("#| export\ndef answer(): return 42", execution_count=2),
        new_code_cell("answer()", outputs=[lib_out], execution_count=3),
        new_code_cell("#| echo: false\nSOURCE_MARKER = 'not shown'",
                      outputs=[new_output("stream", name="stdout", text="echo output shown\n")]))
    _nb(nbs / "20_img.ipynb", new_markdown_cell("# With an image\n\n![pic](images/pic.png)\n\n<img src=\"images/pic.png\" width=10>"))
    _nb(nbs / "analysis" / "01_table.ipynb", new_markdown_cell("# 01 · Table: the main table"), new_code_cell("print(1)"))
    executed = root / "figures" / "executed"
    _nb(executed / "01_table.ipynb", new_markdown_cell("# 01 · Table: the main table"),
        new_code_cell("print(1)", execution_count=1, outputs=[
            new_output("stream", name="stderr", text="\rbar  0%|"), new_output("stream", name="stderr", text="\rbar 50%|"),
            new_output("stream", name="stderr", text="\rbar 100%| EXECUTED_MARKER"), new_output("stream", name="stderr", text="\n")]))
    pages = rd.site_pages(root, executed)
    out = root / "_docs"
    rd.render_site(pages, out, root, log=None)
    return out, {p.out: p for p in pages}


def _html(site, name): return (site[0] / name).read_text()


def test_pages_and_navigation(site):
    out, pages = site
    assert list(pages) == ["index.html", "design.html", "10_lib.html", "20_img.html", "analysis/01_table.html"]
    assert pages["10_lib.html"].title == "10 · Library" and pages["analysis/01_table.html"].title == "01 · Table"
    for name in pages:
        html = _html(site, name)
        assert '<nav class="site">' in html and ">10 · Library</a>" in html and ">01 · Table</a>" in html
    assert 'href="../index.html"' in _html(site, "analysis/01_table.html")


def test_directives_hidden_cells_and_prompts(site):
    for name in ("index.html", "10_lib.html", "20_img.html", "analysis/01_table.html"):
        html = _html(site, name)
        assert "#|" not in html, name
        assert not re.search(r"In(&nbsp;|\xa0| )\[[\d ]*\]:|Out(&nbsp;|\xa0| )?\[\d+\]:", html), name  # no prompts
        assert 'class="jp-InputPrompt' not in html, name
    lib = _html(site, "10_lib.html")
    assert "HIDDEN_MARKER" not in lib and "default_exp" not in lib     # #| hide cell and the default_exp cell are gone
    assert "SOURCE_MARKER" not in lib and "echo output shown" in lib   # #| echo: false keeps the output only
    assert "answer" in lib and "42" in lib and "celltag_exported" in lib


def _img_srcs(html): return re.findall(r'<img[^>]*\ssrc="([^"]+)"', html)


@pytest.mark.parametrize("name,n", [("20_img.html", 2), ("index.html", 1)])
def test_images_resolve(site, name, n):
    srcs = _img_srcs(_html(site, name))
    assert len(srcs) == n
    for src in srcs: assert (site[0] / name).parent.joinpath(src).is_file(), src


def test_links_to_pages_and_design_anchor(site):
    assert 'href="10_lib.html"' in _html(site, "index.html")
    assert 'href="design.html#metrics"' in _html(site, "10_lib.html")
    assert '<h3 id="metrics">' in _html(site, "design.html")


def test_analysis_page_from_executed_copy(site):
    html = _html(site, "analysis/01_table.html")
    assert "EXECUTED_MARKER" in html and "bar 50%" not in html   # the executed copy, progress bar at its last frame
    assert "Not executed yet" not in html


def test_settle_progress():
    assert rd.settle_progress("a 1%\ra 50%\ra 100%\ndone\n") == "a 100%\ndone\n"
    assert rd.strip_directives("#| export\n#| slow\nx = 1") == "x = 1"
    assert rd.directives("#| echo: false\n#|hide\nx") == {"echo": "false", "hide": ""}
    assert rd.slug("The science in one screen") == "the-science-in-one-screen"
