"""Grading free-text answers across modules: the LLM grader against a real HTTP server on 127.0.0.1 (its agreement with
the hand-labelled set), grades replayed from the ledger with the grader gone, agreement recomputed from the file, and
graded answers read by the MCQ-vs-open gap."""
import json, re
from pathlib import Path

import pandas as pd
import pytest

import medsafe_nb.run.grading as grading
from medsafe_nb.run.grading import (GRADER_PROMPT_SHA, LLMGrader, MiniLMGrader, grade_replies, grader_agreement,
                                    load_open_replies, prediction_status, OPEN_REPLIES)
from medsafe_nb.run.ledger import Ledger
from medsafe_nb.metrics.open import mcq_open_gap
from medsafe_nb.testing.mockserver import MockServer
from medsafe_nb.testing.mockscript import user_text

ROOT = Path(__file__).resolve().parents[1]
LABELLED = ROOT / OPEN_REPLIES


@pytest.fixture(scope="module")
def labelled():
    return load_open_replies(LABELLED)


def scripted_grader(rows, unreadable):
    "A grader model for the mock server: it reads the options and the answer from the prompt, answers the reader's label, except that it "
    "forces a hedge onto the first option it was shown and answers one reply in words"
    by_reply = {r["reply"]: r for r in rows}
    def policy(messages):
        text = user_text(messages)
        reply = re.search(r"<answer>\n(.*)\n</answer>", text, re.S).group(1)
        shown = re.findall(r"^(\w+)\. ", text.split("Options:\n", 1)[1].split("<answer>", 1)[0], re.M)
        r = by_reply[reply]
        if reply == unreadable: return "I would say the first one."
        if r["kind"] == "hedge": return shown[0]
        return r["label"] or "NONE"
    return policy


def test_llm_grader_against_a_local_server(tmp_path, labelled):
    unreadable = next(r["reply"] for r in labelled if r["kind"] == "gold")
    pairs = [(r["item"], r["reply"]) for r in labelled]
    with MockServer(policy=scripted_grader(labelled, unreadable), reply="raw") as srv, Ledger(tmp_path / "ledger.sqlite") as led:
        grader = LLMGrader("openai:mock-model", base_url=srv.base_url)
        grades = grade_replies(pairs, grader, led)
        bodies = [json.dumps(r["body"], ensure_ascii=False) for r in srv.completions()]
    assert len(bodies) == len(pairs)                                                      # one request per reply
    for (item, _), body in zip(pairs, bodies):                                            # the options and the reply, nothing else
        assert item.question not in body and not any(c in body for c in item.contexts.values())
    assert grader.identity == f"llm:openai:mock-model@{srv.base_url}:prompt={GRADER_PROMPT_SHA[:12]}"
    ag = grader_agreement(labelled, grades)
    hedges = sum(r["kind"] == "hedge" for r in labelled)
    assert ag["n"] == len(labelled) and ag["error"] == 1
    assert ag["accuracy"] == pytest.approx(100 * (len(labelled) - hedges - 1) / len(labelled))
    assert 0 < ag["kappa"] < 1
    wrong = [r for r, g in zip(labelled, grades) if g.key != r["label"]]
    assert sorted(r["kind"] for r in wrong) == sorted(["hedge"] * hedges + ["gold"])


def test_llm_grades_replay_with_the_server_gone(tmp_path, labelled):
    pairs = [(r["item"], r["reply"]) for r in labelled[:12]]
    with MockServer(policy=scripted_grader(labelled, None), reply="raw") as srv:
        url = srv.base_url
        with Ledger(tmp_path / "ledger.sqlite") as led: first = grade_replies(pairs, LLMGrader("openai:mock-model", base_url=url), led)
    offline = LLMGrader("openai:mock-model", base_url=url)                                # the server is stopped
    with Ledger(tmp_path / "ledger.sqlite") as led: again = grade_replies(pairs, offline, led)
    assert again == first and offline._backend is None                                    # identical, and the grader was never made
    assert [g.status for g in first] == ["ok"] * len(pairs)


