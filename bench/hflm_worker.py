"""lm-eval's HFLM loglikelihood, timed, for bench/bench.py: runs in the side venv (.venv-harness, `make harness-env`).

    .venv-harness/bin/python bench/hflm_worker.py REQUESTS.json

REQUESTS.json: {"model": DIR, "threads": N or null, "jobs": {NAME: [[context, [continuation, ...]], ...], ...}}. The
worker loads the model once (HFLM, batch size 1: its default), prints `ready`, then for every `run NAME` line on stdin
scores every prompt of that job (one loglikelihood request per continuation, as lm-eval's multiple-choice tasks do)
and prints one JSON line: {"seconds": wall time, "answers": [the best continuation per prompt]}. `quit` (or end of
input) ends it.
"""
import json, sys, time


def main(path):
    spec = json.load(open(path))
    import torch
    if spec.get("threads"): torch.set_num_threads(int(spec["threads"]))
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    lm = HFLM(pretrained=spec["model"], batch_size=1, device="cpu", dtype="float32")
    jobs = {}
    for name, prompts in spec["jobs"].items():
        reqs, owner = [], []
        for p, (context, conts) in enumerate(prompts):
            for k in conts:
                reqs.append(Instance(request_type="loglikelihood", doc={}, arguments=(context, k), idx=len(reqs)))
                owner.append((p, k))
        jobs[name] = (reqs, owner, len(prompts))
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, name = line.strip().partition(" ")
        if cmd != "run" or name not in jobs: break
        reqs, owner, n = jobs[name]
        t0 = time.perf_counter()
        out = lm.loglikelihood(reqs, disable_tqdm=True)
        dt = time.perf_counter() - t0
        best = {}
        for (p, k), (lp, _) in zip(owner, out):
            if p not in best or lp > best[p][1]: best[p] = (k, lp)
        print(json.dumps({"seconds": dt, "answers": [best[p][0] for p in range(n)]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
