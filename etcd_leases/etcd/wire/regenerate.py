"""Regenerate the protobuf modules from ``etcd_leases_wire.proto``.

Run from anywhere with grpcio-tools and mypy-protobuf installed (the ``dev`` extra)::

    python -m etcd_leases.etcd.wire.regenerate
"""

import sys
from pathlib import Path

from grpc_tools import protoc


def main() -> None:
    root = Path(__file__).resolve().parents[3]
    proto = Path(__file__).with_name("etcd_leases_wire.proto").relative_to(root)
    mypy_plugin = Path(sys.executable).with_name("protoc-gen-mypy")
    args = [
        "protoc",
        f"--plugin=protoc-gen-mypy={mypy_plugin}",
        f"-I{root}",
        f"--python_out={root}",
        f"--mypy_out={root}",
        str(proto),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    main()
