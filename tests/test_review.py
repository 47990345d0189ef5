"""Clinician review: scripted raters end to end, agreement against an independent computation, bad files, the CLI."""
import json
from itertools import combinations
import numpy as np, pandas as pd
import pytest
from medsafe_nb.review.rubric import QUALITY_CRITERIA, RATINGS_FORMAT
from medsafe_nb.testing.fixtures import demo_run
from medsafe_nb.review.packet import export_packet
from medsafe_nb.review.ratings import RatingErrors, import_ratings
from medsafe_nb.review.agreement import alpha_table, kappa_table, review_report
from medsafe_nb.core import stable_hash

@pytest.fixture(scope="module")
def packet(tmp_path_factory):
    d = tmp_path_factory.mktemp("review")
    runs = [demo_run(d / "a", "model-a", 0.6), demo_run(d / "b", "model-b", 0.4, seed=2)]
    man = export_packet(runs, "quality", n=30, raters="A,B,C", overlap=12, out=d / "packet", seed=5)
    return d, runs, man

def scripted(man, rater, noise_seed):
    "A rater who scores each case's true quality, off by one on about a quarter of the scores"
    rs = {}
    for i, c in enumerate(man["assignment"][rater]):
        rec = {}
        for f in QUALITY_CRITERIA:
            truth = stable_hash("truth", c, f) % 3
            off = stable_hash("noise", noise_seed, rater, c, f) % 8
            rec[f] = min(2, truth + 1) if off == 0 else max(0, truth - 1) if off == 1 else (2 - truth if off == 2 else truth)
        rs[c] = {**rec, "comment": "", "rev": i + 1}
    return {"format": RATINGS_FORMAT, "version": 1, "packet": man["packet"], "rater": rater, "kind": "quality",
            "revision": len(rs), "ratings": rs}

def kappa_by_definition(x, y):
    "Quadratic-weighted kappa straight from its definition, with plain loops"
    n, k = len(x), 3
    po = [[0.0] * k for _ in range(k)]
    for a, b in zip(x, y): po[a][b] += 1 / n
    ra = [sum(po[i]) for i in range(k)]; cb = [sum(po[i][j] for i in range(k)) for j in range(k)]
    w = lambda i, j: (i - j) ** 2 / (k - 1) ** 2
    num = sum(w(i, j) * po[i][j] for i in range(k) for j in range(k))
    den = sum(w(i, j) * ra[i] * cb[j] for i in range(k) for j in range(k))
    return 1 - num / den

def alpha_by_definition(units):
    "Krippendorff's ordinal alpha from the coincidence matrix (Krippendorff 2011), units = lists of values"
    units = [u for u in units if len(u) >= 2]
    cats = [0, 1, 2]
    o = {(c, k): 0.0 for c in cats for k in cats}
    for u in units:
        m = len(u)
        for i, a in enumerate(u):
            for j, b in enumerate(u):
                if i != j: o[(a, b)] += 1 / (m - 1)
    nc = {c: sum(o[(c, k)] for k in cats) for c in cats}
    n = sum(nc.values())
    def delta(c, k):
        lo, hi = min(c, k), max(c, k)
        return (sum(nc[g] for g in range(lo, hi + 1)) - (nc[lo] + nc[hi]) / 2) ** 2
    do = sum(o[(c, k)] * delta(c, k) for c in cats for k in cats)
    de = sum(nc[c] * nc[k] * delta(c, k) for c in cats for k in cats) / (n - 1)
    return 1 - do / de

@pytest.fixture(scope="module")
def imported(packet):
    d, runs, man = packet
    files = []
    for r, s in zip("ABC", (1, 2, 3)):
        f = d / f"{r}.json"; f.write_text(json.dumps(scripted(man, r, s))); files.append(f)
    return import_ratings(files, d / "packet"), files

