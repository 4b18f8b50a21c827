"""``python -m gpucheck prepare|rehearse|device`` (scripts/gpu-check is the front door)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gpucheck import plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__)
    parser.add_argument("mode", choices=("prepare", "rehearse", "device", "call"))
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or plan.ROOT / "gpu-check-out"),
        help="results folder (the device tool's $OUT there; ./gpu-check-out here)",
    )
    args = parser.parse_args(argv)
    if args.mode == "device":
        from gpucheck import device

        return device.run(args.out)
    from gpucheck import rehearse

    if args.mode == "prepare":
        rehearse.prepare()
        print(rehearse.device_call())
        return 0
    if args.mode == "call":
        print(rehearse.device_call())
        return 0
    return rehearse.rehearse(args.out)


if __name__ == "__main__":
    raise SystemExit(main())
