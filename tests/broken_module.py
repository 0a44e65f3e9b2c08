"""A user's model module that cannot be imported (for the fault tests)."""

import a_package_that_is_not_installed  # noqa: F401


def build():  # pragma: no cover - never reached
    raise AssertionError("unreachable")
