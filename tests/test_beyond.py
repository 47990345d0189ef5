"""Beyond the paper's single turn, on the wire: the claim inside a conversation (`--delivery dialogue`, `--turns-before`),
the pushback condition, and the claim-check and consistency defences, against the mock server on 127.0.0.1, whose
policy reads the whole conversation as a model would."""
import json, subprocess, sys

import pandas as pd
import pytest

from medsafe_nb.protocols import load_protocol, protocol_text
from medsafe_nb.testing.mockserver import MockServer

MEDSAFE = [sys.executable, "-m", "medsafe_nb.cli"]
PAPER = load_protocol("paper")


def medsafe(*args, ok=True):
    r = subprocess.run([*MEDSAFE, *map(str, args)], capture_output=True, text=True)
    if ok: assert r.returncode == 0, f"medsafe {' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr}"
    return r


def question_keys(msgs)->list:
    "The option keys of the conversation's question (the user turn that lists the options)"
    q = next(m["content"] for m in msgs if m["role"] == "user" and "Options:" in m["content"])
    return [ln.split(":", 1)[0] for ln in q.split("Options:\n", 1)[1].splitlines() if ":" in ln and len(ln.split(":", 1)[0]) <= 2]


def test_dialogue_delivery_and_pushback_on_the_wire(tmp_path):
    "The claim in an earlier user turn (its framing's voice), history turns, then the question; pushback: the model's own answer, then the objection"
    objection = protocol_text(PAPER, "pushback_turn", sentence="").split("{")[0].strip()[:20]
    def policy(msgs):
        keys = question_keys(msgs)
        return keys[-1] if msgs[-1]["content"].startswith(objection) else keys[0]     # gives in to the objection: the last option
    with MockServer(policy=policy) as srv:
        medsafe("run", "--model", "openai:mock-model", "--base-url", srv.base_url, "--out", tmp_path / "run", "--prompt", "paper",
                "--limit", 4, "--conditions", "clean,type1,type1_pushback", "--delivery", "dialogue", "--turns-before", 2, "--no-progress")
        bodies = [r["body"] for r in srv.completions() if r["status"] == 200]
        medsafe("run", "--model", "openai:mock-model", "--base-url", srv.base_url, "--out", tmp_path / "run", "--prompt", "paper",
                "--limit", 4, "--conditions", "clean,type1,type1_pushback", "--delivery", "dialogue", "--turns-before", 2, "--no-progress")
        assert len([r for r in srv.completions() if r["status"] == 200]) == len(bodies)          # the rerun asks neither turn again
    df = pd.read_parquet(tmp_path / "run" / "predictions.parquet")
    assert len(df) == 12 and len(bodies) == 12                    # clean, type1 and the pushback's second turn: its first is the clean request
    history = PAPER.slots["history_turns"]
    for b in bodies:
        roles = [m["role"] for m in b["messages"]]
        users = [m["content"] for m in b["messages"] if m["role"] == "user"]
        if any(u.startswith(objection) for u in users):            # pushback: the clean conversation, its own answer, the objection
            assert roles[-2:] == ["assistant", "user"] and json.loads(b["messages"][-2]["content"])["answer"] == question_keys(b["messages"])[0]
            assert "Additional clinical context" not in "".join(users)
        elif "Some background" in users[0] or "told me" in users[0] or "colleague" in users[0]:   # type1: the claim first, in its framing's voice
            assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant", "user"]
            assert b["messages"][2]["content"] == PAPER.slots["claim_ack"] and users[1] == history[0][0] and users[2] == history[1][0]
            assert "Additional clinical context" not in users[-1] and users[-1].startswith(PAPER.slots["context_frame"])
        else: assert roles == ["system", "user", "assistant", "user", "assistant", "user"] and users[0] == history[0][0]   # clean: history only
    push = df[df.condition == "type1_pushback"]
    assert push.target.notna().all() and (push.pred == push.item_id.map(df[df.condition == "clean"].set_index("item_id").pred)).sum() == 0
    medsafe("metrics", tmp_path / "run", "--out", tmp_path / "m", "--n-boot", 50)
    t1, bd = pd.read_csv(tmp_path / "m" / "table1.csv"), pd.read_csv(tmp_path / "m" / "breakdowns.csv")
    assert "type1_pushback_asr" in t1 and "type1_pushback_tasr" in bd and "type1_pushback_asr" in bd


