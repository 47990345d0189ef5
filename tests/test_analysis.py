"""The analysis notebooks (nbs/analysis) end to end under papermill on the smoke params: one `parameters` cell each,
every output written, byte-identical tables on a rerun, and Table 1 equal to what `medsafe metrics` computes."""
import inspect, json, subprocess, sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import yaml

from medsafe_nb import figures
from medsafe_nb.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ANALYSIS = ROOT / "nbs" / "analysis"
PARAMS = ANALYSIS / "params"
TABLES = ["table1_main", "breakdowns", "breakdowns_provenance", "breakdowns_content", "breakdowns_split",
          "content_provenance", "summary", "metrics/table1", "metrics/breakdowns", "metrics/mcnemar", "metrics/logprob"]
FIGURES = ["heatmap_content_provenance", "breakdowns_type1_asr", "accuracy_by_condition", "asr_vs_clean",
           "type1_vs_type2_asr", "effort_pairs_type1_asr"]


def _tables(figures_dir:Path)->dict:
    "{relative path: bytes} of every csv and md under figures_dir (executed notebooks aside)"
    return {str(p.relative_to(figures_dir)): p.read_bytes() for p in sorted(figures_dir.rglob("*"))
            if p.suffix in (".csv", ".md") and "executed" not in p.parts}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    "The smoke params with runs and figures in a temporary folder, run twice through the runner"
    tmp = tmp_path_factory.mktemp("analysis")
    prm = yaml.safe_load((PARAMS / "smoke.yaml").read_text())
    prm.update(runs_dir=str(tmp / "runs"), ledger=str(tmp / "runs" / "ledger.sqlite"), figures_dir=str(tmp / "figures"))
    path = tmp / "smoke.yaml"
    path.write_text(yaml.safe_dump(prm, sort_keys=False))
    executed = figures.execute_analysis(path, log=None)
    first = _tables(tmp / "figures")
    again = figures.execute_analysis(path, log=None)
    return dict(params=figures.load_params(path), figures=tmp / "figures", executed=executed, again=again,
                first=first, second=_tables(tmp / "figures"), tmp=tmp)


def test_committed_params_load():
    "demo, smoke and paper validate; smoke stays out of the committed figures/; paper's labels are the paper's rows"
    demo, smoke, paper = (figures.load_params(PARAMS / f"{n}.yaml") for n in ("demo", "smoke", "paper"))
    assert [m["spec"] for m in demo["models"]] == ["minilm", "tiny"] == [m["spec"] for m in smoke["models"]]
    assert (demo["data"], demo["n_boot"], demo["seed"], demo["figures_dir"]) == ("sample", 1000, 0, "figures")
    assert (demo["runs_dir"], demo["ledger"]) == ("data/runs/demo", "data/runs/demo/ledger.sqlite")
    assert smoke["limit"] and smoke["limit"] <= 10 and smoke["n_boot"] <= 100
    assert not Path(smoke["figures_dir"]).resolve().is_relative_to((ROOT / "figures").resolve())
    from medsafe_nb.plots import paper_reference
    ref = paper_reference()["table1"]
    assert [m["label"] for m in paper["models"]] == [l for l in ref.label if l != "Mean"]
    assert paper["data"] == "hf" and paper["only_clean_correct"] is False and paper["conditions"] == "clean,type1,type2"
    assert all(m["spec"].startswith("hf:") for m in paper["models"][-3:])


def test_demo_defaults_agree_with_medsafe_metrics():
    "`medsafe metrics` with its defaults reproduces the demo's table: same n_boot and seed"
    from medsafe_nb import cli
    sig = inspect.signature(cli.metrics).parameters
    demo = figures.load_params(PARAMS / "demo.yaml")
    assert (demo["n_boot"], demo["seed"]) == (sig["n_boot"].default.default, sig["seed"].default.default)
    assert (figures.PARAMS["n_boot"][0], figures.PARAMS["seed"][0]) == (demo["n_boot"], demo["seed"])


def test_params_refuse_secrets(tmp_path):
    "a key-shaped value or a *key*/*token* field is refused, naming file, line and field but never the value"
    secret = "sk-" + "Ab3" * 12
    for text, field in ((f"runs_dir: r\nmodels:\n  - spec: openai:gpt-5.4\n    base_url: {secret}\n", "models[0].base_url"),
                        ("runs_dir: r\nopenai_api_key: x\nmodels: [minilm]\n", "openai_api_key"),
                        ("runs_dir: r\nmodels:\n  - {spec: minilm, hf_token: x}\n", "models[0].hf_token")):
        p = tmp_path / "p.yaml"
        p.write_text(text)
        with pytest.raises(ConfigError) as e: figures.load_params(p)
        assert f"field '{field}'" in str(e.value) and str(p) in str(e.value) and secret not in str(e.value)


