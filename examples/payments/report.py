"""``python report.py``: was any order charged twice?

Prints one JSON line: the orders charged, the charges, the calls the provider
received (a second run of a charge is a call, refused), and the orders
charged more than once. Exit status 1 if any order was charged twice.
"""

from __future__ import annotations

import json
import sys

import provider


def summary() -> dict[str, object]:
    conn = provider.connect()
    try:
        per_order = conn.execute(
            "SELECT order_id, COUNT(*) FROM charges GROUP BY order_id ORDER BY order_id"
        ).fetchall()
        calls, refused = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(1 - charged), 0) FROM calls"
        ).fetchone()
    finally:
        conn.close()
    return {
        "orders": len(per_order),
        "charges": sum(n for _, n in per_order),
        "calls": calls,
        "refused": refused,
        "charged_twice": [order for order, n in per_order if n > 1],
    }


def main() -> int:
    found = summary()
    print(json.dumps(found))
    return 1 if found["charged_twice"] else 0


if __name__ == "__main__":
    sys.exit(main())
