"""`make docs`: render the notebooks, the executed analysis notebooks and docs/design.md into one static site.

    python tools/render_docs.py                      # _docs/ from nbs/, figures/executed/ (P=demo) and docs/design.md
    python tools/render_docs.py --params smoke       # analysis pages from the smoke run's executed copies
    python tools/render_docs.py --run-figures        # run `make figures` first when executed copies are missing

What it does to each notebook, with nbconvert's HTML exporter (lab template):
- nbdev directives: `#| hide` / `#| include: false` cells are dropped, `#| echo: false` drops the code and keeps the
  output, `#| output: false` drops the output; every `#|` line (export, default_exp, slow, ...) is stripped, and a
  cell left empty is dropped;
- no `In [ ]:` / `Out[ ]:` prompts;
- images in markdown (`![](path)`, `<img src=path>`) are looked up beside the notebook, then from the repository root
  (README-style paths such as the index's `figures/...`), copied into the site under `assets/` and relinked;
- links to notebooks and to `docs/design.md` become links to their pages;
- every page gets the same navigation: Home, Design, the library notebooks and the analysis notebooks by title;
- nothing is loaded from the network (the lab template's require.js, MathJax and mermaid are left out): the site opens
  offline, from file://.
Plain build tooling: it needs only nbconvert and nbformat (and mistune, which nbconvert brings).
"""
from __future__ import annotations
import argparse, html, os, re, shutil, subprocess, sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter
from nbconvert.preprocessors import Preprocessor, TagRemovePreprocessor

ROOT = Path(__file__).resolve().parent.parent
_DIRECTIVE = re.compile(r"^\s*#\|\s*([\w-]+)\s*:?\s*(.*?)\s*$")


@dataclass
class Page:
    "One page of the site"
    src: Path              # the notebook (or markdown file) it documents
    out: str               # its path in the site, e.g. `analysis/02_table1_main.html`
    title: str             # its title in the navigation
    section: str           # "home", "design", "library" or "analysis"
    read_from: Path | None = None  # the file actually rendered (an executed copy); default `src`
    note: str = ""         # a line shown above the page (e.g. why it has no outputs)


# ---------------------------------------------------------------- directives

def directives(source:str)->dict[str, str]:
    "The nbdev/Quarto `#|` directives of a code cell: name -> value ('' when bare)"
    return {m.group(1).lower(): m.group(2).lower() for m in map(_DIRECTIVE.match, source.splitlines()) if m}


def strip_directives(source:str)->str:
    "A code cell's source without its `#|` lines (and without blank lines they leave at the top)"
    return "\n".join(l for l in source.splitlines() if not _DIRECTIVE.match(l)).strip("\n")


def settle_progress(text:str)->str:
    "A stream as a terminal would end up showing it: each line's last carriage-return frame (tqdm's final bar)"
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))


def settled_streams(outputs:list)->list:
    "Outputs with consecutive writes to one stream joined and progress bars settled (papermill stores each tqdm frame)"
    res = []
    for out in outputs:
        if (out.get("output_type") == "stream" and res and res[-1].get("output_type") == "stream"
                and res[-1].get("name") == out.get("name")):
            res[-1]["text"] += out.get("text", "")
        else: res.append(out)
    for out in res:
        if out.get("output_type") == "stream": out["text"] = settle_progress(out.get("text", ""))
    return [o for o in res if o.get("output_type") != "stream" or o["text"].strip()]


class NbdevDirectives(Preprocessor):
    "Turn nbdev directives into nbconvert's remove tags, and strip the directive lines"
    def preprocess(self, nb, resources):
        cells = []
        for cell in nb.cells:
            if cell.cell_type == "code":
                d = directives(cell.source)
                tags = set(cell.metadata.get("tags", []))
                if "hide" in d or d.get("include") == "false": continue
                if d.get("echo") == "false": tags.add("remove_input")
                if d.get("output") == "false": tags.add("remove_output")
                if "export" in d or "exporti" in d or "exports" in d: tags.add("exported")
                cell.source = strip_directives(cell.source)
                if cell.get("outputs"): cell.outputs = settled_streams(cell.outputs)
                cell.metadata["tags"] = sorted(tags)
                if not cell.source.strip() and not cell.get("outputs"): continue
            cells.append(cell)
        nb.cells = cells
        return nb, resources


# ---------------------------------------------------------------- images and links

_MD_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_HTML_SRC = re.compile(r"""(<img\b[^>]*?\bsrc=["'])([^"']+)(["'])""", re.I)


