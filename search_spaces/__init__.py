"""Search-space presets, shipped inside the package as ``autotune.search_spaces`` (see pyproject)."""
