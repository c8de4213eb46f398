"""Orders, and the periodic report on them."""
