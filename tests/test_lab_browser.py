"""`make lab` as a researcher uses it: JupyterLab in headless Chromium (playwright), an analysis notebook tweaked and saved.

`make lab` starts JupyterLab on a free local port, on a temporary checkout: this checkout's settings.ini, package and
data, `nbs/analysis/02_table1_main.ipynb` as committed, and the demo's params cut down to its language model (SmolLM2,
letter scoring, 8 items, three conditions) so that the test makes its run in seconds. In the browser: open the notebook,
Run > Run All Cells, and Table 1 shows the SmolLM2 row with the values and intervals `medsafe metrics` computes, and no
cell has an error output; change `n_boot` in the parameters cell, run all again, and the intervals are those of the new
n_boot; save, and the file on disk is clean as `make check` wants it (nbdev_clean changes nothing, no outputs) and
differs from the committed notebook in that one line only. Every process the test started is gone at the end.
`make browser` installs what this needs; without it the test skips and says why.
"""
import json, os, secrets, shutil, signal, socket, subprocess, sys, time, urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import browser_missing

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "nbs/analysis/02_table1_main.ipynb"
N_ITEMS, NEW_N_BOOT = 8, 200
pytestmark = [pytest.mark.integration, pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or "")]


def _free_port()->int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


@pytest.fixture(scope="module")
def project(tmp_path_factory, smollm2_checkpoint):
    "A temporary checkout holding the notebook as committed and the run of the demo's language model that it reads"
    from medsafe_nb.run import launch, params
    proj = tmp_path_factory.mktemp("lab") / "checkout"
    (proj / "nbs" / "analysis" / "params").mkdir(parents=True)
    (proj / "data").mkdir()
    shutil.copy(ROOT / "settings.ini", proj / "settings.ini")
    (proj / "medsafe_nb").symlink_to(ROOT / "medsafe_nb", target_is_directory=True)   # marks the checkout (`core.repo_root`)
    for d in ("sample", "reference"): (proj / "data" / d).symlink_to(ROOT / "data" / d, target_is_directory=True)
    shutil.copy(ROOT / NOTEBOOK, proj / NOTEBOOK)
    demo = yaml.safe_load((ROOT / "nbs/analysis/params/demo.yaml").read_text())
    lm = next(m for m in demo["models"] if m["model"] == "smollm2" and m.get("scoring") == "logprob")
    demo["models"] = [{**lm, "subset": N_ITEMS, "conditions": "clean,type1,type2"}]
    (proj / "nbs/analysis/params/demo.yaml").write_text(yaml.safe_dump(demo, sort_keys=False))
    here = os.getcwd()
    os.chdir(proj)                                            # the params' paths are the checkout's
    try:
        prm = params.load_params("nbs/analysis/params/demo.yaml")
        for entry in prm.models: launch.run_model(launch.run_config(prm, entry, progress=False), "in-process", log=None)
    finally: os.chdir(here)
    return dict(root=proj, label=lm["label"], runs=[proj / prm.runs_dir / e.run_name for e in prm.models], seed=prm.run.seed,
                n_boot=prm.n_boot)


def _expected(project, n_boot:int)->dict:
    "Table 1's SmolLM2 cells as `medsafe metrics` computes them at `n_boot`: {header: 'value [lo, hi]'}"
    from medsafe_nb.figures.tables import TABLE1_VALUES, with_intervals
    from medsafe_nb.metrics.io import metrics_tables, read_predictions
    import pandas as pd
    preds = pd.concat([read_predictions(d) for d in project["runs"]], ignore_index=True)
    t1 = metrics_tables(preds, n_boot=n_boot, seed=project["seed"])["table1"]
    row = with_intervals(t1[t1.model == project["label"]], TABLE1_VALUES, keep=("model", "n_items")).iloc[0]
    return {k: str(v) for k, v in row.items()}


