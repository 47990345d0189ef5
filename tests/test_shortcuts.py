"The shortcut controls through the real run path: statuses per condition, agreement with the audit, determinism"
import pytest
from medsafe_nb.run.runner import run
from medsafe_nb.items.release import load_medmisbench
from medsafe_nb.items.audit import SHORTCUTS, shortcut_answer, type2_contexts

# Type 2 rows answered correctly on the repaired sample (single-answer items; a one-key pick never matches a multi gold)
TYPE2_CORRECT = {"longest": 22, "authority": 6, "overlap": 18}

@pytest.fixture(scope="module")
def items(): return load_medmisbench()

@pytest.fixture(scope="module", params=SHORTCUTS)
def shortcut_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"shortcut-{request.param}")
    return request.param, run(data="sample", model=f"shortcut:{request.param}", out=str(out), progress=False), out

def test_statuses_per_condition(shortcut_run, items):
    name, df, out = shortcut_run
    assert (out/"predictions.parquet").exists() and (out/"run.json").exists()
    assert len(df) == 3 * len(items) == 318
    by = df.groupby("condition")["status"]
    assert set(by.get_group("clean")) == {"noanswer"}                        # nothing to read without context
    assert set(by.get_group("type2")) <= {"ok", "noanswer"}
    t1 = df[df.condition == "type1"]
    if name == "longest":                                                   # one sentence shown: the longest is the target's
        assert set(t1.status) == {"ok"} and (t1.pred == t1.target).all()
    assert set(t1.status) <= {"ok", "noanswer"} and (t1[t1.status == "ok"].pred == t1[t1.status == "ok"].target).all()
    assert not (df.status == "error").any()

def test_type2_matches_audit(shortcut_run, items):
    name, df, _ = shortcut_run
    t2 = df[df.condition == "type2"].set_index("item_id")
    for it in items:
        want = shortcut_answer(name, it.question, it.options, type2_contexts(it), it.language)
        got = t2.loc[it.id, "pred"]
        assert (got if isinstance(got, str) else None) == want, (name, it.id)
    assert int(t2.correct.sum()) == TYPE2_CORRECT[name]

def test_deterministic(shortcut_run, tmp_path):
    name, df, _ = shortcut_run
    again = run(data="sample", model=f"shortcut:{name}", out=str(tmp_path/"again"), progress=False)
    cols = ["item_id", "condition", "target", "pred", "status", "correct"]
    assert again[cols].equals(df[cols])
