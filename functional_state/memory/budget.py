"""Byte budgets: sizes written as people write them, and budgets per memory pool.

A budget maps pools, named as `stats()` names them (``"cuda:0"``, ``"cpu"``, ``"cpu/pinned_host"``), to the
bytes they may hold; ``"*"`` stands for every device pool (the ones without a ``/`` memory kind). An int or a
size string alone is a ``"*"`` budget. Budgets are config, set once per table; no environment variable
carries them (the spec keeps environment overrides for the A/B flag and the stress-test cap).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from ..errors import InvalidArgumentError, InvalidTypeError
from .pools import ANY_DEVICE, POOL_FORMS, POOL_PATTERN, Pool

__all__ = [
    "ANY_DEVICE",
    "POOL_FORMS",
    "POOL_PATTERN",
    "Budget",
    "capacity_for",
    "limit_for",
    "normalize_budget",
    "parse_bytes",
]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([a-zA-Z]*)\s*$")
MAX_BYTES = 2**63 - 1  # the largest size a pool can report (a signed 64-bit count); anything above is a typo


# Kept rather than humanize.naturalsize(binary=True) and pydantic.ByteSize (issue 23): humanize is no core
# dependency (only orbax's, in the checkpoint extra), costs ~50 ms to import and ~13x per call, and writes
# "1 Byte"/"3.0 GiB"; ByteSize parses through float (int(float(scalar) * unit)), so it rounds 2**53 + 1 and
# reads "0.5 B" as 0 where `parse_bytes` is exact and refuses fractional bytes.
_LARGE = ((2**60, "EiB"), (2**50, "PiB"), (2**40, "TiB"), (2**30, "GiB"))


def format_bytes(n: int) -> str:
    """A byte count for people, in binary units (the inverse of `parse_bytes`, to one decimal; two from GiB).

    Example:
      >>> format_bytes(1536), format_bytes(3 * 2**30), format_bytes(2**63 - 1)
      ('1.5 KiB', '3.00 GiB', '8.00 EiB')
    """
    for size, unit in _LARGE:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def parse_bytes(value: Any, what: str = "parse_bytes") -> int:
    """Bytes from an int or a size string: ``"40GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"4096"``.

    Binary units (KiB, MiB, GiB, TiB, and K, M, G, T) are powers of 1024; decimal ones (kB, MB, GB, TB)
    powers of 1000.

    Sizes are read exactly (no floating point): ``"9007199254740993"`` is that many bytes.

    Raises:
      InvalidArgumentError: negative, fractional bytes, an unknown unit, more than 2**63 - 1 bytes, or not a
        size at all.

    Example:
      >>> parse_bytes("40GiB"), parse_bytes("1.5 MB"), parse_bytes(4096)
      (42949672960, 1500000, 4096)
    """
    if isinstance(value, bool):
        raise InvalidArgumentError(f"`{what}`: expected a byte count or a size like '40GiB', got {value!r}.")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgumentError(f"`{what}`: a size cannot be negative, got {value}.")
        return _at_most_max(value, value, what)
    if isinstance(value, str):
        if len(value) > 64:  # no size is written this long (and int() of thousands of digits is slow)
            raise InvalidArgumentError(
                f"`{what}`: {_shown(value)} is too long to be a size; sizes are at most 2**63 - 1 bytes (8 EiB)."
            )
        match = _SIZE.match(value)
        unit = match.group(3).lower() if match else None
        if match and unit in _UNITS:
            whole, frac = match.group(1), match.group(2) or ""
            # Exact arithmetic: a float would round "9007199254740993" and overflow on 400 digits.
            nbytes = (int(whole) + Fraction(int(frac or "0"), 10 ** len(frac))) * _UNITS[unit]
            if nbytes.denominator == 1:
                return _at_most_max(int(nbytes), value, what)
        raise InvalidArgumentError(
            f"`{what}`: cannot read {_shown(value)} as a size; write a byte count or a number and a unit, e.g. '40GiB', "
            f"'512 MiB', '1.5GB' (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB; whole bytes only)."
        )
    raise InvalidArgumentError(f"`{what}`: expected a byte count or a size like '40GiB', got {type(value).__name__}.")


def _at_most_max(nbytes: int, value: Any, what: str) -> int:
    if nbytes > MAX_BYTES:
        raise InvalidArgumentError(
            f"`{what}`: {_shown(value)} is more than 2**63 - 1 bytes (8 EiB), the largest size a pool can hold; "
            f"check the number and its unit."
        )
    return nbytes


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 48 else f"{text[:24]}... ({len(text)} characters)"


def normalize_budget(budget: Any, what: str = "byte_budget") -> dict[str, int] | None:
    """A budget as ``{pool: bytes}``; None for no budget. An int or size string alone applies to every
    device pool (key ``"*"``).

    Raises:
      InvalidArgumentError: a pool name `stats()` would never report (``"cpu:0"``, ``"gpu:0"``,
        ``"cuda:0/pinned_host"``: host memory kinds exist only under ``"cpu"``), or a size that is not one.

    Example:
      >>> normalize_budget({"cuda:0": "40GiB", "cpu/pinned_host": "64GiB"})
      {'cpu/pinned_host': 68719476736, 'cuda:0': 42949672960}
      >>> normalize_budget(1024)
      {'*': 1024}
    """
    if budget is None:
        return None
    if isinstance(budget, (int, str)) and not isinstance(budget, bool):
        return {ANY_DEVICE: parse_bytes(budget, what)}
    if not isinstance(budget, Mapping):
        raise InvalidArgumentError(
            f"`{what}`: a budget is a size, or a mapping of pools to sizes such as {{'cuda:0': '40GiB'}}; got "
            f"{type(budget).__name__}."
        )
    out = {}
    for pool, size in budget.items():
        if pool != ANY_DEVICE and (not isinstance(pool, str) or not POOL_PATTERN.match(pool)):
            raise InvalidArgumentError(
                f"`{what}`: unknown pool {pool!r}; stats() never reports it, so its budget would never be "
                f"enforced. Name pools as stats() does: {POOL_FORMS}, or '*' for every device pool."
            )
        out[pool] = parse_bytes(size, f"{what}[{pool!r}]")
    return Budget(sorted(out.items()))


class Budget(dict[str, int]):
    """A normalized budget, ``{pool: bytes}``, that refuses to be changed in place.

    A table's budget is part of its immutable state: `stats()` and ``ManagerState.byte_budget`` hand out this
    very object, and the shell's fast budget check recognises a budget by identity. A dict changed in place
    would change a state that is meant to be immutable, and the check would keep its old answer. A new budget
    takes a new table (``ManagerState.create``, or loading one). A ``Budget`` is a ``dict`` to readers: JSON,
    equality and repr are a dict's; a copy (``dict(budget)``) can be changed freely.
    """

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidTypeError(
            "a table's byte budget cannot be changed in place (it is part of the immutable table state); "
            "create a table with the new budget, or change a copy: dict(budget)."
        )

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        return (Budget, (dict(self),))  # (the default would rebuild it item by item, through __setitem__)

    def __copy__(self) -> Budget:
        return self

    def __deepcopy__(self, memo: Any) -> Budget:
        return self


def limit_for(budget: Mapping[str, int] | None, pool: Pool) -> int | None:
    """The bytes ``pool`` may hold under a normalized ``budget`` (``"*"`` covers each device pool), or None.

    Example:
      >>> budget = normalize_budget({"*": "1GiB", "cpu/pinned_host": 1024})
      >>> limit_for(budget, Pool("cuda:0")), limit_for(budget, Pool("cpu", "pinned_host"))
      (1073741824, 1024)
      >>> limit_for(budget, Pool("cpu", "unpinned_host")) is None
      True
    """
    if not budget:
        return None
    limit = budget.get(pool.name)
    if limit is None and pool.memory_kind is None:  # a device pool
        limit = budget.get(ANY_DEVICE)
    return limit


def capacity_for(budget: Any, bytes_per_session: Any) -> int:
    """How many sessions of ``bytes_per_session`` fit in ``budget``: a count a runner can publish into
    `raise_max_sessions` (which only ever raises the cap). At least 1.

    Raises:
      InvalidArgumentError: a size that is not one, or a non-positive session size.

    Example:
      >>> capacity_for("40GiB", "627.5MiB")
      65
    """
    total = parse_bytes(budget, "capacity_for(budget)")
    per = parse_bytes(bytes_per_session, "capacity_for(bytes_per_session)")
    if per <= 0:
        raise InvalidArgumentError(f"`capacity_for`: bytes_per_session must be positive, got {per}.")
    return max(1, total // per)