def test_minilm_grades_replay_without_the_encoder(tmp_path, labelled, monkeypatch):
    pairs = [(r["item"], r["reply"]) for r in labelled]
    with Ledger(tmp_path / "ledger.sqlite") as led:
        first = grade_replies(pairs, "minilm", led)
        assert len(led.grades(grader=MiniLMGrader().identity)) == len(pairs)
    def gone(*a, **k): raise RuntimeError("the encoder is not installed")
    monkeypatch.setattr(grading, "minilm_embed", gone)
    with Ledger(tmp_path / "ledger.sqlite") as led: assert grade_replies(pairs, "minilm", led) == first
    with pytest.raises(RuntimeError, match="not installed"):                              # a reply not in the ledger needs the grader
        with Ledger(tmp_path / "ledger.sqlite") as led: grade_replies([(pairs[0][0], "Something new.")], "minilm", led)


def test_agreement_is_recomputed_from_the_file(tmp_path, labelled):
    grades = grade_replies([(r["item"], r["reply"]) for r in labelled], "minilm", None)
    base = grader_agreement(labelled, grades)
    lines = LABELLED.read_text(encoding="utf-8").splitlines()
    hit = next(i for i, (r, g) in enumerate(zip(labelled, grades)) if g.key == r["label"] and g.key is not None)
    row = json.loads(lines[hit]); row["label"] = next(k for k in labelled[hit]["item"].options if k != row["label"])
    changed = tmp_path / "changed.jsonl"
    changed.write_text("\n".join([*lines[:hit], json.dumps(row, ensure_ascii=False), *lines[hit + 1:]]) + "\n", encoding="utf-8")
    relabelled = load_open_replies(changed)
    after = grader_agreement(relabelled, grade_replies([(r["item"], r["reply"]) for r in relabelled], "minilm", None))
    assert after["accuracy"] == pytest.approx(base["accuracy"] - 100 / len(labelled))    # one label changed, one agreement lost
    assert after["kappa"] < base["kappa"]
    shorter = tmp_path / "shorter.jsonl"
    shorter.write_text("\n".join(lines[:20]) + "\n", encoding="utf-8")
    assert grader_agreement(load_open_replies(shorter), grades[:20])["n"] == 20
    nb = json.loads((ROOT / "nbs/run/10b_grading.ipynb").read_text(encoding="utf-8"))
    typed = "".join("".join(c["source"]) for c in nb["cells"])                           # the notebook's text, outputs aside
    for number in (f"{base['accuracy']:.1f}", f"{base['kappa']:.3f}", f"{base['outcome_kappa']:.3f}"):
        assert number not in typed, f"{number} is typed into the notebook rather than computed"


def test_graded_answers_feed_the_gap(labelled):
    "Graded answers read as predictions: an option is an answer, none is noanswer; the gap compares them with letters"
    rows = [r for r in labelled if r["item"].language == "en"][:10]
    grades = grade_replies([(r["item"], r["reply"]) for r in rows], "minilm", None)
    def table(preds):
        return pd.DataFrame([{"model": "m", "item_id": r["item"].id + f"#{i}", "condition": "clean", "target": None, "gold": r["item"].gold[0],
                              "pred": p, "correct": p == r["item"].gold[0], "status": s} for i, (r, (p, s)) in enumerate(zip(rows, preds))])
    mcq = table([(r["item"].gold[0], "ok") for r in rows])
    opn = table([(g.key, prediction_status(g)) for g in grades])
    gap = mcq_open_gap(mcq, opn, n_boot=100).set_index("metric")
    right = sum(g.key == r["item"].gold[0] for r, g in zip(rows, grades))
    assert gap.loc["clean_acc", "open"] == pytest.approx(100 * right / len(rows))
    assert gap.loc["clean_invalid", "open"] == pytest.approx(100 * sum(g.key is None for g in grades) / len(rows))
