"""Limits, plans, strict budgets, reservation holds across the fleet and threshold alerts."""