def _external(url:str)->bool: return bool(re.match(r"^(?:[a-z][a-z0-9+.-]*:|#|/)", url, re.I))


def locate(url:str, nb_dir:Path, root:Path)->Path|None:
    "The file a relative link means: beside the notebook first, then from the repository root"
    path = url.split("#", 1)[0].split("?", 1)[0]
    if not path or _external(url): return None
    for base in (nb_dir, root):
        p = (base / path).resolve()
        if p.is_file(): return p
    return None


class SiteLinks(Preprocessor):
    "Relink markdown images (copied into the site's assets/) and links to other pages of the site"
    def __init__(self, nb_dir:Path, root:Path, site:Path, page_dir:Path, pages:dict[Path, str], **kw):
        super().__init__(**kw)
        self.nb_dir, self.root, self.site, self.page_dir, self.pages = nb_dir, root, site, page_dir, pages
        self.missing: list[str] = []

    def _rel(self, target:Path)->str: return Path(os.path.relpath(target, self.page_dir)).as_posix()

    def _asset(self, url:str)->str:
        p = locate(url, self.nb_dir, self.root)
        if p is None:
            if not _external(url) and not url.startswith("attachment:"): self.missing.append(url)
            return url
        rel = p.relative_to(self.root) if p.is_relative_to(self.root) else Path("external") / p.name
        dest = self.site / "assets" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dest)
        return self._rel(dest)

    def _link(self, url:str)->str:
        p = locate(url, self.nb_dir, self.root)
        if p is None or p not in self.pages: return url
        anchor = "#" + url.split("#", 1)[1] if "#" in url else ""
        return self._rel(self.site / self.pages[p]) + anchor

    def relink(self, text:str)->str:
        def md(m):
            fix = self._asset if m.group(1).startswith("!") else self._link
            return m.group(1) + fix(m.group(2)) + m.group(3)
        text = _MD_LINK.sub(md, text)
        return _HTML_SRC.sub(lambda m: m.group(1) + self._asset(m.group(2)) + m.group(3), text)

    def preprocess(self, nb, resources):
        for cell in nb.cells:
            if cell.cell_type == "markdown": cell.source = self.relink(cell.source)
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                if "text/markdown" in data: data["text/markdown"] = self.relink(data["text/markdown"])
        return nb, resources


# ---------------------------------------------------------------- pages and navigation

def title_of(path:Path)->str:
    "A notebook's (or markdown file's) title: its first `# ` heading, else its file name"
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, as_version=4)
        texts = [c.source for c in nb.cells if c.cell_type == "markdown"]
    else: texts = [path.read_text()]
    for t in texts:
        for line in t.splitlines():
            if line.startswith("# "): return line[2:].strip()
    return path.stem


def short(title:str)->str:
    "A navigation title: an analysis notebook's title up to its colon (`02 · Table 1: accuracy ...` -> `02 · Table 1`)"
    return title.split(":", 1)[0].strip()


def site_pages(root:Path, executed:Path|None, library:list[Path]|None=None, analysis:list[Path]|None=None,
               design:Path|None=None)->list[Page]:
    "Every page of the site, in navigation order"
    nbs = root / "nbs"
    if library is None:                                     # top-level notebooks and the lane folders, in data-flow order
        library = sorted([*nbs.glob("[0-9]*.ipynb"), *nbs.glob("*/[0-9]*.ipynb")], key=lambda p: (p.stem, str(p)))
        library = [p for p in library if p.parent.name != "analysis"]
    analysis = sorted((nbs / "analysis").glob("[0-9]*.ipynb")) if analysis is None else analysis
    design = root / "docs" / "design.md" if design is None else design
    pages = []
    if (nbs / "index.ipynb").exists(): pages.append(Page(nbs / "index.ipynb", "index.html", "Home", "home"))
    if design.exists(): pages.append(Page(design, "design.html", "Design", "design"))
    lane = lambda p: "" if p.parent == nbs else f"{p.parent.name} · "
    pages += [Page(p, f"{p.stem}.html", f"{lane(p)}{p.stem.split('_', 1)[0]} · {title_of(p)}", "library") for p in library]
    for p in analysis:
        run = executed / p.name if executed else None
        if run and run.exists():
            note = ("" if run.stat().st_mtime >= p.stat().st_mtime else
                    f"This page shows the last `make figures` run ({run.relative_to(root) if run.is_relative_to(root) else run}), "
                    f"which is older than the notebook: run `make figures` again to refresh it.")
            pages.append(Page(p, f"analysis/{p.stem}.html", short(title_of(p)), "analysis", run, note))
        else:
            pages.append(Page(p, f"analysis/{p.stem}.html", short(title_of(p)), "analysis", None,
                              "Not executed yet: this page shows the notebook without its outputs. "
                              "Run `make figures` (or `make docs`, which runs it when needed) to see its tables and figures."))
    return pages


