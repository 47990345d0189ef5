"""The analysis notebooks (nbs/analysis) end to end under papermill on the smoke params: one typed `params_file`
parameter each, every output written, byte-identical tables on a rerun, and Table 1 equal to what `medsafe metrics`
computes."""
import contextlib, io, json, shutil, subprocess, sys
from dataclasses import replace
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import yaml

from medsafe_nb.figures import tables as analysis; from medsafe_nb.figures import notebooks as figures; from medsafe_nb.run import launch; from medsafe_nb.run import params
from medsafe_nb.core import ConfigError

pytestmark = pytest.mark.integration   # real components end to end: `make test-integration`

ROOT = Path(__file__).resolve().parents[1]
ANALYSIS = ROOT / "nbs" / "analysis"
PARAMS = ANALYSIS / "params"
TABLES = ["table1_main", "breakdowns", "breakdowns_provenance", "breakdowns_content", "breakdowns_split",
          "content_provenance", "position_control", "summary", "metrics/table1", "metrics/breakdowns", "metrics/mcnemar",
          "metrics/logprob"]
FIGURES = ["heatmap_content_provenance", "breakdowns_type1_asr", "accuracy_by_condition", "asr_vs_clean",
           "type1_vs_type2_asr", "effort_pairs_type1_asr"]
RESULTS = ["01_generate", "02_table1_main", "03_breakdowns", "04_figures", "05_summary"]  # the notebooks of this run's numbers


def _tables(figures_dir:Path)->dict:
    "{relative path: bytes} of every csv and md under figures_dir (executed notebooks aside)"
    return {str(p.relative_to(figures_dir)): p.read_bytes() for p in sorted(figures_dir.rglob("*"))
            if p.suffix in (".csv", ".md") and "executed" not in p.parts}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    "The smoke params with runs and figures in a temporary folder: every notebook, then the result notebooks again"
    tmp = tmp_path_factory.mktemp("analysis")
    prm = yaml.safe_load((PARAMS / "smoke.yaml").read_text())
    prm.update(runs_dir=str(tmp / "runs"), ledger=str(tmp / "runs" / "ledger.sqlite"), figures_dir=str(tmp / "figures"))
    path = tmp / "smoke.yaml"
    path.write_text(yaml.safe_dump(prm, sort_keys=False))
    executed = figures.execute_analysis(path, log=None, stream=False)
    first = _tables(tmp / "figures")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):   # the rerun streams, as `make figures` does
        again = figures.execute_analysis(path, RESULTS, log=print)
    return dict(params=params.load_params(path), figures=tmp / "figures", executed=executed, again=again,
                first=first, second=_tables(tmp / "figures"), tmp=tmp, out=out.getvalue(), err=err.getvalue())


def test_committed_params_load():
    "demo, smoke and paper validate; smoke stays out of the committed figures/; paper's labels are the paper's rows"
    demo, smoke, paper = (params.load_params(PARAMS / f"{n}.yaml") for n in ("demo", "smoke", "paper"))
    assert [m.model for m in demo.models] == ["smollm2", "smollm2", "minilm", "tiny", "shortcut:longest", "shortcut:authority", "shortcut:overlap"]
    assert [m.label for m in demo.models][4:] == [f"shortcut:{n} (control)" for n in ("longest", "authority", "overlap")]
    assert all(m.config.scoring == "generate" for m in demo.models[4:])
    assert [m.config.scoring for m in demo.models[:2]] == ["options", "logprob"]   # the real model, scored two ways
    assert all("type1_true" in m.config.conditions and "type1_placebo" in m.config.conditions for m in demo.models)
    assert demo.run.conditions == ("clean", "type1", "type2", "type2_shuffled", "type1_true", "type1_placebo")
    assert (demo.run.data, demo.n_boot, demo.run.seed, demo.figures_dir) == ("sample", 1000, 0, "figures")
    assert (demo.runs_dir, demo.run.ledger) == ("data/runs/demo", "data/runs/demo/ledger.sqlite")
    assert smoke.run.limit and smoke.run.limit <= 10 and smoke.n_boot <= 100
    assert not Path(smoke.figures_dir).resolve().is_relative_to((ROOT / "figures").resolve())
    from medsafe_nb.figures.plots import paper_reference
    ref = paper_reference()["table1"]
    assert [m.label for m in paper.models] == [l for l in ref.label if l != "Mean"]
    assert paper.run.data == "hf" and paper.run.only_clean_correct is False and paper.run.conditions == ("clean", "type1", "type2")
    assert all(m.model.startswith("hf:") for m in paper.models[-3:])


