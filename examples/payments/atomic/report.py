"""``python report.py``: was every order charged exactly once?

Prints one JSON line: the orders, how many were charged once, and the orders
charged more than once or not at all (their count and the first few ids).
Exit status 1 if any order was charged twice or not at all.
"""

from __future__ import annotations

import json
import os
import sys

#: Ids shown of each list.
SHOWN = 10


def summary() -> dict[str, object]:
    from charges.models import Order
    from django.db.models import Count

    per_order = dict(Order.objects.annotate(n=Count("charges")).values_list("id", "n"))
    twice = sorted(order for order, n in per_order.items() if n > 1)
    missing = sorted(order for order, n in per_order.items() if n == 0)
    return {
        "orders": len(per_order),
        "charged_once": sum(1 for n in per_order.values() if n == 1),
        "charged_twice": len(twice),
        "missing": len(missing),
        "charged_twice_ids": twice[:SHOWN],
        "missing_ids": missing[:SHOWN],
    }


def main() -> int:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "charges.settings")
    django.setup()
    found = summary()
    print(json.dumps(found))
    return 1 if found["charged_twice"] or found["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
