"""The package version (read by pyproject.toml at build time and exported as `functional_state.__version__`)."""

__version__ = "0.2.0"
