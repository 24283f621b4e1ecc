"""The ``gradkit`` command."""
