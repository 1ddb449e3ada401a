"""Reference implementations: the single source of the exercises (see CONTRIBUTING.md)."""