_CSS = """
<style>
body { margin-left: 270px !important; }
nav.site { position: fixed; top: 0; left: 0; bottom: 0; width: 250px; overflow-y: auto; padding: 14px 10px 20px 14px;
  background: #f6f7f9; border-right: 1px solid #dde1e6; font: 13px/1.35 system-ui, -apple-system, "Segoe UI", sans-serif;
  box-sizing: border-box; z-index: 10; }
nav.site a { color: #1f4e8c; text-decoration: none; display: block; padding: 2px 4px; border-radius: 3px; }
nav.site a:hover { background: #e4e9f0; }
nav.site a.here { background: #dce6f5; font-weight: 600; }
nav.site .brand { font-size: 16px; font-weight: 700; margin-bottom: 6px; }
nav.site h4 { margin: 12px 0 4px 0; font-size: 11px; text-transform: uppercase; letter-spacing: .06em; color: #5b6470; }
.site-note { margin: 12px 20px 0 20px; padding: 8px 12px; background: #fff7e0; border: 1px solid #f0d48a; border-radius: 4px;
  font: 14px/1.4 system-ui, sans-serif; }
.celltag_exported .jp-InputArea-editor { border-left: 3px solid #7aa6da !important; }
.celltag_injected-parameters .jp-InputArea-editor { border-left: 3px solid #c9a227 !important; }
main.design { max-width: 900px; padding: 10px 30px 40px 30px; font: 15px/1.55 system-ui, -apple-system, "Segoe UI", sans-serif; }
main.design table { border-collapse: collapse; margin: 8px 0; }
main.design th, main.design td { border: 1px solid #ccd; padding: 3px 8px; text-align: left; vertical-align: top; }
main.design code { background: #f1f2f4; padding: 0 3px; border-radius: 3px; }
main.design pre { background: #f6f7f9; padding: 8px 12px; overflow-x: auto; }
</style>
"""


def navigation(pages:list[Page], here:Page)->str:
    "The shared navigation, with links relative to `here`"
    base = Path(here.out).parent
    def a(p):
        href = Path(os.path.relpath(p.out, base)).as_posix()
        cls = ' class="here"' if p is here else ""
        return f'<a href="{html.escape(href)}"{cls}>{html.escape(p.title)}</a>'
    parts = ['<nav class="site">', '<div class="brand">medsafe_nb</div>']
    parts += [a(p) for p in pages if p.section in ("home", "design")]
    for section, head in (("analysis", "Analysis (make figures)"), ("library", "Library notebooks")):
        items = [a(p) for p in pages if p.section == section]
        if items: parts += [f"<h4>{head}</h4>", *items]
    return "\n".join(parts + ["</nav>"])


def _decorate(body:str, pages:list[Page], page:Page)->str:
    "Put the shared CSS, the navigation and the page's note into a rendered page"
    note = _md_inline(page.note)
    body = body.replace("</head>", _CSS + "</head>", 1)
    extra = navigation(pages, page) + (f'\n<div class="site-note">{note}</div>' if note else "")
    return re.sub(r"(<body\b[^>]*>)", lambda m: m.group(1) + "\n" + extra, body, count=1)


def _md_inline(text:str)->str: return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


# ---------------------------------------------------------------- markdown pages (docs/design.md)

def slug(text:str)->str:
    "GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens"
    text = re.sub(r"<[^>]+>", "", html.unescape(text)).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def markdown_page(md_text:str, title:str)->str:
    "A markdown file as one HTML page, headings carrying GitHub-style anchors"
    import mistune
    class Renderer(mistune.HTMLRenderer):
        def heading(self, text, level, **attrs): return f'<h{level} id="{slug(text)}">{text}</h{level}>\n'
    md = mistune.create_markdown(renderer=Renderer(escape=False), plugins=["table"])
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title></head>\n'
            f'<body>\n<main class="design">\n{md(md_text)}\n</main>\n</body></html>\n')


# ---------------------------------------------------------------- rendering

