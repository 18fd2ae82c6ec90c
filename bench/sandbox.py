"""Sandbox latency and throughput: the warm pool vs a naive `subprocess.run([python, "-c", code])`.

Both run the same small test program — a solution plus assert-style tests — and both are measured in
the same run, interleaved in blocks so that a change in machine load hits both alike. The pool goes
through exactly the path verification uses: `SandboxPool.run(SandboxSpec(code, epilogue=tests))` with
the full isolation of the tier (namespaces, cgroup, rlimits, scrubbed environment, a fresh process and
work directory per execution, the authenticated report). The naive baseline isolates nothing.

Both sides get the same concurrency: `--concurrency N` runs N executions at a time on each side (N
threads; the pool has N warm zygotes). With 1 (the default) each side runs one execution after the
other; the pool's zygote still prepares the next sandbox while one runs — that is the design.

Then a runtime (`--runtime numpy`, `--runtime ''` to skip): its image's first (cold) build into a fresh
image root, warm executions of a numpy solution and its numpy tests in that runtime (numpy preloaded in the
zygote) next to the plain runtime's, the same program as a naive `python -c` of the image's interpreter
(which imports numpy every time), and a second domain (other tests, another pool: another worker) naming
the same runtime, which finds the image built: builds stay 1, and the reuse rate is executions per build.

    python bench/sandbox.py [--pool-runs 400] [--naive-runs 40] [--concurrency 1] [--runtime numpy]

Ends with one line: `result: pool_p50_ms=… pool_p95_ms=… … throughput_ratio=… concurrency=… tier=…
runtime=numpy runtime_p50_ms=… runtime_cold_build_s=… runtime_naive_p50_ms=… reuse_rate=…`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandboxes import SandboxPool, SandboxSpec, runtimes

SOLUTION = """\
def fizzbuzz(n):
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)
"""
TESTS = """\
assert fizzbuzz(1) == "1"
assert fizzbuzz(3) == "Fizz"
assert fizzbuzz(10) == "Buzz"
assert [fizzbuzz(i) for i in range(1, 16)][-1] == "FizzBuzz"
"""


NUMPY_DOMAINS = {
    "normalize": ("import numpy as np\ndef normalize(v):\n    return v / np.linalg.norm(v)\n",
                  "import numpy as np\nassert np.allclose(normalize(np.array([3.0, 4.0])), [0.6, 0.8])\n"
                  "assert np.isclose(np.linalg.norm(normalize(np.arange(1.0, 5.0))), 1.0)\n"),
    "matrices": ("import numpy as np\ndef gram(a):\n    return a.T @ a\n",
                 "import numpy as np\nassert np.array_equal(gram(np.eye(3)), np.eye(3))\n"
                 "assert gram(np.arange(6.0).reshape(2, 3)).shape == (3, 3)\n"),
}


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and of its reaped children (the zygote and every sandbox it forked)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_block(n: int, concurrency: int, one: Callable[[], None], latencies: list[float]) -> float:
    """Run `one` n times, `concurrency` at a time; append each latency; return the block's wall time."""

    def timed(_: int) -> None:
        t = time.perf_counter()
        one()
        latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    if concurrency == 1:
        for i in range(n):
            timed(i)
    else:
        with ThreadPoolExecutor(concurrency) as executor:
            list(executor.map(timed, range(n)))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-runs", type=int, default=400)
    parser.add_argument("--naive-runs", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=8, help="interleaved blocks of pool and naive runs")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="executions at a time, on each side (the pool gets this many zygotes)")
    parser.add_argument("--runtime", default="numpy", help="a runtime to measure against the plain one ('' skips)")
    parser.add_argument("--runtime-runs", type=int, default=200, help="executions per domain in the runtime")
    args = parser.parse_args()
    concurrency = max(1, args.concurrency)

    spec = SandboxSpec(code=SOLUTION, epilogue=TESTS)
    naive_argv = [sys.executable, "-c", SOLUTION + TESTS]
    pool_latencies: list[float] = []
    naive_latencies: list[float] = []
    pool_busy = naive_busy = 0.0
    pool_cpu = pool_owner_cpu = naive_cpu = 0.0  # CPU seconds spent by the zygote tree / this process on pool runs

    def pooled() -> None:
        result = pool.run(spec)
        if not result.passed:
            raise SystemExit(f"the pool gave a wrong verdict: {result.to_dict()}")

    def naive() -> None:
        subprocess.run(naive_argv, check=True, capture_output=True)

    with SandboxPool(size=concurrency) as pool:
        run_block(20 * concurrency, concurrency, pooled, [])  # warm-up (page cache, every zygote's standbys)
        subprocess.run(naive_argv, check=True)
        for block in range(args.blocks):
            n_pool = args.pool_runs // args.blocks + (block < args.pool_runs % args.blocks)
            n_naive = args.naive_runs // args.blocks + (block < args.naive_runs % args.blocks)
            zygotes_before = sum(tree_cpu_seconds(z) for z in pool.zygote_pids)
            own_before = own_cpu_seconds()
            pool_busy += run_block(n_pool, concurrency, pooled, pool_latencies)
            time.sleep(0.05)  # let the zygote reap and clean up after the block's last execution
            pool_cpu += sum(tree_cpu_seconds(z) for z in pool.zygote_pids) - zygotes_before
            pool_owner_cpu += own_cpu_seconds() - own_before
            children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
            naive_busy += run_block(n_naive, concurrency, naive, naive_latencies)
            children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
            naive_cpu += (children_after.ru_utime + children_after.ru_stime
                          - children_before.ru_utime - children_before.ru_stime)
        stats = pool.stats()
        tier = pool.tier or "unknown"

    pool_eps = len(pool_latencies) / pool_busy
    naive_eps = len(naive_latencies) / naive_busy
    ratio = pool_eps / naive_eps
    rows = [
        ("warm pool (isolated)", pool_latencies, pool_eps),
        ("naive subprocess.run", naive_latencies, naive_eps),
    ]
    print(f"sandbox benchmark — tier {tier}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'path':<22} {'at once':>7} {'runs':>6} {'p50 ms':>9} {'p95 ms':>9} {'mean ms':>9} {'exec/s':>9}")
    for name, latencies, eps in rows:
        print(f"{name:<22} {concurrency:>7} {len(latencies):>6} {percentile(latencies, 0.5) * 1e3:>9.2f} "
              f"{percentile(latencies, 0.95) * 1e3:>9.2f} {statistics.fmean(latencies) * 1e3:>9.2f} {eps:>9.1f}")
    cpu_ms = (pool_cpu + pool_owner_cpu) / len(pool_latencies) * 1e3
    print(f"pool CPU per execution: {cpu_ms:.2f} ms (zygote and sandboxes "
          f"{pool_cpu / len(pool_latencies) * 1e3:.2f} ms, owner {pool_owner_cpu / len(pool_latencies) * 1e3:.2f} ms); "
          f"naive: {naive_cpu / len(naive_latencies) * 1e3:.2f} ms")
    print(f"throughput ratio (pool / naive): {ratio:.1f}x; pool start latency p50 "
          f"{stats['start_latency_p50_ms']:.2f} ms, warm hits {stats['warm_hits']}, cold starts "
          f"{stats['cold_starts']}, failures {stats['failures']}")
    extra = ""
    if args.runtime:
        rt = runtime_bench(args.runtime, args.runtime_runs, percentile(pool_latencies, 0.5))
        extra = (f" runtime={args.runtime} runtime_p50_ms={rt['p50_ms']:.2f} runtime_p95_ms={rt['p95_ms']:.2f} "
                 f"runtime_cold_build_s={rt['cold_build_s']:.1f} runtime_naive_p50_ms={rt['naive_p50_ms']:.1f} "
                 f"second_domain_builds={rt['second_builds']} reuse_rate={rt['reuse_rate']:.0f}")
    print(
        "result: "
        f"pool_p50_ms={percentile(pool_latencies, 0.5) * 1e3:.2f} "
        f"pool_p95_ms={percentile(pool_latencies, 0.95) * 1e3:.2f} "
        f"pool_eps={pool_eps:.1f} "
        f"naive_p50_ms={percentile(naive_latencies, 0.5) * 1e3:.2f} "
        f"naive_p95_ms={percentile(naive_latencies, 0.95) * 1e3:.2f} "
        f"naive_eps={naive_eps:.1f} "
        f"throughput_ratio={ratio:.1f} "
        f"start_p50_ms={stats['start_latency_p50_ms']:.2f} "
        f"pool_cpu_ms_per_exec={cpu_ms:.2f} "
        f"naive_cpu_ms_per_exec={naive_cpu / len(naive_latencies) * 1e3:.2f} "
        f"concurrency={concurrency} "
        f"tier={tier}"
        f"{extra}"
    )


