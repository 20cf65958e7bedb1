"""The source distribution: everything `make test` needs, a LICENSE, one version."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import gravac

ROOT = Path(__file__).resolve().parent.parent
SDIST_TIMEOUT = 300
#: What a checkout holds that is not source: built or installed here, never part of the sdist's
#: input (setuptools would reuse a stale *.egg-info/SOURCES.txt as the manifest).
NOT_SOURCE = (".git", ".venv", "*.egg-info", "build", "dist", "runs", "__pycache__", ".*_cache")


@pytest.mark.slow
def test_sdist_holds_tests_examples_and_license(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    build = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)],
        cwd=src,
        capture_output=True,
        text=True,
        check=True,
        timeout=SDIST_TIMEOUT,
    )
    name = out.stdout.strip().splitlines()[-1]
    assert name == f"gravac-{gravac.__version__}.tar.gz"  # the version lives in one place
    with tarfile.open(tmp_path / name) as tar:
        top = f"gravac-{gravac.__version__}/"
        members = {m.name.removeprefix(top) for m in tar.getmembers()}
    wanted = {
        *(
            str(p.relative_to(ROOT))
            for d in ("tests", "examples", "gravac")
            for p in (ROOT / d).rglob("*.py")
        ),
        *(str(p.relative_to(ROOT)) for p in (ROOT / "gravac/kernels/cuda").iterdir()),
        "LICENSE",
        "Makefile",
        "README.md",
        ".ci/run",
        "benchmarks/README.md",
    }
    assert not wanted - members, f"missing from the sdist: {sorted(wanted - members)}"