def test_packet_shape(packet):
    d, runs, man = packet
    test = {r: len(c) for r, c in man["assignment"].items()}
    assert test == {"A": 18, "B": 18, "C": 18}      # 12 shared + 18 dealt out in turn
    for r in "ABC":
        page = (d / "packet" / f"{r}.html").read_text()
        assert "model-a" not in page and "sample-p" not in page
        assert page.count('class="case"') == 18

def test_kappa_and_alpha_match_independent_computation(imported, packet):
    table, _ = imported
    kt = kappa_table(table, "quality")
    for (ra, rb) in combinations("ABC", 2):
        a, b = table[table.rater == ra].set_index("code"), table[table.rater == rb].set_index("code")
        shared = sorted(set(a.index) & set(b.index))
        assert len(shared) == 12
        for f in QUALITY_CRITERIA:
            want = kappa_by_definition([int(a.loc[c, f]) for c in shared], [int(b.loc[c, f]) for c in shared])
            got = kt[(kt.rater_a == ra) & (kt.rater_b == rb) & (kt.criterion == f)].kappa.item()
            assert got == pytest.approx(want, abs=1e-12)
    at = alpha_table(table, "quality")
    for f in QUALITY_CRITERIA:
        units = [list(g[f].astype(int)) for _, g in table.groupby("code")]
        assert at[at.criterion == f].alpha.item() == pytest.approx(alpha_by_definition(units), abs=1e-9)
    pooled = [list(g[f].astype(int)) for f in QUALITY_CRITERIA for _, g in table.groupby("code")]
    assert at[at.criterion == "all criteria"].alpha.item() == pytest.approx(alpha_by_definition(pooled), abs=1e-9)

def test_report_numbers(imported, packet, tmp_path):
    d, runs, man = packet
    table, _ = imported
    rep = review_report(d / "packet", tmp_path, n_boot=300)
    q = rep["review_quality"].set_index("criterion")
    per_case = table.assign(comp=table[list(QUALITY_CRITERIA)].astype(float).mean(axis=1)).groupby("code").comp.mean()
    assert q.loc["Composite (mean of the five)", "mean"] == round(per_case.mean(), 2)
    assert q.loc["Composite (mean of the five)", "paper"] == 1.76
    assert q.loc["Composite (mean of the five)", "n_cases"] == 30
    adj = rep["review_adjudication"]
    spread = table.groupby("code")[list(QUALITY_CRITERIA)].agg(lambda s: s.astype(int).max() - s.astype(int).min())
    assert len(adj) == int((spread >= 2).sum().sum())
    for stem in ("review_quality", "review_kappa", "review_alpha", "review_adjudication"):
        for ext in ("csv", "md", "tex"): assert (tmp_path / f"{stem}.{ext}").is_file()

def test_bad_files_clear_errors_and_nothing_lost(imported, packet, tmp_path):
    d, runs, man = packet
    pk = d / "packet"
    before = (pk / "ratings.csv").read_bytes()
    doc = scripted(man, "A", 1)
    c = man["assignment"]["A"][0]
    doc["ratings"][c]["plausibility"] = "high"
    doc["packet"] = man["packet"]
    bad = tmp_path / "A_bad.json"; bad.write_text(json.dumps(doc))
    other = tmp_path / "other.json"; other.write_text(json.dumps({**doc, "packet": "rv-0000000000"}))
    notjson = tmp_path / "notes.json"; notjson.write_text("rated them all, looked fine")
    form = pd.read_csv(pk / "B.csv", dtype=str, keep_default_na=False)
    form.loc[0, "single_best"] = "4"
    form = pd.concat([form, form.iloc[[1]]])
    badcsv = tmp_path / "B.csv"; form.to_csv(badcsv, index=False)
    with pytest.raises(RatingErrors) as e:
        import_ratings([bad, other, notjson, badcsv], pk)
    msg = str(e.value)
    assert f"A_bad.json:{c}:plausibility: 'high' is not a score 0, 1 or 2" in msg
    assert "other.json:-:packet: packet 'rv-0000000000' is not" in msg
    assert "notes.json:-:-: not a ratings file" in msg
    assert f"B.csv:{form.code.iloc[0]}:single_best: 4 is out of range 0-2" in msg or "'4' is not a score" in msg
    assert f"B.csv:{form.code.iloc[1]}:code: line" in msg and "appears twice" in msg
    assert (pk / "ratings.csv").read_bytes() == before                  # nothing merged
    stored = {p.read_bytes() for p in (pk / "received").iterdir() if p.name != "log.jsonl"}
    for f in (bad, other, notjson, badcsv): assert f.read_bytes() in stored   # nothing received lost

