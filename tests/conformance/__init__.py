"""Guarantees every recipe owes its users, tested over every recipe that offers the flag they concern."""
