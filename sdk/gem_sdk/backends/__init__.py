"""Backends of GEMClient: `kubernetes` (a cluster with the gem operator) and `local` (processes)."""

from gem_sdk.backends.base import Backend

__all__ = ["Backend"]
