"""The project's error types. Every failure a user can cause raises one of these."""


class DdtreeError(Exception):
    """Base class of every error ddtree-gen raises on purpose."""


class SpecError(DdtreeError, ValueError):
    """A spec file is malformed or asks for something the generator cannot serve."""


class KdtrError(DdtreeError, ValueError):
    """A KDTR reference bundle is malformed, truncated, corrupted or of another version."""


class BuildError(DdtreeError):
    """Rendering or compiling a variant failed."""


class ArgumentError(DdtreeError, ValueError):
    """A launcher (or reference) argument has the wrong shape, dtype, device or value."""
