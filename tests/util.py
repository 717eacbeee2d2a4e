"""Small helpers shared by the tests."""
import contextlib
import subprocess
import sys
import time


def wait_until(fn, timeout_s=30.0, interval_s=0.1, what="condition"):
    """Poll `fn` until it returns something truthy (returned); fail with `what` and the last value otherwise."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last value: {last!r}")


@contextlib.asynccontextmanager
async def serve_app(app):
    """Runs an aiohttp `app` on a free loopback port for the `async with` block; yields its base URL."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def integrity_errors_under_python_O(module: str, consistent: str) -> tuple[int, int]:
    """Runs every corruption of `<module>.corruptions()` (pairs: what the error must name, a function that breaks
    one invariant) on a fresh `<module>.<consistent>()` in a `python -O` process, where assertions are compiled out,
    and counts the `IntegrityError`s of `check_integrity()` that name what was broken.

    Returns:
        (`sys.flags.optimize` in that process, the count); (1, len(corruptions())) when every check is a real one.
    """
    code = "\n".join([
        "import sys; sys.path.insert(0, '.')",
        "assert False, 'assertions are on'",  # compiled out under -O
        "from radix_sync.integrity import IntegrityError",
        f"from {module} import {consistent} as consistent, corruptions",
        "n = 0",
        "for needle, corrupt in corruptions():",
        "    owner = consistent()",
        "    corrupt(owner)",
        "    try:",
        "        owner.check_integrity()",
        "    except IntegrityError as exc:",
        "        n += needle in str(exc)",
        "print(sys.flags.optimize, n)",
    ])
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    optimize, count = out.stdout.split()
    return int(optimize), int(count)
