"""Backend plugins shipped with SwiftLM (installed as ``swiftlm.backends``).

Each subpackage is registered through the ``swiftlm.backends`` entry-point group in
pyproject.toml; the core never imports them directly.
"""
