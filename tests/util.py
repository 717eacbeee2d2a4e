"""Small helpers shared by the component and integration tests."""
import contextlib
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
