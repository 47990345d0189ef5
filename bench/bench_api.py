"""The OpenAI-compatible client against a minimal asyncio client, at concurrency 1-256.

`OpenAIBackend` keeps `concurrency` requests in flight, through the lean httpx client (the default for a `--base-url`
server) or the official `openai` SDK (`client="sdk"`). The server is the mock OpenAI-compatible server in its own
process (so it does not share our GIL), answering every request after a fixed delay, like a remote model with
constant latency. Rounds are interleaved (the order of the clients rotates each round); the table gives the
medians of requests/s and client CPU per request, and their ratios to the minimal clients. The peer the targets name is the
minimal client on the toolkit's own HTTP library, httpx2 (throughput at least 0.9x, CPU at most 1.2x); the minimal
httpx client is shown beside it.

    python bench/bench_api.py [--delay 0.05] [--rounds 5] [--concurrency 1,4,16,64,256]
"""
import argparse, asyncio, importlib, os, statistics, subprocess, sys, time

from medsafe_nb.models.openai import OpenAIBackend
from medsafe_nb.models.base import GenRequest


def api_messages(i): return [{"role": "user", "content": f"Case {i}.\nWhich?\nA. yes\nB. no\nC. maybe"}]


async def _minimal(url, n, c, lib="httpx"):
    httpx = importlib.import_module(lib)
    sem = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)   # the openai SDK's pool
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def one(i):
            async with sem:
                r = await client.post(url + "/chat/completions", json={"model": "mock-model", "messages": api_messages(i), "max_tokens": 64})
                r.raise_for_status()
                return r.json()["choices"][0]["message"]["content"]
        return await asyncio.gather(*(one(i) for i in range(n)))


def minimal_client(url, n, c): return asyncio.run(_minimal(url, n, c))
def minimal_httpx2(url, n, c): return asyncio.run(_minimal(url, n, c, "httpx2"))


def toolkit(client):
    def run(url, n, c):
        b = OpenAIBackend("mock-model", base_url=url, concurrency=c, client=client, max_new_tokens=64)
        out = list(b.generate([GenRequest(tuple(api_messages(i))) for i in range(n)]))
        bad = sum(g.finish_reason == "error" for _, g in out)
        if bad: raise RuntimeError(f"toolkit ({client}): {bad} errors")
        return out
    return run


CLIENTS = {"lean": ("toolkit, lean client (default)", toolkit("lean")), "sdk": ("toolkit, openai SDK", toolkit("sdk")),
           "minimal": ("minimal asyncio client, httpx", minimal_client),
           "minimal2": ("minimal asyncio client, httpx2", minimal_httpx2)}


def cpu_timed(fn):
    t0, c0 = time.perf_counter(), time.process_time(); fn(); return time.perf_counter() - t0, time.process_time() - c0


def measure(url, levels, rounds):
    "{(c, client): [(req/s, CPU s/request)]} over interleaved rounds"
    R = {(c, k): [] for c in levels for k in CLIENTS}
    for r in range(rounds):
        for c in levels:
            n = min(max(64, 4 * c), 1024)
            keys = list(CLIENTS)[r % len(CLIENTS):] + list(CLIENTS)[:r % len(CLIENTS)]
            for k in keys:
                dt, cpu = cpu_timed(lambda: CLIENTS[k][1](url, n, c))
                R[c, k].append((n / dt, cpu / n))
        print(f"  round {r + 1}/{rounds} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    return R


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay", type=float, default=0.05, help="server latency per request, seconds")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians are reported)")
    ap.add_argument("--concurrency", default="1,4,16,64,256", help="comma-separated levels")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    server = subprocess.Popen([sys.executable, "-m", "medsafe_nb.testing.mockserver", "--port", "0", "--quiet", "--delay", str(args.delay)],
                              stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split(" at ")[1].split(" ")[0]
        for _, fn in CLIENTS.values(): fn(url, 4, 2)                     # warm up: imports, first connections
        load0 = os.getloadavg()[0]
        R = measure(url, levels, args.rounds)
    finally:
        server.terminate(); server.wait(10)
    med = lambda xs: statistics.median(xs)
    print(f"\nOpenAI-compatible client, server latency {args.delay * 1000:.0f} ms; medians of {args.rounds} interleaved rounds; "
          f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} cores")
    print("| concurrency | client | req/s | CPU ms/req | req/s vs minimal httpx / httpx2 | CPU vs minimal httpx / httpx2 | of ideal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in levels:
        n = min(max(64, 4 * c), 1024)
        rps = {k: med([x[0] for x in R[c, k]]) for k in CLIENTS}
        cpu = {k: med([x[1] for x in R[c, k]]) for k in CLIENTS}
        ideal = min(c, n) / args.delay
        for k, (label, _) in CLIENTS.items():
            print(f"| {c} | {label} | {rps[k]:.0f} | {cpu[k] * 1000:.2f} | {rps[k] / rps['minimal']:.2f}x / {rps[k] / rps['minimal2']:.2f}x | "
                  f"{cpu[k] / cpu['minimal']:.2f}x / {cpu[k] / cpu['minimal2']:.2f}x | {rps[k] / ideal:.2f} |")


if __name__ == "__main__":
    main()
