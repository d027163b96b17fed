from calc import add, mul


def test_add() -> None:
    assert add(2, 3) == 5


def test_mul() -> None:
    assert mul(2, 3) == 6


def test_mul_by_zero() -> None:
    assert mul(0, 7) == 0