def test_demo_defaults_agree_with_medsafe_metrics():
    "`medsafe metrics` with its defaults reproduces the demo's table: same n_boot and seed as write_metrics' defaults"
    import inspect
    from medsafe_nb.metrics.io import write_metrics
    sig = inspect.signature(write_metrics).parameters
    demo = params.load_params(PARAMS / "demo.yaml")
    assert (demo.n_boot, demo.run.seed) == (sig["n_boot"].default, sig["seed"].default)


def test_params_refuse_secrets(tmp_path):
    "a key-shaped value or a *key*/*token* field is refused, naming file, line and field but never the value"
    secret = "sk-" + "Ab3" * 12
    for text, field in ((f"runs_dir: r\nmodels:\n  - model: openai:gpt-5.4\n    base_url: {secret}\n", "models[0].base_url"),
                        ("runs_dir: r\nopenai_api_key: x\nmodels: [minilm]\n", "openai_api_key"),
                        ("runs_dir: r\nmodels:\n  - {model: minilm, hf_token: x}\n", "models[0].hf_token")):
        p = tmp_path / "p.yaml"
        p.write_text(text)
        with pytest.raises(ConfigError) as e: params.load_params(p)
        assert f"field '{field}'" in str(e.value) and str(p) in str(e.value) and secret not in str(e.value)


def test_each_notebook_has_one_parameters_cell(smoke):
    "title first, then the one cell tagged `parameters`: params_file first, then only values `make figures` passes; papermill reads it too"
    from papermill.inspection import inspect_notebook
    names = sorted(p.stem for p in ANALYSIS.glob("*.ipynb"))
    assert names == [p.stem for p in figures.analysis_notebooks(ANALYSIS)] and names[:5] == RESULTS
    for name in names:
        nb = nbformat.read(ANALYSIS / f"{name}.ipynb", as_version=4)
        tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
        assert tagged == [1], name
        assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), name
        assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{name}: committed with outputs"
        declared, found = figures.notebook_parameters(ANALYSIS / f"{name}.ipynb"), inspect_notebook(str(ANALYSIS / f"{name}.ipynb"))
        assert list(found) == declared, name   # papermill understands every parameter: it never warns of an unknown one
        offered = figures.notebook_values(smoke["params"], "p.yaml")
        if name in RESULTS:
            assert declared[0] == "params_file" and found["params_file"]["inferred_type_name"] == "str", name
            assert set(declared[1:]) <= set(offered), f"{name}: {set(declared[1:]) - set(offered)} would keep its default under make figures"
            assert all(found[k]["default"] == "None" for k in declared[1:]), name   # None: the params file's value
    for path in smoke["executed"]:
        nb = nbformat.read(path, as_version=4)
        assert sum("parameters" in c.metadata.get("tags", []) for c in nb.cells) == 1, path
    assert [p.stem for p in smoke["executed"]] == names


