"""The developer commands' progress lines (`kvrep_dev.report`): each command's tag, on stderr (`kvrep up`: stdout,
beside its URLs)."""
from kvrep_dev import report


def test_progress_lines_keep_each_commands_tag_and_stream(capsys):
    report.bench_progress("cluster up")
    report.copy_demo_progress("1/5: replicated")
    report.up_progress("cluster ready")
    out, err = capsys.readouterr()
    assert err == "[bench] cluster up\n[demo] 1/5: replicated\n"
    assert out == "[kvrep up] cluster ready\n"
