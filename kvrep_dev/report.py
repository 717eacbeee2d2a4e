"""Report helpers shared by the developer commands (`kvrep_dev.bench`, `.demo`, `.up`): their progress lines,
`[<tag>] <message>`, each command's tag written here once.

The tables and the plot stay with the one command that makes each (`kvrep_dev.bench`: the bench table, the rounds
summary, the TTFT CDF PNG; `kvrep_dev.demo`: the copy-demo's medians): no two commands share a layout.
"""
from __future__ import annotations

import functools
import sys


def progress(tag: str, msg: str, *, stdout: bool = False) -> None:
    """Prints one progress line, `[<tag>] <msg>`, flushed at once: on stderr, apart from the results a command
    prints on stdout, unless `stdout`."""
    print(f"[{tag}] {msg}", file=sys.stdout if stdout else sys.stderr, flush=True)


bench_progress = functools.partial(progress, "bench")
"""`kvrep bench` and `kvrep demo` (`kvrep_dev.bench`)."""
copy_demo_progress = functools.partial(progress, "demo")
"""`kvrep copy-demo` (`kvrep_dev.demo`)."""
up_progress = functools.partial(progress, "kvrep up", stdout=True)
"""`kvrep up` (`kvrep_dev.up`): on stdout, where it prints the cluster's URLs."""
