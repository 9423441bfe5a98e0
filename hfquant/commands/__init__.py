"""Layer 5, what users run: `convert`, `inspection`, `verify`, `evaluation`, `cards`, `hub` and the `cli` over them.
May import every layer below; nothing below imports it."""
