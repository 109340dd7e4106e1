"""Kubernetes resource quantities (``8``, ``500m``, ``16Gi``, ``1e3``) as the API server reads them
(k8s.io/apimachinery resource.Quantity): a signed decimal number and one suffix, binary (Ki Mi Gi Ti Pi Ei),
decimal (m "" k M G T P E) or a decimal exponent (e3, E-2). Anything else (``lots``, ``16GB``, ``2 cores``)
the API server refuses at apply time; a serving spec's resources are checked with this when read.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_QUANTITY = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"m": Decimal("0.001"), "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9),
            "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18)}


def parse_quantity(text: str) -> Decimal:
    """The value of a quantity (cores for CPU, bytes for memory); ValueError naming the grammar if ``text``
    is not one."""
    m = _QUANTITY.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None or text != text.strip():
        raise ValueError(f"{text!r} is not a Kubernetes quantity: a number and an optional suffix, e.g. 4, 500m "
                         "(CPU cores), 16Gi, 512Mi, 1G (memory bytes)")
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    try:
        if suffix in _BINARY:
            return number * _BINARY[suffix]
        if suffix in _DECIMAL:
            return number * _DECIMAL[suffix]
        return number * (Decimal(10) ** int(suffix[1:])) if suffix else number
    except (InvalidOperation, OverflowError):
        raise ValueError(f"{text!r} is out of range for a Kubernetes quantity") from None


def resource_quantity(text: str) -> str:
    """``text`` if it is a quantity a container can request (not negative); ValueError otherwise."""
    if parse_quantity(text) < 0:
        raise ValueError(f"{text!r} is negative: a container cannot request less than nothing")
    return text


def cores(value: Decimal) -> str:
    """A CPU amount as written back to a user (``3.86``)."""
    return f"{value.normalize():f}"


def gib(value: Decimal) -> str:
    """A memory amount in GiB (``25.6Gi``)."""
    return f"{value / 2**30:.1f}Gi"
