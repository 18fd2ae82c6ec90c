"""Run one sandbox execution by hand and print the result as JSON.

    python -m sandboxes 'print(1)'
    python -m sandboxes --epilogue 'assert add(1, 2) == 3' 'def add(a, b): return a + b'
    python -m sandboxes --file solution.py --wall 2 --command bash test.sh
    python -m sandboxes --runtime numpy 'import numpy; print(numpy.ones(3).sum())'
"""

from __future__ import annotations

import argparse
import json
import sys

from sandboxes import Limits, SandboxPool, SandboxSpec, probe_tier


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandboxes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("code", nargs="?", help="Python source to run (or use --file, or '-' for stdin)")
    parser.add_argument("--file", help="read the code from this file")
    parser.add_argument("--epilogue", help="trusted Python run after the code (assert-style tests)")
    parser.add_argument("--input", action="append", default=[], metavar="NAME=PATH",
                        help="a read-only input file placed in the work directory")
    parser.add_argument("--artifact", action="append", default=[], help="glob of files to collect")
    parser.add_argument("--wall", type=float, default=10.0, help="wall-clock limit in seconds")
    parser.add_argument("--cpu", type=float, default=5.0, help="CPU-time limit in seconds")
    parser.add_argument("--memory-mb", type=int, default=512, help="memory limit in MiB")
    parser.add_argument("--command", nargs=argparse.REMAINDER, help="argv to run after the code")
    parser.add_argument("--runtime", default="python",
                        help="the runtime to run in (runtimes/*.toml; its image is built first if need be)")
    parser.add_argument("--tier", action="store_true", help="only print the isolation tier")
    args = parser.parse_args(argv)

    if args.tier:
        print(probe_tier())
        return 0
    if args.file:
        with open(args.file) as f:
            code = f.read()
    elif args.code == "-":
        code = sys.stdin.read()
    elif args.code is not None:
        code = args.code
    else:
        parser.error("give the code as an argument, '-' for stdin, or --file")
    files = {}
    for item in args.input:
        name, _, path = item.partition("=")
        with open(path, "rb") as f:
            files[name] = f.read()
    spec = SandboxSpec(
        code=code,
        files=files,
        artifacts=tuple(args.artifact),
        epilogue=args.epilogue,
        command=args.command or None,
        limits=Limits(wall_seconds=args.wall, cpu_seconds=args.cpu, memory_bytes=args.memory_mb << 20),
        runtime=args.runtime,
    )
    with SandboxPool(size=1) as pool:
        result = pool.run(spec)
    print(json.dumps(result.to_dict(), indent=2))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