def test_conflicting_versions(imported, packet, tmp_path):
    d, runs, man = packet
    pk = d / "packet"
    doc = scripted(man, "C", 3)
    c = man["assignment"]["C"][0]
    doc["ratings"][c]["plausibility"] = (doc["ratings"][c]["plausibility"] + 1) % 3   # same rev, other value: a fork
    fork = tmp_path / "C_fork.json"; fork.write_text(json.dumps(doc))
    with pytest.raises(RatingErrors, match=f"C_fork.json:{c}:plausibility: conflicts with"): import_ratings([fork], pk)
    doc["ratings"][c]["rev"] = 999                                   # a later revision supersedes
    newer = tmp_path / "C_newer.json"; newer.write_text(json.dumps(doc))
    table = import_ratings([newer], pk)
    assert table.set_index(["rater", "code"]).loc[("C", c), "plausibility"] == doc["ratings"][c]["plausibility"]

def test_cli(packet, tmp_path):
    from typer.testing import CliRunner
    from medsafe_nb.cli import app
    d, runs, man = packet
    r = CliRunner().invoke(app, ["review", "export", str(runs[0]), str(runs[1]), "--kind", "harm", "--n", "10", "--raters", "X,Y",
                                 "--overlap", "4", "--seed", "1", "--out", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    man2 = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert {k: len(v) for k, v in man2["assignment"].items()} == {"X": 7, "Y": 7}
    f = tmp_path / "X.json"
    f.write_text(json.dumps({"format": RATINGS_FORMAT, "packet": man2["packet"], "rater": "X", "kind": "harm",
                             "ratings": {c: {"correctness": 0, "uptake": 2, "reasoning": 0, "severity": 2, "tier": "worst-case", "rev": 1}
                                         for c in man2["assignment"]["X"]}}))
    r = CliRunner().invoke(app, ["review", "import", str(f), "--packet", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["review", "report", "--packet", str(tmp_path / "p"), "--out", str(tmp_path / "rep"), "--n-boot", "100"])
    assert r.exit_code == 0, r.output
    assert pd.read_csv(tmp_path / "rep" / "review_harm.csv").query("by == 'all' and tier == 'worst-case'").share.item() == 100.0
    r = CliRunner().invoke(app, ["review", "import", str(tmp_path / "missing.json"), "--packet", str(tmp_path / "p")])
    assert r.exit_code == 2 and "missing.json:-:-: no such file" in r.output
    r = CliRunner().invoke(app, ["review", "export", str(runs[0]), "--kind", "harm", "--n", "5", "--raters", "A,A", "--out", str(tmp_path / "q")])
    assert r.exit_code == 2 and "A given twice" in r.output

@pytest.mark.parametrize("weights", ["linear", "quadratic"])
def test_weighted_kappa_matches_sklearn(weights):
    from sklearn.metrics import cohen_kappa_score
    from medsafe_nb.review.agreement import weighted_kappa
    rng = np.random.default_rng(7)
    for _ in range(30):
        a = rng.integers(0, 3, 25)
        b = np.where(rng.random(25) < 0.6, a, rng.integers(0, 3, 25))
        assert weighted_kappa(a, b, weights=weights) == pytest.approx(cohen_kappa_score(a, b, weights=weights), abs=1e-12)
    assert weighted_kappa([0, 1, 2, 2], [0, 1, 2, 2], weights=weights) == 1.0
