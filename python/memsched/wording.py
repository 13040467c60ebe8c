"""Counted nouns in messages and reports: counted(1, "storage") -> '1 storage', counted(2, "storage") ->
'2 storages'. One helper, so that a report never reads "1 storages" or "3 step(s)".

Entry point: counted(n, noun, plural=None).
"""


def counted(n, noun, plural=None):
    """'n noun' with the noun in the plural unless n == 1 (plural: the irregular form, default noun + 's')."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
