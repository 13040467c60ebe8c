"""Importing memsched (or memsched.integrations) imports no training framework: they are optional."""
import subprocess
import sys


def test_importing_memsched_imports_no_framework():
    code = ("import sys, memsched, memsched.integrations, memsched.integrations._common; "
            "bad = [m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
