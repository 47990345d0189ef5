"""Ledger speed: lookups/s and inserts/s at 10k and 100k rows, and a fully cached 10k-request rerun against asking.

Run: .venv/bin/python bench/bench_ledger.py   (prints a table; nothing is asserted)
"""
import hashlib, random, sys, tempfile, time
from pathlib import Path

from medsafe_nb.models.base import Backend, GenRequest, Generation
from medsafe_nb.core import utc_now
from medsafe_nb.models.identity import canonical_json, key_of, request_payload
from medsafe_nb.run.ledger import Ledger, cached_generate, _dump

IDENTITY = {"kind": "bench", "model": "instant", "temperature": 0, "max_new_tokens": 2048}
SYSTEM = "You are a medical expert. Answer the multiple-choice question. " * 4   # ~250 characters, like the real prompts


class Instant(Backend):
    "Answers at once, so what is timed is the ledger"
    kind, model = "bench", "instant"
    def identity(self): return dict(IDENTITY)
    def generate(self, requests):
        for i in range(len(requests)): yield i, Generation('{"answer": "B"}', "stop", prompt_tokens=300, completion_tokens=6, latency_s=0.0)


def requests(n, salt=""):
    "n distinct type2-sized prompts (~1.2 kB each)"
    h = lambda i: hashlib.sha256(f"{salt}{i}".encode()).hexdigest()
    return [GenRequest(({"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"Context:\n- {h(i) * 6}\n\nQuestion {i}: which is first-line?\n\n"
                                                    "Options:\nA. Metformin\nB. Insulin\nC. Diet\nD. Surgery"}), max_new_tokens=2048)
            for i in range(n)]


def rows_for(reqs):
    ident = canonical_json(IDENTITY)
    res = _dump(Generation('{"answer": "B"}', "stop", 300, 6, 0.0))
    out = []
    for r in reqs:
        p = canonical_json(request_payload(r))
        out.append((key_of(ident, "generate", p), "generate", "instant", ident, p, res, utc_now()))
    return out


def timed(fn):
    t0 = time.perf_counter(); out = fn(); return time.perf_counter() - t0, out


def bench_size(n, tmp):
    path = tmp / f"ledger-{n}.sqlite"
    rows = rows_for(requests(n, salt=f"s{n}"))
    with Ledger(path) as led:
        t_ins, _ = timed(lambda: [led._insert([r]) for r in rows])                  # one commit per row, as in a run
        keys = [r[0] for r in rows]
        random.Random(0).shuffle(keys)
        t_batch, found = timed(lambda: led._lookup(keys))                           # batched passes (as many keys per query as SQLite allows)
        assert len(found) == n
        sample = keys[:10_000]
        t_one, _ = timed(lambda: [led.get(k) for k in sample])                      # key by key
        size_mb = sum(p.stat().st_size for p in tmp.glob(f"ledger-{n}.sqlite*")) / 1e6
    with Ledger(tmp / f"bulk-{n}.sqlite") as led:
        t_bulk, _ = timed(lambda: led._insert(rows))                                # one transaction, for comparison
    return dict(n=n, insert_row=n / t_ins, insert_bulk=n / t_bulk, lookup_batch=n / t_batch,
                lookup_one=len(sample) / t_one, size_mb=size_mb)


def bench_rerun(n, tmp):
    reqs = requests(n, salt="rerun")
    t_plain, _ = timed(lambda: cached_generate(Instant(), reqs, None, progress=False))           # no ledger at all
    with Ledger(tmp / "rerun.sqlite") as led:
        t_ask, first = timed(lambda: cached_generate(Instant(), reqs, led, progress=False))    # asks all, commits each
        asked = led.last.asked
        t_cached, again = timed(lambda: cached_generate(Instant(), reqs, led, progress=False)) # all from the ledger
        assert again == first and led.last.cached == n and led.last.asked == 0 and asked == n
    return t_plain, t_ask, t_cached


def main():
    print(f"python {sys.version.split()[0]}, sqlite {__import__('sqlite3').sqlite_version}")
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as d:
        tmp = Path(d)
        sizes = [bench_size(n, tmp) for n in (10_000, 100_000)]
        t_plain, t_ask, t_cached = bench_rerun(10_000, tmp)
    print()
    print(f"{'rows':>8} | {'insert/s (commit each)':>22} | {'insert/s (one txn)':>18} | {'lookup/s (batched)':>18} | {'lookup/s (one by one)':>21} | {'file MB':>7}")
    print("-" * 110)
    for s in sizes:
        print(f"{s['n']:>8,} | {s['insert_row']:>22,.0f} | {s['insert_bulk']:>18,.0f} | {s['lookup_batch']:>18,.0f} | {s['lookup_one']:>21,.0f} | {s['size_mb']:>7.1f}")
    a, b = sizes
    print(f"\n100k vs 10k: inserts {b['insert_row']/a['insert_row']:.2f}x, batched lookups {b['lookup_batch']/a['lookup_batch']:.2f}x the rate")
    print(f"batched vs one-by-one lookups at 100k: {b['lookup_batch']/b['lookup_one']:.1f}x; one txn vs commit-each inserts: {b['insert_bulk']/b['insert_row']:.1f}x")
    print("\n10,000 requests to an instant backend:")
    print(f"  no ledger (ask, keep nothing)      {t_plain:7.3f} s")
    print(f"  first run (ask all, commit each)   {t_ask:7.3f} s   ledger overhead {1e6*(t_ask-t_plain)/10_000:.0f} us/request")
    print(f"  rerun (all 10,000 from the ledger) {t_cached:7.3f} s   {t_ask/t_cached:.1f}x faster than the first run")


if __name__ == "__main__":
    main()