def test_outputs_exist(smoke):
    "every table (csv, md, tex) and figure (png, pdf) the notebooks promise"
    out, prm = smoke["figures"], smoke["params"]
    missing = [f"{t}.{x}" for t in TABLES for x in ("csv", "md", "tex") if not (out / f"{t}.{x}").is_file()]
    missing += [f"{f}.{x}" for f in FIGURES for x in ("png", "pdf") if not (out / f"{f}.{x}").stat().st_size > 1000]
    assert not missing
    for run in launch.run_dirs(prm):
        rec = json.loads((run / "run.json").read_text())
        assert (run / "predictions.parquet").is_file() and rec["n_items"] == 8
        assert rec["conditions"] == ["clean", "type1", "type2", "type2_shuffled"]
    t1 = pd.read_csv(out / "table1_main.csv")
    assert set(t1.source) == {"this run", "paper"}
    assert {m.label for m in prm.models} == set(t1[t1.source == "this run"].model)   # controls only: listed, no Mean row of this run
    assert "this run" in (out / "table1_main.md").read_text() and "paper" in (out / "breakdowns_content.md").read_text()
    assert "Not LLM results" in (out / "summary.md").read_text()
    pc = pd.read_csv(out / "position_control.csv")
    assert list(pc.model) == [m.label for m in prm.models] and pc.type2_shuffled_acc.notna().all()   # the Mean averages language models only
    from medsafe_nb.figures.tables import NO_MEAN_NOTE
    assert NO_MEAN_NOTE in (out / "summary.md").read_text()


def test_tables_identical_on_rerun(smoke):
    "running the notebooks again gives byte-identical csv and md tables"
    assert len(smoke["first"]) >= 2 * len(TABLES)
    changed = [k for k in smoke["first"] if smoke["first"][k] != smoke["second"].get(k)]
    assert not changed and set(smoke["first"]) == set(smoke["second"])


def test_medsafe_metrics_reproduces_table1(smoke, tmp_path):
    "`medsafe metrics RUN… --n-boot N --seed S` gives the run rows of figures/table1_main.csv and its metrics/table1.csv"
    prm = smoke["params"]
    runs = [str(d) for d in launch.run_dirs(prm)]
    exe = Path(sys.executable).with_name("medsafe")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-c", "from medsafe_nb.cli import main; main()"]
    r = subprocess.run([*cmd, "metrics", *runs, "--out", str(tmp_path), "--n-boot", str(prm.n_boot),
                        "--seed", str(prm.run.seed)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    cli = pd.read_csv(tmp_path / "table1.csv")
    ours = pd.read_csv(smoke["figures"] / "table1_main.csv")
    ours = ours[ours.source == "this run"].drop(columns="source").reset_index(drop=True)
    pd.testing.assert_frame_equal(ours[cli.columns], cli, check_dtype=False)
    assert (tmp_path / "table1.csv").read_bytes() == (smoke["figures"] / "metrics" / "table1.csv").read_bytes()


def test_runner_names_the_failing_notebook(smoke, tmp_path):
    "a failing notebook stops the runner with its name and cell; a bad params file with its file, line and field"
    prm = yaml.safe_load((PARAMS / "smoke.yaml").read_text())
    prm.update(runs_dir=str(tmp_path / "missing-runs"), figures_dir=str(tmp_path / "figures"))
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(prm))
    with pytest.raises(launch.AnalysisError) as e: figures.execute_analysis(path, ["02"], log=None, stream=False)
    assert "02_table1_main.ipynb: cell " in str(e.value) and "RunsMissing" in str(e.value) and "not made yet" in str(e.value)
    path.write_text("runs_dir: r\nmodels:\n  - {model: minilm, scoring: best}\n")
    with pytest.raises(ConfigError) as e: figures.execute_analysis(path, log=None)
    assert f"{path}:3: field 'models[0].scoring'" in str(e.value)


def test_notebooks_without_runs_say_so_in_one_line(tmp_path):
    "opened on a clone with no runs, every notebook that reads runs stops in one line naming them and the command, no traceback"
    prm = yaml.safe_load((PARAMS / "smoke.yaml").read_text())
    prm.update(runs_dir=str(tmp_path / "runs"), figures_dir=str(tmp_path / "figures"))
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(prm))
    names = [m.run_name for m in params.load_params(path).models]
    for nb in ("02", "03", "04", "05"):
        with pytest.raises(launch.AnalysisError) as e: figures.execute_analysis(path, [nb], log=None, stream=False)
        assert "RunsMissing" in str(e.value), str(e.value)
        executed = nbformat.read(next((tmp_path / "figures" / "executed").glob(f"{nb}_*.ipynb")), as_version=4)
        errors = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
        assert len(errors) == 1, nb
        (line,) = errors[0].traceback                                    # what the notebook shows: one line
        assert f"{len(names)} of the {len(names)} runs" in line and all(n in line for n in names), line
        assert f"medsafe figures --params {path}" in line and "01_generate" in line, line


