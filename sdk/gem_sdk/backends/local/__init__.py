"""The local backend: jobs run as processes on this machine, their state kept under a root dir."""

from gem_sdk.backends.local.backend import LocalBackend

__all__ = ["LocalBackend"]
