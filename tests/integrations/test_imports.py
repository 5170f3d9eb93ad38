"""Importing trainguard (the integrations package included) imports no training framework."""

from __future__ import annotations

import subprocess
import sys


def test_the_integrations_package_imports_no_framework() -> None:
    code = (
        "import sys\n"
        "import trainguard, trainguard.integrations\n"
        "loaded = {'lightning', 'pytorch_lightning', 'transformers', 'accelerate', 'torch'}\n"
        "assert not loaded & set(sys.modules), loaded & set(sys.modules)\n"
        "assert trainguard.integrations.__all__ == []\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