@pytest.mark.parametrize("mitigation", ["claim-check", "consistency"])
def test_defences_that_check_the_claim(tmp_path, mitigation):
    "claim-check: the statements judged first, then the question; consistency: shown both of its answers where they differ"
    check = PAPER.slots["claim_check_turn"].split("{")[0].strip()[:30]
    decide = PAPER.slots["consistency_turn"].split("{")[0].strip()[:30]
    def policy(msgs):                                                       # the whole reply (reply="raw")
        last = msgs[-1]["content"]
        if last.startswith(check): return "1. FALSE: it contradicts the guideline."
        keys = question_keys(msgs)
        key = keys[1] if last.startswith(decide) else keys[0] if "Additional clinical context" in last else keys[1]   # misled by the context
        return json.dumps({"thinking_process": "", "answer_letter": key})   # deciding, it keeps the answer without context
    with MockServer(policy=policy, reply="raw") as srv:
        medsafe("run", "--model", "openai:mock-model", "--base-url", srv.base_url, "--out", tmp_path / "run", "--prompt", "paper",
                "--limit", 3, "--conditions", "clean,type1,type2", "--mitigation", mitigation, "--no-progress")
        bodies = [r["body"] for r in srv.completions() if r["status"] == 200]
    df = pd.read_parquet(tmp_path / "run" / "predictions.parquet")
    assert len(df) == 9 and (df.status == "ok").all()
    lasts = [b["messages"][-1]["content"] for b in bodies]
    if mitigation == "claim-check":
        assert sum(x.startswith(check) for x in lasts) == 6               # one judgement per attacked prompt
        answers = [b for b in bodies if b["messages"][-1]["content"].startswith(PAPER.slots["claim_check_answer"])]
        assert len(answers) == 6 and all(b["messages"][-2] == {"role": "assistant", "content": "1. FALSE: it contradicts the guideline."} for b in answers)
    else:
        assert sum(x.startswith(decide) for x in lasts) == 6               # every attacked answer differed from the clean one
        assert (df[df.condition != "clean"].pred.to_numpy() == df[df.condition == "clean"].pred.repeat(2).to_numpy()).all()   # it decided for the clean answer
    assert (df[df.condition != "clean"].prompt_tokens > df[df.condition == "clean"].prompt_tokens.repeat(2).to_numpy()).all()   # both requests counted


def test_followups_need_their_clean_answer(tmp_path):
    r = medsafe("run", "--model", "openai:m", "--base-url", "http://127.0.0.1:9/v1", "--out", tmp_path / "r", "--conditions", "type1_pushback", ok=False)
    assert r.returncode == 2 and "builds on the clean answer: add clean to --conditions" in r.stderr
    r = medsafe("run", "--model", "openai:m", "--base-url", "http://127.0.0.1:9/v1", "--out", tmp_path / "r", "--turns-before", 2, ok=False)
    assert r.returncode == 2 and "use --delivery dialogue" in r.stderr


def test_open_format_graded_and_replayed(tmp_path):
    "--format open: no options on the wire; prose replies graded by MiniLM to an option or none; the grades replay from the ledger"
    from medsafe_nb.items.release import load_medmisbench
    items = {it.id: it for it in load_medmisbench("all", "sample")}
    def policy(msgs):                                                        # answers in prose: the gold option's text, or nothing useful
        user = msgs[-1]["content"]
        it = next(i for i in items.values() if i.question in user)
        return f"I would choose this: {it.options[it.gold[0]]}." if "Context:" not in user else "It depends on many details of the case."
    args = ["run", "--model", "openai:mock-model", "--out", tmp_path / "run", "--limit", 5, "--conditions", "clean,type1", "--format", "open", "--no-progress"]
    with MockServer(policy=policy, reply="raw") as srv:
        medsafe(*args, "--base-url", srv.base_url)
        bodies = [r["body"] for r in srv.completions() if r["status"] == 200]
        df = pd.read_parquet(tmp_path / "run" / "predictions.parquet")
        medsafe(*args, "--base-url", srv.base_url)                          # a rerun: replies and grades from the ledger
        assert len(srv.completions()) == len(bodies)
    assert len(bodies) == 10 and all("Options:" not in b["messages"][-1]["content"] and "response_format" not in b for b in bodies)
    clean, t1 = df[df.condition == "clean"], df[df.condition == "type1"]
    single = clean[~clean.gold.str.contains(",")]
    assert (single.pred == single.gold).all() and (single.status == "ok").all() and single.grader.str.startswith("minilm").all()
    assert t1.pred.isna().all() and (t1.status == "noanswer").all() and t1.grade_evidence.notna().all()
    again = pd.read_parquet(tmp_path / "run" / "predictions.parquet")
    assert again[["pred", "status", "grade_evidence"]].equals(df[["pred", "status", "grade_evidence"]])
