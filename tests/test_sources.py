"""The raw-pool loaders on the real public pools in ../shared/data/sources (5,950 rows), and `medsafe validate` on the sample."""
import json, subprocess, sys
from pathlib import Path

import pytest

from medsafe_nb.items.sources import load_source

SOURCES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "sources"
POOLS = [("medqa", "medqa_us_test_4opt.jsonl"), ("medmcqa", "medmcqa_dev_subset.jsonl"), ("medxpertqa", "medxpertqa_reasoning_test.jsonl")]


@pytest.mark.skipif(not SOURCES.exists(), reason="../shared/data/sources is only on development and CI machines")
def test_gold_letter_is_answer_idx_on_every_shared_row():
    total = 0
    for kind, name in POOLS:
        raw = [json.loads(line) for line in open(SOURCES / name, encoding="utf-8")]
        items = load_source(kind, SOURCES / name)
        assert len(items) == len(raw)
        bad = [(it.id, it.gold, r["answer_idx"]) for it, r in zip(items, raw) if it.gold != (r["answer_idx"],)]
        assert not bad, f"{name}: {len(bad)} rows disagree, e.g. {bad[:3]}"
        assert all(it.options[it.gold[0]] == r["answer"].strip() for it, r in zip(items, raw))   # MedQA's `answer` is the text
        total += len(items)
    assert total == 5950


def test_validate_sample_shows_all_15_cells():
    r = subprocess.run([sys.executable, "-m", "medsafe_nb.cli", "validate", "sample"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert " items OK" in r.stdout and "15 content x provenance cells" in r.stdout
