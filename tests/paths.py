"""Where the tests find the repository and the shared profiles (`../shared/profiles` beside the checkout)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT.parent / "shared" / "profiles"
PROFILE_FILES = sorted(PROFILES.glob("*.txt"))