def test_each_notebook_has_one_parameters_cell(smoke):
    "title first, then the one cell tagged `parameters`; the same in the executed notebooks"
    names = sorted(p.stem for p in ANALYSIS.glob("*.ipynb"))
    assert names == list(figures.ANALYSIS_NOTEBOOKS)
    for name in names:
        nb = nbformat.read(ANALYSIS / f"{name}.ipynb", as_version=4)
        tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
        assert tagged == [1], name
        assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), name
        assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{name}: committed with outputs"
        assert set(figures.notebook_parameters(ANALYSIS / f"{name}.ipynb")) <= set(figures.PARAMS) | {"params_file"}
    for path in smoke["executed"]:
        nb = nbformat.read(path, as_version=4)
        assert sum("parameters" in c.metadata.get("tags", []) for c in nb.cells) == 1, path
        assert [p.name for p in smoke["executed"]] == [f"{n}.ipynb" for n in names]


def test_outputs_exist(smoke):
    "every table (csv, md, tex) and figure (png, pdf) the notebooks promise"
    out = smoke["figures"]
    missing = [f"{t}.{x}" for t in TABLES for x in ("csv", "md", "tex") if not (out / f"{t}.{x}").is_file()]
    missing += [f"{f}.{x}" for f in FIGURES for x in ("png", "pdf") if not (out / f"{f}.{x}").stat().st_size > 1000]
    assert not missing
    for run in figures.run_dirs(smoke["params"]["models"], smoke["params"]["runs_dir"]):
        assert (run / "predictions.parquet").is_file() and json.loads((run / "run.json").read_text())["n_items"] == 8
    t1 = pd.read_csv(out / "table1_main.csv")
    assert set(t1.source) == {"this run", "paper"}
    assert {figures.TINY_LABEL, figures.MINILM_LABEL, "Mean"} <= set(t1[t1.source == "this run"].model)
    assert "this run" in (out / "table1_main.md").read_text() and "paper" in (out / "breakdowns_content.md").read_text()
    assert "Not LLM results" in (out / "summary.md").read_text()


def test_tables_identical_on_rerun(smoke):
    "running the notebooks again gives byte-identical csv and md tables"
    assert len(smoke["first"]) >= 2 * len(TABLES)
    changed = [k for k in smoke["first"] if smoke["first"][k] != smoke["second"].get(k)]
    assert not changed and set(smoke["first"]) == set(smoke["second"])


def test_medsafe_metrics_reproduces_table1(smoke, tmp_path):
    "`medsafe metrics RUN… --n-boot N --seed S` gives the run rows of figures/table1_main.csv"
    prm = smoke["params"]
    runs = [str(d) for d in figures.run_dirs(prm["models"], prm["runs_dir"])]
    exe = Path(sys.executable).with_name("medsafe")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-c", "from medsafe_nb.cli import main; main()"]
    r = subprocess.run([*cmd, "metrics", *runs, "--out", str(tmp_path), "--n-boot", str(prm["n_boot"]),
                        "--seed", str(prm["seed"])], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    cli = pd.read_csv(tmp_path / "table1.csv")
    ours = pd.read_csv(smoke["figures"] / "table1_main.csv")
    ours = ours[ours.source == "this run"].drop(columns="source").reset_index(drop=True)
    pd.testing.assert_frame_equal(ours[cli.columns], cli, check_dtype=False)
    assert (tmp_path / "table1.csv").read_bytes() == (smoke["figures"] / "metrics" / "table1.csv").read_bytes()


def test_runner_names_the_failing_notebook(smoke, tmp_path):
    "a failing notebook stops `python -m medsafe_nb.figures` with its name and cell; a bad params file with its field"
    prm = yaml.safe_load((PARAMS / "smoke.yaml").read_text())
    prm.update(runs_dir=str(tmp_path / "missing-runs"), figures_dir=str(tmp_path / "figures"))
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(prm))
    r = subprocess.run([sys.executable, "-m", "medsafe_nb.figures", "--params", str(path), "--only", "02"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "02_table1_main.ipynb: cell " in r.stderr and "predictions.parquet" in r.stderr
    path.write_text("runs_dir: r\nmodels:\n  - {spec: minilm, scoring: best}\n")
    r = subprocess.run([sys.executable, "-m", "medsafe_nb.figures", "--params", str(path)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and f"{path}:3: field 'models[0].scoring'" in r.stderr


def test_accelerate_launch_matches_in_process(smoke):
    "the accelerate path (a `medsafe run` subprocess under `accelerate launch`) writes the same answers as in-process"
    prm, tmp = smoke["params"], smoke["tmp"]
    entry = next(m for m in prm["models"] if m["spec"] == "tiny")
    d = figures.run_model(entry, tmp / "accel", limit=2, launch="accelerate", num_processes=1, tiny_dir=prm["tiny_dir"], log=None)
    ours = figures.read_runs([d])
    ref = figures.read_runs([Path(prm["runs_dir"]) / entry["run_name"]])
    ref = ref[ref.item_id.isin(ours.item_id)].reset_index(drop=True)
    cols = ["model", "item_id", "condition", "target", "pred", "status"]
    pd.testing.assert_frame_equal(ours[cols], ref[cols])
    assert json.loads((d / "run.json").read_text())["model_spec"].endswith("tiny-llama")
