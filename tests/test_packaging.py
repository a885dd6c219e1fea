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


def test_the_protocol_package_does_not_import_numpy():
    # lmsp_min knows nothing of numpy: the client, the CLI's parsing and the server's
    # modules import without it; only loading a model brings in the engine.
    code = ("import sys, lmsp_min.app, lmsp_min.cli, lmsp_min.client, lmsp_min.service, lmsp_min.tasks; "
            "print(sorted(m for m in sys.modules if m == 'numpy' or m.startswith('engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