class Lab:
    "`make lab` on the project, in its own session; `stop()` shuts it down through its API and checks no process is left"
    def __init__(self, project, tmp:Path):
        import psutil
        self.port, self.token = _free_port(), secrets.token_hex(16)
        env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_DATA_DIR": str(tmp / "data"),
               "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
               "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces")}   # nothing read from or left in the user's Jupyter folders
        args = (f"--IdentityProvider.token={self.token} --ServerApp.ip=127.0.0.1 --ServerApp.port_retries=0 "
                "--ServerApp.open_browser=False --LabApp.expose_app_in_browser=True")
        self.log = open(tmp / "lab.log", "wb")
        self.proc = subprocess.Popen(["make", "-s", "-C", str(ROOT), "-o", ".venv/.installed", "lab", f"LAB_PORT={self.port}",
                                      f"LAB_ROOT={project['root']}", f"LAB_ARGS={args}"],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 180
        while True:
            if self.proc.poll() is not None: raise AssertionError(f"make lab exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(self._req("/api/status"), timeout=5) as r:
                    if r.status == 200: break
            except OSError: pass
            if time.time() > deadline: raise AssertionError(f"JupyterLab did not answer on {self.url}: {self.log_tail()}")
            time.sleep(0.5)
        self.tree = psutil.Process(self.proc.pid)

    def _req(self, path, method="GET"):
        return urllib.request.Request(self.url + path, method=method, headers={"Authorization": f"token {self.token}"})

    def log_tail(self)->str:
        self.log.flush(); return Path(self.log.name).read_text(errors="replace")[-3000:]

    def processes(self)->list:
        "The processes `make lab` started: the server and its kernels (which run in sessions of their own)"
        import psutil
        try: return [self.tree, *self.tree.children(recursive=True)]
        except psutil.NoSuchProcess: return []

    def stop(self)->list[str]:
        "Shut the server down (its kernels with it); kill what is left; return what had to be killed"
        import psutil
        procs = self.processes()
        try: urllib.request.urlopen(self._req("/api/shutdown", "POST"), timeout=10).close()
        except OSError: pass
        _, alive = psutil.wait_procs(procs, timeout=30)
        left = [f"{p.pid} {p.name()}" for p in alive if p.is_running()]
        for p in alive:
            try: p.kill()
            except psutil.NoSuchProcess: pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()
        return left


@pytest.fixture(scope="module")
def lab(project, tmp_path_factory):
    lab = Lab(project, tmp_path_factory.mktemp("jupyter"))
    yield lab
    if lab.proc.poll() is None: lab.stop()


_CELLS_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cells = [];
  for (let i = 0; i < panel.content.model.cells.length; i++) {
    const c = panel.content.model.cells.get(i);
    cells.push({type: c.type, count: c.type === 'code' ? c.executionCount : null,
                outputs: c.type === 'code' ? c.outputs.toJSON() : []});
  }
  return {cells, kernel: panel.sessionContext.session?.kernel?.status ?? null, dirty: panel.context.model.dirty};
}"""

_TABLE1_JS = """() => {
  for (const t of document.querySelectorAll('.jp-OutputArea-output table')) {
    const head = Array.from(t.querySelectorAll('thead th')).map(th => th.textContent.trim());
    if (head.slice(0, 4).join('|') !== 'source|model|n_items|clean acc.') continue;
    return Array.from(t.querySelectorAll('tbody tr')).map(tr =>
      Object.fromEntries(Array.from(tr.querySelectorAll('td')).map((td, i) => [head[i], td.textContent.trim()])));
  }
  return null;
}"""


def _state(page)->dict: return page.evaluate(_CELLS_JS)


def _run_all(page, after:int)->dict:
    "Run > Run All Cells from the menu; wait until every code cell ran (execution count above `after`) or one failed"
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
    deadline = time.time() + 300
    while time.time() < deadline:
        st = _state(page)
        code = [c for c in st["cells"] if c["type"] == "code"]
        failed = any(o["output_type"] == "error" for c in code for o in c["outputs"])
        if failed or (all(c["count"] is not None and c["count"] > after for c in code) and st["kernel"] == "idle"): return st
        time.sleep(0.5)
    raise AssertionError(f"Run All Cells did not finish: {_state(page)}")


def _errors(st)->list:
    return [o for c in st["cells"] for o in c["outputs"] if o["output_type"] == "error" or
            (o["output_type"] == "stream" and o.get("name") == "stderr" and "Traceback" in "".join(o.get("text", "")))]


def _table1_row(page, label:str)->dict:
    rows = page.evaluate(_TABLE1_JS)
    assert rows, "no Table 1 in the notebook's outputs"
    mine = [r for r in rows if r.get("source") == "this run" and r.get("model") == label]
    assert len(mine) == 1, rows
    assert any(r.get("source") == "paper" for r in rows)           # beside the paper's rows
    return mine[0]


@pytest.fixture(scope="module")
def session(lab, project, browser):
    "The notebook opened, run, tweaked, run again and saved, as a researcher would; what each step showed"
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    console = []
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    try:
        page.goto(f"{lab.url}/lab/tree/{NOTEBOOK}?token={lab.token}")
        page.wait_for_function("() => window.jupyterapp?.shell?.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'",
                               timeout=180_000)
        first = _run_all(page, 0)
        row_first = _table1_row(page, project["label"])
        source = (project["root"] / NOTEBOOK).read_text()
        params_cell = json.loads(source)["cells"][1]
        old = "".join(params_cell["source"])
        new = old.replace("n_boot: Optional[int] = None ", f"n_boot: Optional[int] = {NEW_N_BOOT}", 1)
        assert new != old
        editor = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".cm-content")
        editor.click()
        page.keyboard.press("Control+a")
        page.keyboard.insert_text(new)
        page.keyboard.press("Escape")
        second = _run_all(page, max(c["count"] or 0 for c in first["cells"]))
        row_second = _table1_row(page, project["label"])
        page.keyboard.press("Control+s")
        page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=60_000)
        time.sleep(0.5)
        return dict(first=first, second=second, row_first=row_first, row_second=row_second, before=source,
                    saved=(project["root"] / NOTEBOOK).read_text(), old=old, new=new, console=console)
    finally: ctx.close()


def test_table1_shows_the_language_model(session, project):
    "Run All: Table 1 holds the SmolLM2 row with the numbers `medsafe metrics` computes, and no cell shows an error"
    assert not _errors(session["first"]), _errors(session["first"])
    want = _expected(project, project["n_boot"])
    assert session["row_first"]["n_items"] == str(N_ITEMS)
    for head in ("clean acc.", "Type 1 acc.", "Type 2 acc."):
        assert session["row_first"][head] == want[head], (head, session["row_first"], want)
    assert "[" in session["row_first"]["clean acc."]                  # shown with its interval


def test_changed_parameter_changes_the_table(session, project):
    "n_boot changed in the parameters cell: the intervals are those of the new n_boot, the point estimates stay"
    assert not _errors(session["second"]), _errors(session["second"])
    want = _expected(project, NEW_N_BOOT)
    shown = {h: session["row_second"][h] for h in ("clean acc.", "Type 1 acc.", "Type 2 acc.")}
    assert shown == {h: want[h] for h in shown}
    assert shown != {h: session["row_first"][h] for h in shown}
    value = lambda s: s.split(" [")[0]
    assert {h: value(v) for h, v in shown.items()} == {h: value(session["row_first"][h]) for h in shown}


def test_saved_notebook_is_clean(session, project, tmp_path):
    "the saved file: only the changed line differs from the committed notebook, no outputs, and nbdev_clean leaves it as it is"
    saved = json.loads(session["saved"])
    before = json.loads(session["before"])
    assert "".join(saved["cells"][1]["source"]) == session["new"]
    saved["cells"][1]["source"] = before["cells"][1]["source"]
    assert saved == before                                            # metadata, ids, tags: as committed
    copy = tmp_path / "checkout" / NOTEBOOK
    copy.parent.mkdir(parents=True)
    shutil.copy(project["root"] / "settings.ini", tmp_path / "checkout" / "settings.ini")
    copy.write_text(session["saved"])
    r = subprocess.run([str(Path(sys.executable).with_name("nbdev_clean")), "--fname", str(copy)], cwd=tmp_path / "checkout",
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert copy.read_text() == session["saved"]                       # what `make check` would do changes nothing


def test_no_script_error_in_jupyterlab(session):
    assert not session["console"], session["console"]


def test_lab_leaves_no_process(session, lab):
    "shutting JupyterLab down ends the server and its kernel: nothing had to be killed"
    assert len(lab.processes()) >= 2                                  # the server and the notebook's kernel were running
    assert lab.stop() == []
    assert lab.processes() == []
