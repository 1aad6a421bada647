"""`make demo`: the README's quickstart, word for word, end to end.

The commands are read from the README's quickstart block, so the demo and the documentation cannot
drift apart (`tests/test_quickstart.py` runs this script too). `--out DIR` writes the plans under
DIR instead of `plans/`.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quickstart_commands(readme: Path = ROOT / "README.md") -> list[str]:
    """The `$ dapple ...` lines of the first console block after the Quickstart heading."""
    text = readme.read_text()
    section = text.split("## Quickstart", 1)[1]
    block = re.search(r"```console\n(.*?)```", section, flags=re.S)
    if block is None:
        raise SystemExit("README.md has no console block under '## Quickstart'")
    return [line[2:] for line in block.group(1).splitlines() if line.startswith("$ ")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="plans", help="directory for the plans (default: plans/)")
    args = parser.parse_args(argv)
    out = args.out.rstrip("/")
    for command in quickstart_commands():
        words = [w.replace("plans/", f"{out}/", 1) if w.startswith("plans/") else w for w in shlex.split(command)]
        assert words[0] == "dapple", command
        shown = " ".join(shlex.quote(w) for w in words)
        print(f"\n$ {shown}", flush=True)
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "dapple_ir.cli", *words[1:]], cwd=ROOT)
        print(f"[{time.perf_counter() - start:.1f} s]", flush=True)
        if result.returncode != 0:
            print(f"demo: `{shown}` failed with exit status {result.returncode}", file=sys.stderr)
            return result.returncode
    pictures = sorted(str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in Path(ROOT, out).rglob("*.png"))
    print("\nDemo done. Pictures:" if pictures else "\nDemo done.")
    for picture in pictures:
        print(f"  {picture}")
    print(f"Plans, reports and traces are under {out}/ (report.txt, plan.dapple, timeline.json).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