# The lab template loads require.js, MathJax and mermaid from a CDN; no notebook here needs them (no widgets, no math,
# no diagrams), and a site that fetches nothing opens offline, from file://, without a failed request.
OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def exporter()->HTMLExporter:
    "nbconvert's HTML exporter (lab template, nothing loaded from the network) without prompts, applying remove tags"
    from jinja2 import DictLoader
    ex = HTMLExporter(template_name="lab", exclude_input_prompt=True, exclude_output_prompt=True,
                      extra_loaders=[DictLoader({"medsafe_offline.html.j2": OFFLINE_TEMPLATE})], template_file="medsafe_offline.html.j2")
    ex.register_preprocessor(TagRemovePreprocessor(remove_cell_tags={"remove_cell"}, remove_input_tags={"remove_input"},
                                                   remove_all_outputs_tags={"remove_output"}), enabled=True)
    return ex


def render_page(page:Page, pages:list[Page], site:Path, root:Path, ex:HTMLExporter|None=None)->list[str]:
    "Write one page into `site`; return the image or link targets that could not be found"
    dest = site / page.out
    dest.parent.mkdir(parents=True, exist_ok=True)
    by_src = {p.src.resolve(): p.out for p in pages}
    links = SiteLinks(page.src.parent.resolve(), root.resolve(), site.resolve(), dest.parent.resolve(), by_src)
    if page.src.suffix == ".md":
        body = markdown_page(links.relink(page.src.read_text()), title_of(page.src))
    else:
        nb = nbformat.read(page.read_from or page.src, as_version=4)
        nb.metadata["title"] = title_of(page.src)
        nb, _ = NbdevDirectives().preprocess(nb, {})
        nb, _ = links.preprocess(nb, {})
        body, _ = (ex or exporter()).from_notebook_node(nb)
    dest.write_text(_decorate(body, pages, page))
    return links.missing


def render_site(pages:list[Page], site:str|Path, root:str|Path=ROOT, log=print)->list[Path]:
    "Render every page into `site`; return the files written"
    site, root, ex = Path(site), Path(root), exporter()
    site.mkdir(parents=True, exist_ok=True)
    written = []
    for page in pages:
        missing = render_page(page, pages, site, root, ex)
        if log:
            origin = page.read_from or page.src
            log(f"  {page.out:<40} <- {origin.relative_to(root) if origin.is_relative_to(root) else origin}"
                + (f"   (not found: {', '.join(missing)})" if missing else ""))
        written.append(site / page.out)
    return written


def executed_dir(params:str)->Path:
    "Where `make figures P=params` writes its executed notebooks: <figures_dir>/executed"
    from medsafe_nb.run.params import load_params, params_path, resolve_path
    return resolve_path(load_params(params_path(params)).figures_dir) / "executed"


def main(argv=None)->int:
    ap = argparse.ArgumentParser(description="Render the notebooks and docs/design.md into a static site (make docs).")
    ap.add_argument("--out", default=str(ROOT / "_docs"), help="the site's folder (default: _docs)")
    ap.add_argument("--params", default="demo", help="whose executed analysis notebooks to show: demo, smoke, paper or a params file")
    ap.add_argument("--executed", help="folder of executed analysis notebooks (default: <figures_dir of --params>/executed)")
    ap.add_argument("--run-figures", action="store_true", help="run `medsafe figures --params PARAMS` first when executed copies are missing")
    a = ap.parse_args(argv)
    executed = Path(a.executed) if a.executed else executed_dir(a.params)
    sources = sorted((ROOT / "nbs" / "analysis").glob("[0-9]*.ipynb"))
    missing = [p.name for p in sources if not (executed / p.name).exists()]
    if missing and a.run_figures:
        print(f"docs: no executed copies of {', '.join(missing)} in {executed}: running the analysis notebooks first "
              f"(make figures P={a.params})", flush=True)
        medsafe = Path(sys.executable).parent / "medsafe"
        rc = subprocess.run([str(medsafe) if medsafe.exists() else "medsafe", "figures", "--params", a.params]).returncode
        if rc: sys.exit(f"docs: `medsafe figures --params {a.params}` failed (exit {rc}, see above); no pages written")
    elif missing:
        print(f"docs: {len(missing)} analysis notebook(s) not executed yet ({', '.join(missing)}): their pages show no "
              f"outputs. Run `make figures P={a.params}` first.", file=sys.stderr)
    out = Path(a.out)
    pages = site_pages(ROOT, executed)
    print(f"docs: {len(pages)} pages into {out} (analysis outputs from {executed})", flush=True)
    render_site(pages, out, ROOT)
    print(f"docs: open {out / 'index.html'}")
    return 0


if __name__ == "__main__": sys.exit(main())
