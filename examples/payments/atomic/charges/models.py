"""An order, and a charge: one row per time the order was charged (once, if all is well)."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    cents = models.IntegerField()
    charged = models.BooleanField(default=False)


class Charge(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="charges")
    cents = models.IntegerField()
    created = models.DateTimeField(auto_now_add=True)
