"""`arbiter package-model` and `arbiter deploy`.

Imports stay light: ``adapter.cli`` imports this module to build the parser.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def cmd_package_model(args: argparse.Namespace) -> int:
    from adapter.model_package import PackageError, package_model

    try:
        package = package_model(
            Path(args.gguf),
            Path(args.out),
            expected_sha256=args.expected_sha256,
            source=args.source,
            revision=args.revision,
        )
    except PackageError as exc:
        print(f"arbiter package-model: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(package.manifest, indent=2), file=sys.stderr)
    print(f"wrote {package.archive} ({package.bytes} bytes)", file=sys.stderr)
    # sha256sum's format, so `sha256sum -c` can check the archive after a copy.
    print(f"{package.sha256}  {package.archive}")
    return 0


def register(sub: Any) -> None:
    """Add ``package-model`` and ``deploy`` to the ``arbiter`` parser."""
    pkg = sub.add_parser(
        "package-model",
        help="write model.tar.gz: a GGUF and its checksum manifest, for SageMaker and the workers",
    )
    pkg.add_argument("--gguf", required=True, help="the .gguf file to package")
    pkg.add_argument("--out", required=True, help="archive to write (.tar.gz; never overwritten)")
    pkg.add_argument(
        "--expected-sha256", default=None, help="stop unless the GGUF has this sha256 (hex)"
    )
    pkg.add_argument(
        "--source", default=None, help="where the GGUF came from (URL); with --revision"
    )
    pkg.add_argument("--revision", default=None, help="the source's revision (commit, tag)")
    pkg.set_defaults(func=cmd_package_model)
