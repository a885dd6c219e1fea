"""The distribution installs both packages and the console script."""

import subprocess
import sys


def test_packages_import():
    import engine
    import lmsp_min

    assert lmsp_min.__version__
    assert engine.__doc__


def test_cli_help():
    out = subprocess.run(
        [sys.executable, "-m", "lmsp_min.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0
    assert "lmsp-min" in out.stdout