def runtime_bench(name: str, runs: int, plain_p50: float) -> dict[str, float]:
    """The runtime's cold build (into a fresh image root), its warm p50, a naive start, a second domain."""
    definition = runtimes.get(name)
    root = runtimes.images_root().parent / "bench-runtimes" / str(os.getpid())
    os.environ["TEMPER_RUNTIMES_ROOT"] = str(root)
    try:
        started = time.perf_counter()
        image, built = runtimes.ensure_image(definition)
        cold_build = time.perf_counter() - started
        assert built
        (code_a, tests_a), (code_b, tests_b) = NUMPY_DOMAINS.values()
        latencies: list[float] = []
        with SandboxPool(size=1) as first:  # a verify worker judging domain "normalize"
            spec = SandboxSpec(code=code_a, epilogue=tests_a, runtime=name)

            def one() -> None:
                if not first.run(spec).passed:
                    raise SystemExit(f"the {name} runtime gave a wrong verdict")
            run_block(20, 1, one, [])  # warm-up: the runtime's zygote starts (a cold start) here
            run_block(runs, 1, one, latencies)
            a = first.stats()["runtimes_stats"][name]
        with SandboxPool(size=1) as second:  # another worker, domain "matrices", the same runtime
            spec_b = SandboxSpec(code=code_b, epilogue=tests_b, runtime=name)
            for _ in range(runs):
                if not second.run(spec_b).passed:
                    raise SystemExit(f"the {name} runtime gave a wrong verdict (second domain)")
            b = second.stats()["runtimes_stats"][name]
        naive: list[float] = []
        argv = [image.python, "-I", "-c", code_a + tests_a]
        run_block(20, 1, lambda: subprocess.run(argv, check=True, capture_output=True), naive)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    builds = a["image_builds"] + b["image_builds"] + 1  # + the cold build above
    executions = a["executions"] + b["executions"]
    out = {"p50_ms": percentile(latencies, 0.5) * 1e3, "p95_ms": percentile(latencies, 0.95) * 1e3,
           "cold_build_s": cold_build, "naive_p50_ms": percentile(naive, 0.5) * 1e3,
           "second_builds": b["image_builds"], "reuse_rate": executions / builds}
    print(f"runtime {name} ({', '.join(definition.packages)}; preload {', '.join(definition.preload) or '-'}): "
          f"cold build {cold_build:.1f} s, image {image.size_bytes / 1e6:.0f} MB")
    print(f"{'path':<34} {'runs':>6} {'p50 ms':>9} {'p95 ms':>9}")
    print(f"{'plain runtime (fizzbuzz, above)':<34} {'':>6} {plain_p50 * 1e3:>9.2f}")
    print(f"{name + ' runtime, warm (numpy tests)':<34} {len(latencies):>6} {out['p50_ms']:>9.2f} {out['p95_ms']:>9.2f}")
    print(f"{'naive python -c from the image':<34} {len(naive):>6} {out['naive_p50_ms']:>9.2f} "
          f"{percentile(naive, 0.95) * 1e3:>9.2f}")
    print(f"domain normalize: {a['executions']} executions, cold starts {a['cold_starts']}, builds 0 (built above); "
          f"domain matrices (another pool): {b['executions']} executions, image builds {b['image_builds']}, cache hits "
          f"{b['image_cache_hits']}; reuse rate {out['reuse_rate']:.0f} executions per build")
    return out


if __name__ == "__main__":
    main()
