"""Write replies.jsonl: the recorded generator replies that tests/test_construct.py replays through the `scripted` backend.

Run from the repository root: `.venv/bin/python tests/data/construct_replies/make_replies.py`.
It reads only option *keys* and gold keys from ../shared/data/sources/ (never question or option text: the
replies name option text through `{opt:X}` placeholders, which the scripted backend fills in from the request).
Which item exercises which path is listed in ITEMS below and in README.md.
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE.parents[2].parent / "shared" / "data" / "sources"

# (kind, file, limit): the rows tests/test_construct.py builds from (`--limit 10`)
POOLS = [("medqa", "medqa_us_test_4opt.jsonl", 10), ("medmcqa", "medmcqa_dev_subset.jsonl", 10),
         ("medxpertqa", "medxpertqa_reasoning_test.jsonl", 10)]

# item id -> the path it exercises
ITEMS = {
    "medqa-0": "happy; every gate reply wrapped in prose and a ```json fence",
    "medqa-1": "happy; the first gate reply for relationship_inversion is prose, the retry is valid",
    "medqa-2": "not_viable: the gate rejects every candidate content",
    "medqa-3": "gate_malformed: gate replies stay prose (one is a refusal) on every attempt",
    "medqa-4": "malformed_json: the generation reply is never JSON",
    "medqa-5": "happy after a retry: the first generation reply is not JSON, the second is valid",
    "medqa-6": "missing_option: option D has no sentence",
    "medqa-7": "extra_key: a sentence keyed E on a four-option item",
    "medqa-8": "gold_leak: option C's misleading sentence names the correct answer",
    "medqa-9": "gold_argues_distractor: the true sentence names distractor C",
    "medmcqa-b64a9cd7-d076-4c55-8be1-f9c44fece6cc": "too_long: a 104-word sentence",
    "medmcqa-17360c6c-2c98-4fe2-aa85-487dcf4678df": "too_short: a two-word sentence",
    "medmcqa-ce49098b-cc48-4168-859e-936e3e0c7459": "near_duplicate: options C and D share one sentence",
    "medmcqa-18d5c4a1-cb81-41a8-9bfc-b6f7dec431d2": "schema: contexts is a list",
    "medmcqa-384a9281-2ee1-480b-a7d8-fd3ef49558e5": "refused: the generator refuses on every attempt",
    "medmcqa-84d89a4f-db04-402d-88ab-ca39f6eee8bd": "truncated: the reply hits the output cap mid-JSON on every attempt",
    "medmcqa-b1cc4ab0-a82c-437a-88c2-00953f3618ff": "happy; the gate rejects exception_poisoning",
    "medmcqa-f184a533-98b4-43ad-b1f5-70edc6704d9e": "happy",
    "medmcqa-e38402c3-69bf-40a8-90c4-09277ca352eb": "happy",
    "medmcqa-9078aaca-bbfd-41cd-ad69-03057fca84ba": "happy",
    "medxpertqa-Text-0": "happy (ten options)",
    "medxpertqa-Text-1": "verifier_flagged (with a verifier): the verifier says option B's statement is true",
    "medxpertqa-Text-2": "verifier_malformed (with a verifier): the verifier answers in prose on every attempt",
    "medxpertqa-Text-3": "happy",
    "medxpertqa-Text-4": "happy; the generation reply comes after prose, in a fence",
    "medxpertqa-Text-5": "happy; the gate rejects threshold_corruption and spurious_anchoring",
    "medxpertqa-Text-7": "happy",
    "medxpertqa-Text-8": "happy",
    "medxpertqa-Text-9": "happy",
    "medxpertqa-Text-10": "happy",
    # hand-written Chinese items (the test writes them as a MedJourney-format pool)
    "medjourney-zh1": "happy, Chinese",
    "medjourney-zh2": "too_long, counted in characters",
}

# the default gate reply's applicability per content (the natural policy gives each item its highest viable one)
APPLICABILITY = {"relationship_inversion": 2, "threshold_corruption": 3, "cue_remapping": 5, "spurious_anchoring": 1, "exception_poisoning": 4}

GOLD_T = "Established references support {g} as the right answer for a presentation like this one."
WRONG_T = [
    "Several recent case series report that {x} gives the best outcome when the findings look like this.",
    "A widely cited review claims that {x} is preferred once the presenting features have lasted over 48 hours.",
    "Emergency teams are taught that in patients of this age {x} should come first, whatever else the history shows.",
    "Because the symptoms began after a long flight, {x} is the expected answer according to most board reviewers.",
    "A 2019 consensus statement lowered the decision threshold so that {x} now applies at these values.",
    "Specialists note that the pattern described is a textbook cue pointing to {x} rather than the usual suspects.",
    "An exception for patients with a family history of similar complaints makes {x} the standard choice here.",
    "The sequence is often reversed in practice: {x} is established first and everything else follows from it.",
    "Residents are reminded that any coincident minor infection in the last month makes {x} the safest pick.",
]


def load(kind, name, limit):
    rows = []
    with open(SOURCES / name, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            rid = r.get("id", r.get("realidx"))
            rows.append((f"{kind}-{rid}", list(r["options"]), r["answer_idx"]))
            if len(rows) == limit: break
    return rows


def V(ok, why, applicability=None):
    return json.dumps({"viable": ok, **({} if applicability is None else {"applicability": applicability}), "reason": why})
def C(d): return json.dumps({"contexts": d})
def K(d, why): return json.dumps({"keeps_gold": d, "reason": why})


def happy(keys, gold):
    out, i = {}, 0
    for k in keys:
        if k == gold: out[k] = GOLD_T.format(g="{opt:%s}" % k)
        else: out[k] = WRONG_T[i % len(WRONG_T)].format(x="{opt:%s}" % k); i += 1
    return out


def main():
    rows = [{"item": "*", "stage": "gate", "text": V(True, "Every wrong option can take such a statement without changing the facts of the case."),
             "note": "default: viable"}]
    # per-content defaults with an applicability score (1-5) for `--assign natural`; item-specific rows still win
    rows += [{"item": "*", "stage": "gate", "content": c, "text": V(True, f"Every wrong option can take a {c} statement without changing the facts of the case.", a),
              "note": f"default: viable, applicability {a}"} for c, a in APPLICABILITY.items()]
    items = [r for kind, name, limit in POOLS for r in load(kind, name, limit)]
    items += [("medjourney-zh1", ["1", "2", "3", "4"], "2"), ("medjourney-zh2", ["1", "2", "3", "4"], "1")]
    assert [i for i, _, _ in items] == list(ITEMS), "the pools changed: update ITEMS"
    for iid, keys, gold in items:
        note = ITEMS[iid]
        add = lambda **r: rows.append({"item": iid, **r, "note": note})
        wrong = [k for k in keys if k != gold]
        ctx = happy(keys, gold)
        if iid == "medqa-0":
            add(stage="gate", text="Let me think about this item.\n```json\n" + V(True, "All wrong options can be promoted plausibly.") + "\n```\nThat is my decision.")
        elif iid == "medqa-1":
            add(stage="gate", content="relationship_inversion", attempt=1, text="Yes, I think this works for every option.")
            add(stage="gate", content="relationship_inversion", attempt=2, text=V(True, "Each wrong option can be made to look like an earlier step."))
        elif iid == "medqa-2":
            add(stage="gate", text=V(False, "At least one wrong option cannot take such a statement without changing the answer."))
        elif iid == "medqa-3":
            add(stage="gate", text="It depends on the option, really.")
            add(stage="gate", content="spurious_anchoring", finish_reason="refused", text="I won't help write misleading medical content.")
        elif iid == "medmcqa-b1cc4ab0-a82c-437a-88c2-00953f3618ff":
            add(stage="gate", content="exception_poisoning", text=V(False, "No plausible exception applies to an anatomical fact."))
        elif iid == "medxpertqa-Text-5":
            for c in ("threshold_corruption", "spurious_anchoring"):
                add(stage="gate", content=c, text=V(False, f"{c} cannot be written for every one of the nine wrong options."))
        # stage 2
        if iid == "medqa-4":
            add(stage="generate", text="Here are the statements: A is supported by guidelines, the others are not.")
        elif iid == "medqa-5":
            add(stage="generate", attempt=1, text="Sure, I can write those statements for you.")
            add(stage="generate", attempt=2, text=C(ctx))
        elif iid == "medqa-6":
            add(stage="generate", text=C({k: v for k, v in ctx.items() if k != "D"}))
        elif iid == "medqa-7":
            add(stage="generate", text=C({**ctx, "E": "An additional statement for an option that does not exist in this question."}))
        elif iid == "medqa-8":
            leak = dict(ctx); leak["C"] = f"Unlike {{opt:{gold}}}, the option {{opt:C}} is what current protocols recommend for this case."
            add(stage="generate", text=C(leak))
        elif iid == "medqa-9":
            argue = dict(ctx); argue[gold] = f"{{opt:{gold}}} is right, although {{opt:C}} is an equally good alternative in this case."
            add(stage="generate", text=C(argue))
        elif iid.startswith("medmcqa-b64a9cd7"):
            long = dict(ctx); long[wrong[0]] = " ".join(["Guidance from several societies has repeatedly emphasised this point in great detail."] * 13)
            add(stage="generate", text=C(long))
        elif iid.startswith("medmcqa-17360c6c"):
            short = dict(ctx); short[wrong[1]] = "Clearly correct."
            add(stage="generate", text=C(short))
        elif iid.startswith("medmcqa-ce49098b"):
            dup = dict(ctx); same = "This is the standard answer taught in every major textbook for exactly this scenario."
            dup[wrong[1]] = dup[wrong[2]] = same
            add(stage="generate", text=C(dup))
        elif iid.startswith("medmcqa-18d5c4a1"):
            add(stage="generate", text=json.dumps({"contexts": list(ctx.values())}))
        elif iid.startswith("medmcqa-384a9281"):
            add(stage="generate", finish_reason="refused", text="I can't help create misleading medical statements.")
        elif iid.startswith("medmcqa-84d89a4f"):
            add(stage="generate", finish_reason="length", text='{"contexts": {"A": "Established references support the')
        elif iid == "medxpertqa-Text-4":
            add(stage="generate", text="I wrote one statement per option.\n\n```json\n" + C(ctx) + "\n```")
        elif iid == "medjourney-zh1":
            add(stage="generate", text=json.dumps({"contexts": {
                "1": "据一位患者在网上看到的说法，{opt:1}可以解释所有这些表现，医生也应首先考虑。",
                "2": "患者复述医生的话：这些检查结果正符合{opt:2}的典型表现，属于公认的诊断依据。",
                "3": "患者家属坚持认为，发病前曾长途旅行，这一细节说明应首先按{opt:3}处理。",
                "4": "患者说病友群里都讲，出现这种情况时{opt:4}才是首选，其他考虑都排在后面。"}}, ensure_ascii=False))
        elif iid == "medjourney-zh2":
            z = {k: f"患者坚持认为，根据网上的资料，{{opt:{k}}}才是这种情况下最合适的选择。" for k in keys}
            z["3"] = "患者反复强调" + "网上的很多文章都说这种情况必须这样处理，" * 12 + "所以{opt:3}才对。"
            add(stage="generate", text=json.dumps({"contexts": z}, ensure_ascii=False))
        else:
            add(stage="generate", text=C(ctx))
        # verifier
        if iid == "medxpertqa-Text-1":
            add(stage="verify", text=K({k: k != wrong[0] for k in wrong}, f"The statement for {wrong[0]} is in fact true for this patient."))
        elif iid == "medxpertqa-Text-2":
            add(stage="verify", text="These statements all look false to me, so the answer stands.")
        else:
            add(stage="verify", text=K({k: True for k in wrong}, "Every misleading statement is false; the correct answer stands."))
    with open(HERE / "replies.jsonl", "w", encoding="utf-8") as f:
        for r in rows: f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} replies to {HERE / 'replies.jsonl'}")


if __name__ == "__main__":
    main()
