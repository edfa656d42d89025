"""SpecError: a spec field is wrong, or names data that is missing or unusable.

Raised while a run sets up (before any training step); its message names the field and the fix.
`gem train` / `gem eval` / `gem distill` report it as a config error: exit code 2 (gem/cli.py).
"""

from __future__ import annotations


class SpecError(ValueError):
    """A config error found after the manifest parsed (e.g. data.path has no eval rows)."""
