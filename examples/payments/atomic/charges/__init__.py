"""The atomic payments example: orders, their charges, and the task that charges them."""
