"Answer extraction: the reply corpus (one case per reply) and a property test against the substring-fallback bias."
import json, random
from pathlib import Path

import pytest

from medsafe_nb.extract import (EVIDENCE_METHODS, NO_ANSWER_METHODS, STATEMENT_PATTERNS, Extraction, extract_answer,
                                extract_answer_detail)

PATTERNS = {"answer_field", "answer_letter", "boxed", "subject_is_answer", "answer_line", *STATEMENT_PATTERNS}

CORPUS_PATH = Path(__file__).parent / "data" / "extraction_corpus.jsonl"
CORPUS = [json.loads(ln) for ln in CORPUS_PATH.read_text(encoding="utf-8").splitlines() if ln.strip()]


def test_corpus_shape():
    ids = [c["id"] for c in CORPUS]
    assert len(ids) == len(set(ids)), "duplicate ids"
    assert len(CORPUS) >= 100
    assert sum(c["expected"] is None for c in CORPUS) >= 20
    for c in CORPUS:
        assert set(c) == {"id", "reply", "options", "multi", "expected", "note"}, c["id"]
        keys = c["expected"].split(",") if c["expected"] else []
        assert all(k in c["options"] for k in keys), c["id"]
        assert c["multi"] or len(keys) <= 1, c["id"]


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_corpus_reply(case):
    d = extract_answer_detail(case["reply"], case["options"], case["multi"])
    assert d.key == case["expected"], f"{case['note']}: got {d}"
    assert extract_answer(case["reply"], case["options"], case["multi"]) == d.key
    if d.key is None:
        assert d.method in NO_ANSWER_METHODS
    else:
        kind, _, pattern = d.method.partition(":")
        assert kind == d.kind and kind in EVIDENCE_METHODS and pattern in PATTERNS, d.method   # KIND:PATTERN, a named pattern
        start, end = d.span
        assert 0 <= start < end <= len(case["reply"])


# ---------------------------------------------------------------- property: an explanation with no verdict gives None
WORDS = ("insulin glargine metformin glipizide pioglitazone amlodipine lisinopril losartan hydrochlorothiazide "
         "metoprolol warfarin heparin aspirin clopidogrel alteplase ceftriaxone penicillin azithromycin vancomycin "
         "doxycycline ethosuximide phenytoin carbamazepine valproate surgery observation biopsy colonoscopy "
         "echocardiography iron folate thiamine potassium calcium sodium bicarbonate dialysis transfusion "
         "chronic acute oral intravenous low dose high early late repeat urgent elective therapy infusion").split()
EN_TEMPLATES = (
    "{t} is sometimes considered in this setting.",
    "Some clinicians would mention {t} here.",
    "{t} has both benefits and risks for this patient.",
    "A patient like this could receive {t}, depending on comorbidities.",
    "Evidence for {t} is mixed.",
    "Option {k} ({t}) deserves some thought.",
    "{k}: {t} — reasonable in some patients, less so in others.",
    "I considered {t}, but its role here is debatable.",
    "The answer may involve {t} in selected cases.",
)
ZH_TEMPLATES = ("选项{k}（{t}）各有利弊。", "{t}在部分患者中可以考虑。", "关于{t}，证据尚不充分。")
HEDGES = ("More information is needed before choosing.", "It is hard to be definitive without further data.",
          "The decision depends on the full clinical picture.", "需要更多临床信息才能判断。")


def random_options(rng):
    n = rng.randint(2, 10)
    keys = [str(i + 1) for i in range(n)] if rng.random() < 0.3 else list("ABCDEFGHIJ"[:n])
    texts, seen = [], set()
    while len(texts) < n:
        t = " ".join(rng.sample(WORDS, rng.randint(1, 3)))
        t = t[0].upper() + t[1:] if rng.random() < 0.5 else t
        if t.lower() not in seen: seen.add(t.lower()); texts.append(t)
    return dict(zip(keys, texts))


def explanation(rng, options):
    "Prose that mentions every option's text and chooses none; a quarter are echoed option lists"
    if rng.random() < 0.25:   # the options echoed one per line, the last line included
        return "Options to weigh:\n" + "\n".join(f"{k}. {t}" for k, t in options.items())
    templates = EN_TEMPLATES + (ZH_TEMPLATES if rng.random() < 0.3 else ())
    sentences = [rng.choice(templates).format(k=k, t=t) for k, t in options.items()]
    rng.shuffle(sentences)
    sep = rng.choice([" ", "\n", "\n\n"])
    return sep.join(sentences) + sep + rng.choice(HEDGES)


@pytest.mark.parametrize("seed", range(300))
def test_explanation_without_verdict_gives_none(seed):
    rng = random.Random(seed)
    options = random_options(rng)
    reply = explanation(rng, options)
    assert all(t in reply for t in options.values())       # every option's text is mentioned
    d = extract_answer_detail(reply, options, multi=rng.random() < 0.2)
    assert d == Extraction(None, "none"), (options, reply, d)


def test_deterministic():
    for c in CORPUS[:20]:
        assert len({extract_answer_detail(c["reply"], c["options"], c["multi"]) for _ in range(3)}) == 1
