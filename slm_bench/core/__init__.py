"""Foundations every other subpackage uses: errors with exit codes, project paths, atomic storage, typed configuration, and the papers' reported numbers."""
