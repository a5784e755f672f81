"""Test-wide set-up: quiet TensorFlow on machines without a GPU."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def pytest_terminal_summary(terminalreporter):
    """Lines a test asked to show at the end of the run, through
    ``record_property("terminal_summary", line)`` (the bad-input matrix size)."""
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "call":
                continue
            for name, value in getattr(report, "user_properties", ()):
                if name == "terminal_summary":
                    terminalreporter.write_line(str(value))
