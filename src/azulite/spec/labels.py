"""Kubernetes label (and taint) keys and values, as the API server checks them (apimachinery's
``IsQualifiedName`` and ``IsValidLabelValue``): a key is an optional DNS subdomain prefix (at most 253
characters) and '/', then a name of at most 63 characters, alphanumeric at both ends with '-', '_', '.'
between; a value is empty or such a name. ``az aks nodepool add --labels/--node-taints`` passes them on, so
one that breaks the rule fails there, after the pools before it were made."""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
RULE = ("letters, digits, '-', '_' and '.' (a letter or digit at each end), at most 63 characters; a key may "
        "start with a DNS prefix and '/', e.g. example.com/team")


def key_problem(key: object) -> str | None:
    """Why ``key`` cannot be a label or taint key (None when it can)."""
    if not isinstance(key, str):
        return f"{key!r} is not text"
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _PREFIX.fullmatch(prefix)):
        return f"{key!r} has a prefix that is not a DNS subdomain"
    if not _NAME.fullmatch(name):
        return f"{key!r} is not a Kubernetes label key"
    return None


def value_problem(value: object) -> str | None:
    """Why ``value`` cannot be a label or taint value (None when it can)."""
    if not isinstance(value, str):
        return f"{value!r} is not text"
    if value and not _NAME.fullmatch(value):
        return f"{value!r} is not a Kubernetes label value"
    return None