def test_runner_streams_progress(smoke):
    "the notebooks' output reaches the terminal as they run: the ledger's progress bars, and a closing line per notebook"
    out, err = smoke["out"], smoke["err"]
    assert "[1/5] 01_generate done in " in out and "[5/5] 05_summary done in " in out and "3 model(s)" in out
    assert "minilm (non-LLM baseline) clean+type1+type2+type2_shuffled" in err and "32/32" in err  # model, conditions, done/total
    assert "IProgress" not in err


def test_accelerate_launch_matches_in_process(smoke):
    "the accelerate path (`medsafe run` under `accelerate launch`, output streamed) writes the same answers as in-process"
    prm, tmp = smoke["params"], smoke["tmp"]
    entry = next(m for m in prm.models if m.model == "tiny")
    cfg = replace(launch.run_config(prm, entry, progress=False), out=str(tmp / "accel" / entry.run_name), limit=2)
    d = launch.run_model(cfg, launch="accelerate", num_processes=1, log=None)
    ours = analysis.read_runs([d])
    ref = analysis.read_runs([Path(prm.runs_dir) / entry.run_name])
    ref = ref[ref.item_id.isin(ours.item_id)].reset_index(drop=True)
    cols = ["model", "item_id", "condition", "target", "pred", "status"]
    pd.testing.assert_frame_equal(ours[cols], ref[cols])


def test_no_secret_in_any_output(smoke):
    "Every file `make figures` writes (tables, figures' text, executed notebooks, run folders) is free of credentials"
    from medsafe_nb.core import find_secret
    roots = [smoke["figures"], Path(smoke["params"].runs_dir)]
    scanned = 0
    for root in roots:
        for p in sorted(root.rglob("*")):
            if not p.is_file() or p.suffix in (".png", ".pdf", ".parquet", ".sqlite", ".lock") or p.stat().st_size > 5_000_000: continue
            text = p.read_text(encoding="utf-8", errors="replace")
            if p.suffix == ".ipynb":                                  # figures are base64 images, not text: scan the rest
                nb = json.loads(text)
                for c in nb["cells"]:
                    for o in c.get("outputs", []): o.get("data", {}).pop("image/png", None)
                text = json.dumps(nb)
            assert find_secret(text, str(p)) is None, find_secret(text, str(p))
            scanned += 1
    assert scanned > 20


def test_figures_from_a_second_clone(tmp_path):
    "`medsafe figures` run in another checkout that shares this venv writes into that checkout, with paths relative to it"
    clone = tmp_path / "clone"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".venv*", ".git", "runs", "cache", "__pycache__", "*.sqlite*"))
    (clone / "quick.yaml").write_text("data: sample\nlimit: 4\nconditions: clean,type1,type2\nmodels:\n  - model: shortcut:longest\n"
                                      "runs_dir: data/runs/quick\nledger: data/runs/quick/ledger.sqlite\nfigures_dir: data/runs/quick/figures\nn_boot: 20\n")
    medsafe = Path(sys.executable).parent / "medsafe"          # the console script of the shared venv (its package is this checkout)
    assert medsafe.exists(), medsafe
    r = subprocess.run([str(medsafe), "figures", "--params", "quick.yaml", "--only", "01,02,05"], cwd=clone,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert (clone / "data/runs/quick/figures/table1_main.csv").is_file()
    assert not (ROOT / "data/runs/quick").exists()                                   # nothing written into this checkout
    summary = (clone / "data/runs/quick/figures/summary.md").read_text()
    assert "quick.yaml" in summary and str(tmp_path) not in summary                  # the params path as the checkout knows it
