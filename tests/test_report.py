"""The look-at-a-run verbs on the command line: `medsafe show`, `medsafe report` and `medsafe export lm-eval`."""
import re
import pytest
from typer.testing import CliRunner
from medsafe_nb.cli import app
from medsafe_nb import report

runner = CliRunner()


def test_show(minilm_run_dir):
    preds, _ = report.read_run(minilm_run_dir)
    r = runner.invoke(app, ["show", str(minilm_run_dir), "--condition", "type1", "--limit", "2"])
    assert r.exit_code == 0, r.output
    assert r.output.count("── row ") == 2 and "of 24" not in r.output and "row 2/24" in r.output
    assert "PROMPT (ledger)" in r.output and "Context:" in r.output and "read by: json" in r.output
    r = runner.invoke(app, ["show", str(minilm_run_dir), "--flipped", "--limit", "0"])
    assert r.exit_code == 0 and r.output.count("── row ") == int(report.flipped_rows(preds).sum()) > 0
    assert all("· flipped" in line for line in r.output.splitlines() if line.startswith("── row "))
    item = preds.item_id.iloc[0]
    r = runner.invoke(app, ["show", str(minilm_run_dir), "--item", item, "--limit", "0"])
    assert r.exit_code == 0 and r.output.count("── row ") == 3
    r = runner.invoke(app, ["show", str(minilm_run_dir), "--status", "error"])
    assert r.exit_code == 0 and r.output.strip() == "no rows match"


@pytest.mark.parametrize("args,message", [(["--status", "fine"], "unknown status 'fine'"),
                                          (["--condition", "type3"], "unknown condition 'type3'"),
                                          (["--item", "nope"], "no item 'nope'")])
def test_show_bad_input(minilm_run_dir, args, message):
    r = runner.invoke(app, ["show", str(minilm_run_dir), *args])
    assert r.exit_code == 2 and message in r.output


def test_report(minilm_run_dir, tmp_path):
    out = tmp_path / "r" / "report.html"
    r = runner.invoke(app, ["report", str(minilm_run_dir), "--out", str(out), "--n-boot", "20"])
    assert r.exit_code == 0, r.output
    html = out.read_text()
    rows = report.read_report_rows(out)
    assert len(rows) == 72 and list(rows.columns) == list(report.BROWSER_COLUMNS)
    assert set(rows.item_id) == set(report.read_run(minilm_run_dir)[0].item_id)
    assert not re.search(r'(src|href)="(?!data:)', html)
    r = runner.invoke(app, ["report", str(tmp_path / "nope"), "--out", str(out)])
    assert r.exit_code == 2 and "predictions.parquet" in r.output


def test_export_lm_eval(tmp_path):
    r = runner.invoke(app, ["export", "lm-eval", "--out", str(tmp_path / "lm"), "--limit", "3"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "lm").iterdir()) == [
        "medmisbench.yaml", "medmisbench_clean.jsonl", "medmisbench_clean.yaml", "medmisbench_type1.jsonl",
        "medmisbench_type1.yaml", "medmisbench_type2.jsonl", "medmisbench_type2.yaml", "utils.py"]
    assert "lm_eval --include_path" in r.output
    r = runner.invoke(app, ["export", "lm-eval", "--out", str(tmp_path / "x"), "--data", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 2 and "missing.jsonl" in r.output
