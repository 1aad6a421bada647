"""Where the tests find the repository and the published profiles it ships (`examples/profiles`)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "examples" / "profiles"
PROFILE_FILES = sorted(PROFILES.glob("*.txt"))
