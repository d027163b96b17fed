"""A tiny calculator with a bug for the candidates to fix: ``mul`` adds."""


def add(a: int, b: int) -> int:
    return a + b


def mul(a: int, b: int) -> int:
    return a + b
