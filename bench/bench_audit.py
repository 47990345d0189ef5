"""Audit speed: the rules, the learned context-only probes and the whole `audit` on a release the size of the full one.

The release is synthetic: the embedded sample's items repeated to N items, each copy with its own id and its
sentences' words shuffled (so no two copies share a sentence). What is timed is the audit, not the data.

Run: .venv/bin/python bench/bench_audit.py [--items 10932] [--quick]   (prints a table; nothing is asserted)
"""
import argparse, dataclasses, random, time

from medsafe_nb.items.release import load_medmisbench
from medsafe_nb.items import audit as A


def release(n:int, seed:int=0)->list:
    "n items built from the sample, each copy's sentences shuffled word by word"
    base, rng = load_medmisbench(), random.Random(seed)
    out = []
    for i in range(n):
        it = base[i % len(base)]
        ctx = {k: " ".join(rng.sample(s.split(), len(s.split()))) for k, s in it.contexts.items()}
        out.append(dataclasses.replace(it, id=f"{it.id}-{i}", contexts=ctx))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=10932, help="release size (the full release has 10,932 items)")
    ap.add_argument("--quick", action="store_true", help="2,000 items: checks the script runs")
    args = ap.parse_args()
    n = 2000 if args.quick else args.items
    items = release(n)
    single = [it for it in items if not it.is_multi]
    rows = []
    t = time.perf_counter(); A.shortcut_table(items); rows.append(("rules (4)", time.perf_counter() - t))
    sents = A.probe_sentences(single)
    for p in A.PROBES:
        t = time.perf_counter(); A.probe_scores(sents, p); rows.append((f"probe {p} (5 folds)", time.perf_counter() - t))
    t = time.perf_counter(); A.audit(items); rows.append(("audit, all tables", time.perf_counter() - t))
    print(f"| step ({n:,} items, {len(sents):,} sentences) | seconds |\n| --- | --- |")
    for name, s in rows: print(f"| {name} | {s:.1f} |")


if __name__ == "__main__": main()
