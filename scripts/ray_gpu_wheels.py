"""Put into .whl/ the wheels the GPU image lacks for batchgen's GPU benches (`bench ray
--gpu`, `bench structured`): Ray, with its Java jar left out, llguidance, and the
pure-Python packages batchgen and Ray import that the image does not have. Run on a dev machine (it needs the package index); the GPU machine installs
them with scripts/gpu_ray_bench.sh.

    python scripts/ray_gpu_wheels.py            # then: du -sh .whl (must stay < 64 MiB)

Why the jar goes: the device tool carries at most 64 MiB, and ray-2.60.0's cp312 wheel is
75 MiB, 31 of them `ray/jars/ray_dist.jar`, which only Java workers load. The wheel is
rewritten without it (and without its RECORD line) under the same name.

The image (python 3.12, torch 2.11) has pyarrow, pandas, numpy, fsspec, click, filelock,
msgpack, packaging, protobuf, pyyaml, requests and rich; it lacks Ray, jsonschema (Ray
needs it), llguidance (structured output) and pydantic (batchgen's job files).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

RAY = "ray==2.60.0"
PACKAGES = [
    RAY,
    # Ray's requirements the image lacks
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    # batchgen's structured output (bench structured, the grammar-constrained jobs)
    "llguidance==1.9.1",
    # batchgen's job files
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
]
PLATFORMS = [
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
]
DROPPED = "ray/jars/"


def download(target: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(target),
        *PACKAGES,
    ]
    subprocess.run(command, check=True)


def drop_java(wheel: Path) -> None:
    """Rewrite `wheel` without the entries under DROPPED (and their RECORD lines)."""
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if info.filename.startswith(DROPPED):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(x for x in lines if not x.startswith(DROPPED)).encode()
            out.writestr(info, data)
    slim.replace(wheel)


def main() -> None:
    target = Path(".whl")
    target.mkdir(exist_ok=True)
    download(target)
    (wheel,) = target.glob("ray-2.60.0-cp312-*.whl")
    drop_java(wheel)
    total = sum(p.stat().st_size for p in target.glob("*.whl"))
    print(f"{target}: {total / 2**20:.1f} MiB of wheels ({wheel.name}: slimmed)")
    if total >= 64 * 2**20:
        sys.exit("over the device tool's 64 MiB: remove other wheels from .whl/ first")


if __name__ == "__main__":
    main()
