"""Option scoring (`--scoring options`, lm-eval's multiple_choice) and the two control conditions through the runner,
on the tiny random-weight model: what each row records, and what is refused."""
import json, math

import pandas as pd
import pytest

from medsafe_nb.core import ConfigError

CONDITIONS = ("clean", "type1", "type2", "type1_true", "type1_placebo")


@pytest.fixture(scope="module")
def sample():
    from medsafe_nb.items.release import load_medmisbench
    return load_medmisbench("all", "sample")[:8]


@pytest.fixture(scope="module")
def option_rows(tiny_backend, sample):
    from medsafe_nb.run.predict import run_benchmark
    return run_benchmark(sample, tiny_backend, conditions=CONDITIONS, scoring="options", progress=False)


def test_rows_follow_acc_and_acc_norm(option_rows, sample):
    by_id = {it.id: it for it in sample}
    df = option_rows
    assert len(df) == len(sample) * len(CONDITIONS) and {"pred_norm", "correct_norm", "p_gold", "p_target"} <= set(df.columns)
    ok = df[df.status == "ok"]
    assert len(ok) == sum(not it.is_multi for it in sample) * len(CONDITIONS)
    assert set(df[df.status != "ok"].status) <= {"noanswer"}                     # multi-answer items: no single option
    for r in ok.itertuples():
        raw = json.loads(r.raw)
        item = by_id[r.item_id]
        assert list(raw) == list(item.keys) and all(raw[k][1] == len(item.options[k]) for k in raw)
        sums = {k: v[0] for k, v in raw.items()}
        assert r.pred == max(sums, key=sums.get)
        assert r.pred_norm == max(sums, key=lambda k: sums[k] / raw[k][1])          # lm-eval acc_norm: per character
        z = sum(math.exp(v - max(sums.values())) for v in sums.values())
        p = {k: math.exp(v - max(sums.values())) / z for k, v in sums.items()}
        assert abs(r.p_gold - sum(p[g] for g in item.gold)) < 1e-6
        assert r.correct == (r.pred == r.gold) and r.correct_norm == (r.pred_norm == r.gold)
        assert r.p_target is not None                                                # every row: P(the item's Type 1 target)


def test_controls_render_and_run(option_rows, sample):
    from medsafe_nb.protocols import build_prompts, type1_target
    ps = {(p.item_id, p.condition): p for p in build_prompts(sample, CONDITIONS)}
    it = next(i for i in sample if not i.is_multi)
    true_ctx = ps[it.id, "type1_true"].parts.contexts
    assert true_ctx == tuple((g, it.contexts[g]) for g in it.gold)
    (key, sentence), = ps[it.id, "type1_placebo"].parts.contexts
    others = {o.contexts[type1_target(o)] for o in sample if o.id != it.id}
    assert key is None and sentence in others and sentence not in it.contexts.values()
    assert set(option_rows[option_rows.condition.isin(["type1_true", "type1_placebo"])].target.dropna()) == set()


def test_option_scoring_is_refused_where_it_cannot_run(tiny_backend, sample):
    from medsafe_nb.models.base import make_backend
    from medsafe_nb.run.predict import run_benchmark
    with pytest.raises(ConfigError, match="cannot score option texts"):
        run_benchmark(sample[:2], make_backend("minilm"), conditions=("clean",), scoring="options", progress=False)
    with pytest.raises(ConfigError, match="option scoring reads the option text"):
        run_benchmark(sample[:2], tiny_backend, conditions=("clean",), scoring="options", prompt="paper", progress=False)


def test_metrics_tables_hold_the_baseline_and_controls(option_rows):
    from medsafe_nb.metrics.io import metrics_tables
    t = metrics_tables(option_rows, n_boot=20)
    assert {"tasr_baseline", "controls", "logprob"} <= set(t)
    tb = t["tasr_baseline"].iloc[0]
    assert tb.condition == "type1" and (pd.isna(tb.tasr) or 0 <= tb.tasr_random <= 100)
    ctl = t["controls"].iloc[0]
    assert ctl.n_items == option_rows.item_id.nunique() and not pd.isna(ctl.acc_type1_true)
