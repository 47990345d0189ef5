"""Throughput of the API backend against a server with a fixed per-request latency.

The reference notebooks sent one request at a time; `OpenAIBackend` keeps `concurrency` requests in flight.
The server is the mock OpenAI-compatible server in its own process (so it does not share our GIL), answering
every request after a fixed delay, like a remote model with constant latency. Prints requests/s at each
concurrency and the speedup over concurrency 1.

    python bench/bench_api.py [--delay 0.05] [--requests 128] [--concurrency 1,4,16,64]
"""
import argparse, subprocess, sys, time

from medsafe_nb.api import OpenAIBackend
from medsafe_nb.backends import GenRequest


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay", type=float, default=0.05, help="server latency per request, seconds")
    ap.add_argument("--requests", type=int, default=128, help="requests per concurrency level")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    server = subprocess.Popen([sys.executable, "-m", "medsafe_nb.mockserver", "--port", "0", "--quiet", "--delay", str(args.delay)],
                              stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split(" at ")[1].split(" ")[0]
        reqs = [GenRequest(({"role": "user", "content": f"Case {i}.\nWhich?\nA. yes\nB. no\nC. maybe"},)) for i in range(args.requests)]
        list(OpenAIBackend("mock-model", base_url=url, concurrency=1).generate(reqs[:2]))          # warm up
        print(f"API backend throughput: {args.requests} requests per level, server latency {args.delay * 1000:.0f} ms per request")
        print(f"{'concurrency':>11}  {'seconds':>8}  {'requests/s':>10}  {'speedup vs 1':>12}  {'client CPU ms/request':>21}  {'errors':>6}")
        base = None
        for c in levels:
            backend = OpenAIBackend("mock-model", base_url=url, concurrency=c)
            t0, cpu0 = time.perf_counter(), time.process_time()
            out = list(backend.generate(reqs))
            dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            rps = len(out) / dt
            base = base or rps
            errors = sum(g.finish_reason == "error" for _, g in out)
            print(f"{c:>11}  {dt:>8.2f}  {rps:>10.1f}  {rps / base:>11.1f}x  {cpu / len(out) * 1000:>21.1f}  {errors:>6}")
        print(f"(ideal at concurrency c: min(c, {args.requests}) x {1 / args.delay:.0f} requests/s; the reference ran at concurrency 1. "
              "At high concurrency the CPU of this machine (client, server and anything else running) sets the limit: "
              "compare with the client's own CPU per request.)")
    finally:
        server.terminate(); server.wait(10)


if __name__ == "__main__":
    main()
