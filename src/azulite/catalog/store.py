"""Reading the catalog: the packaged data files (``data/skus.csv``, ``data/prices.csv``,
``data/discounts.toml``) plus an optional user file that adds or overrides SKUs and prices.

The user file is TOML::

    [[sku]]                       # a new SKU (all hardware fields), or an existing name with the fields to change
    name = "Standard_NC8as_T4_v3"
    cloud = "azure"
    gpus = 1
    gpu_type = "T4"
    gpu_memory_gb = 16
    vcpus = 8
    ram_gb = 56

    [[price]]                     # a price with its source; replaces a packaged or derived one
    sku = "Standard_NC8as_T4_v3"
    kind = "on_demand"
    usd_per_hour = 0.752
    source = "our EA price sheet"
    date = "2026-01-05"

Every mistake is a :class:`~azulite.errors.CatalogError` naming the file, the entry (``price[2]``) and the
field. Lookups accept ``NC24rs_v3`` for ``Standard_NC24rs_v3`` and ignore case; an unknown name raises
:class:`~azulite.errors.UnknownSku` with the nearest names.
"""

from __future__ import annotations

import csv
import datetime as dt
import difflib
import io
import re
import tomllib
from dataclasses import replace
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from azulite.catalog.model import CLOUDS, PRICE_KINDS, Price, Sku
from azulite.errors import CatalogError, UnknownSku

PriceKind = Literal["on_demand", "spot", "reserved_1y", "reserved_3y", "savings_1y", "savings_3y"]


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SkuEntry(_Entry):
    """A ``[[sku]]`` of a catalog file. Only ``name`` is required when it changes a known SKU."""

    name: str = Field(min_length=1)
    cloud: Literal["azure", "aws", "gcp"] | None = None
    gpus: int | None = Field(default=None, ge=0)
    gpu_type: str | None = None
    gpu_memory_gb: float | None = Field(default=None, ge=0)
    vcpus: int | None = Field(default=None, ge=1)
    ram_gb: float | None = Field(default=None, gt=0)
    infiniband_gbps: float | None = Field(default=None, ge=0)
    ib_links: int | None = Field(default=None, ge=0)
    spec_source: str | None = None
    notes: str | None = None
    retired: str | None = None

    @field_validator("retired", mode="before")
    @classmethod
    def _retired(cls, v: Any) -> Any:
        return _iso_date(v)


class PriceEntry(_Entry):
    """A ``[[price]]`` of a catalog file: always with its source."""

    sku: str = Field(min_length=1)
    kind: PriceKind
    usd_per_hour: float = Field(ge=0)
    source: str = Field(min_length=1)
    date: str | None = None
    region: str | None = None
    note: str | None = None

    @field_validator("date", mode="before")
    @classmethod
    def _date(cls, v: Any) -> Any:
        return _iso_date(v)


def _iso_date(v: Any) -> Any:
    # TOML's own date (date = 2026-01-05, unquoted) arrives as a datetime.date; a free-text date
    # ("last week", "05/01/26") would be printed beside the price as if it were one
    if isinstance(v, dt.date):
        return v.isoformat()
    if isinstance(v, str):
        try:
            dt.date.fromisoformat(v)
        except ValueError:
            raise ValueError("must be a date as YYYY-MM-DD, e.g. \"2026-01-05\"") from None
    return v


class _Rule(_Entry):
    kind: PriceKind
    clouds: list[Literal["azure", "aws", "gcp"]]
    off: float = Field(gt=0, lt=1)
    source: str
    date: str | None = None


_NEW_SKU_FIELDS = ("cloud", "gpus", "gpu_memory_gb", "vcpus", "ram_gb")


def _key(name: str) -> str:
    return name.lower().removeprefix("standard_")


def _rows(text: str) -> Iterable[tuple[int, dict[str, str]]]:
    """CSV rows with their 1-based line numbers, skipping ``#`` comment lines."""
    lines = text.splitlines()
    body = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(ln for _, ln in body)))
    for (lineno, _), row in zip(body[1:], reader):
        yield lineno, row


def _num(row: dict[str, str], col: str, where: str, kind: type = float) -> Any:
    raw = (row.get(col) or "").strip()
    try:
        return kind(raw)
    except ValueError:
        raise CatalogError(f"column {col!r} must be a number, got {raw!r}", where=where, fix=f"write {col} as a number") from None


def _day(row: dict[str, str], col: str, where: str) -> str | None:
    raw = (row.get(col) or "").strip()
    try:
        return dt.date.fromisoformat(raw).isoformat() if raw else None
    except ValueError:
        raise CatalogError(f"column {col!r} must be a date as YYYY-MM-DD, got {raw!r}", where=where,
                           fix=f"write {col} as e.g. 2025-09-30, or leave it empty") from None


def _pydantic_error(exc: ValidationError, where: str, model: type[BaseModel]) -> CatalogError:
    """The entry's first problem (an unknown field first: a misspelt key also shows up as the real key
    missing), with the others named after its fix, so one edit round fixes them all."""
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = _one_error(errors[0], where, model)
    unknown = [".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    others = [".".join(str(p) for p in e["loc"]) for e in errors[1:]
              # a required field missing because its name was misspelt is the same problem, said once
              if not (e["type"] == "missing" and difflib.get_close_matches(str(e["loc"][-1]), unknown, n=1))]
    if others:
        first.fix = (first.fix or "") + f"; also wrong in this entry: {', '.join(others)}"
    return first


def _one_error(err: dict, where: str, model: type[BaseModel]) -> CatalogError:
    field = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        known = list(model.model_fields)
        close = difflib.get_close_matches(field, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return CatalogError(f"unknown field {field!r}", where=where, fix=f"{hint}known fields: {', '.join(known)}")
    if err["type"] == "missing":
        return CatalogError(f"required field {field!r} is missing", where=where, fix=f"add `{field} = ...`")
    return CatalogError(f"field {field!r}: {msg} (got {err.get('input')!r})", where=where, fix=f"correct {field}")


class Catalog:
    """SKUs by name, each with its prices (stated, derived from a sourced discount, or overridden)."""

    def __init__(self, skus: Iterable[Sku]) -> None:
        self._skus: dict[str, Sku] = {}
        for s in skus:
            self._skus[_key(s.name)] = s

    # --- loading ---------------------------------------------------------------------------------------
    @classmethod
    def load(cls, override: str | Path | None = None) -> "Catalog":
        """The packaged catalog, then ``override`` (a TOML catalog file) on top."""
        data = resources.files("azulite.catalog") / "data"
        skus = cls._read_skus(data.joinpath("skus.csv").read_text(), "skus.csv")
        prices: dict[str, dict[str, Price]] = {k: {} for k in skus}
        for lineno, row in _rows(data.joinpath("prices.csv").read_text()):
            where = f"prices.csv:{lineno}"
            k = _key(row["sku"])
            if k not in skus:
                raise CatalogError(f"price for unknown SKU {row['sku']!r}", where=where)
            prices[k][row["kind"]] = Price(
                _num(row, "usd_per_hour", where), source=row["source"], date=row.get("date") or None,
                region=row.get("region") or None, note=row.get("note") or None,
            )
        rules = [_Rule.model_validate(r) for r in tomllib.loads(data.joinpath("discounts.toml").read_text())["rule"]]
        if override is not None:
            cls._apply_override(Path(override), skus, prices)
        out = []
        for k, sku in skus.items():
            p = dict(prices[k])
            base = p.get("on_demand")
            for rule in rules:
                if base is not None and rule.kind not in p and sku.cloud in rule.clouds:
                    p[rule.kind] = Price(
                        round(base.usd_per_hour * (1 - rule.off), 4), source=rule.source, date=rule.date,
                        region=base.region, derived=f"on-demand ${base.usd_per_hour:g} x (1 - {rule.off:.0%})",
                    )
            out.append(replace(sku, prices=MappingProxyType({kind: p[kind] for kind in PRICE_KINDS if kind in p})))
        return cls(out)

    @staticmethod
    def _read_skus(text: str, file: str) -> dict[str, Sku]:
        skus: dict[str, Sku] = {}
        for lineno, row in _rows(text):
            where = f"{file}:{lineno}"
            if row["cloud"] not in CLOUDS:
                raise CatalogError(f"unknown cloud {row['cloud']!r}", where=where, fix=f"use one of {', '.join(CLOUDS)}")
            skus[_key(row["name"])] = Sku(
                name=row["name"], cloud=row["cloud"], gpus=_num(row, "gpus", where, int),
                gpu_type=row["gpu_type"] or None, gpu_memory_gb=_num(row, "gpu_memory_gb", where),
                vcpus=_num(row, "vcpus", where, int), ram_gb=_num(row, "ram_gb", where),
                infiniband_gbps=_num(row, "infiniband_gbps", where), ib_links=_num(row, "ib_links", where, int),
                spec_source=row.get("spec_source") or "", notes=row.get("notes") or "",
                retired=_day(row, "retired", where),
            )
        return skus

    @staticmethod
    def _apply_override(path: Path, skus: dict[str, Sku], prices: dict[str, dict[str, Price]]) -> None:
        shown = str(path)
        try:
            text = path.read_text()
            doc = tomllib.loads(text)
        except FileNotFoundError:
            raise CatalogError("catalog file not found", where=shown, fix="check the path given to --catalog") from None
        except IsADirectoryError:
            raise CatalogError("--catalog is a directory, not a file", where=shown, fix="pass the TOML file itself, e.g. --catalog mine.toml") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise CatalogError(f"cannot read the catalog file ({type(exc).__name__})", where=shown,
                               fix="pass a readable UTF-8 TOML file to --catalog") from None
        except tomllib.TOMLDecodeError as exc:
            raise CatalogError(f"not valid TOML: {exc}", where=shown, fix="check quoting and [[sku]] / [[price]] headers") from None
        unknown = sorted(set(doc) - {"sku", "price"})
        if unknown:
            raise CatalogError(f"unknown table {unknown[0]!r}", where=shown, fix="a catalog file holds [[sku]] and [[price]] entries")
        sku_where = _entry_places(text, doc, "sku", shown)
        seen_skus: dict[str, str] = {}
        for i, raw in enumerate(doc.get("sku", [])):
            where = sku_where[i]
            try:
                entry = SkuEntry.model_validate(raw)
            except ValidationError as exc:
                raise _pydantic_error(exc, where, SkuEntry) from None
            k = _key(entry.name)
            if k in seen_skus:  # the later one changed the first, or replaced it: either way, one was not meant
                raise CatalogError(f"SKU {entry.name!r} is given twice: also at {_short(seen_skus[k], shown)}", where=where,
                                   fix="keep one [[sku]] per SKU: merge the two entries' fields and delete the other")
            seen_skus[k] = where
            given = entry.model_dump(exclude_none=True, exclude={"name"})
            if k in skus:
                if given.get("gpus") == 0 and "gpu_type" not in given:  # a GPU type left on a VM without GPUs
                    given["gpu_type"] = None
                skus[k] = replace(skus[k], **given)
                _no_gpu_type_without_gpus(skus[k], where)
                continue
            missing = [f for f in _NEW_SKU_FIELDS if f not in given]
            if missing:
                raise CatalogError(
                    f"new SKU {entry.name!r} lacks {', '.join(missing)}", where=where,
                    fix="give every hardware field of a new SKU (cloud, gpus, gpu_memory_gb, vcpus, ram_gb)",
                )
            if given["gpus"] > 0 and "gpu_type" not in given:  # else "2x None" in the table and no --gpu match
                raise CatalogError(f"new SKU {entry.name!r} has {given['gpus']} GPU(s) but no gpu_type", where=where,
                                   fix='add gpu_type, e.g. gpu_type = "A100"')
            skus[k] = Sku(name=entry.name, gpu_type=given.pop("gpu_type", None), infiniband_gbps=given.pop("infiniband_gbps", 0.0),
                          spec_source=given.pop("spec_source", shown), **given)
            _no_gpu_type_without_gpus(skus[k], where)
            prices[k] = {}
        price_where = _entry_places(text, doc, "price", shown)
        given_prices: dict[tuple[str, str], str] = {}
        for i, raw in enumerate(doc.get("price", [])):
            where = price_where[i]
            try:
                entry = PriceEntry.model_validate(raw)
            except ValidationError as exc:
                raise _pydantic_error(exc, where, PriceEntry) from None
            k = _key(entry.sku)
            if k not in skus:
                raise UnknownSku(entry.sku, _nearest(entry.sku, [s.name for s in skus.values()]), where=where)
            if (k, entry.kind) in given_prices:  # the last one won without a word
                raise CatalogError(
                    f"a second {entry.kind} price for {skus[k].name}: {_short(given_prices[k, entry.kind], shown)} gives one too",
                    where=where, fix=f"keep one [[price]] per SKU and kind: delete one of the two {entry.kind} prices")
            given_prices[k, entry.kind] = where
            prices[k][entry.kind] = Price(entry.usd_per_hour, source=entry.source, date=entry.date, region=entry.region, note=entry.note)
        for k in {k for k, _ in given_prices}:
            spot, od = prices[k].get("spot"), prices[k].get("on_demand")
            if spot is not None and od is not None and spot.usd_per_hour > od.usd_per_hour:
                mine = given_prices.get((k, "spot")) or given_prices[k, "on_demand"]
                raise CatalogError(
                    f"{skus[k].name}: spot ${spot.usd_per_hour:g}/h is above on-demand ${od.usd_per_hour:g}/h "
                    f"(spot: {spot.source}; on-demand: {od.source})", where=mine,
                    fix="spot is a discount on on-demand: check usd_per_hour and kind of the two prices "
                        "(a per-GPU figure, or the kinds swapped?)")


    # --- queries -----------------------------------------------------------------------------------------
    def get(self, name: str) -> Sku:
        """The SKU named ``name`` (``Standard_`` prefix and case optional)."""
        sku = self._skus.get(_key(name))
        if sku is None:
            raise UnknownSku(name, _nearest(name, [s.name for s in self._skus.values()]))
        return sku

    def skus(self, gpu: str | None = None, cloud: str | None = None) -> list[Sku]:
        """Every SKU, or those with GPU type ``gpu`` / on ``cloud`` (both case-insensitive), in file order."""
        out = list(self._skus.values())
        if gpu is not None:
            out = [s for s in out if s.gpus and (s.gpu_type or "").lower() == gpu.lower()]
        if cloud is not None:
            out = [s for s in out if s.cloud == cloud.lower()]
        return out

    def __contains__(self, name: str) -> bool:
        return _key(name) in self._skus


def _entry_places(text: str, doc: dict, table: str, shown: str) -> list[str]:
    """Where each entry of the top-level ``table`` is, ``file:line: table[i]`` (the line of its ``[[table]]``
    header; without the line when the file writes them otherwise, e.g. as an inline array). A key that is
    no array of tables (``sku = 1``, ``[sku]``) is an error."""
    value = doc.get(table, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        single = isinstance(value, dict)
        raise CatalogError(
            f"{table!r} must be an array of tables ([[{table}]])" + (f", not one table ([{table}])" if single else
                                                                   f", got {type(value).__name__} {value!r}"[:120]),
            where=shown, fix=f"write each entry under its own [[{table}]] header, its fields below it as key = value lines")
    header = re.compile(rf"^\s*\[\[\s*{table}\s*\]\]")
    lines = [n for n, ln in enumerate(text.splitlines(), start=1) if header.match(ln)]
    if len(lines) != len(value):
        return [f"{shown}: {table}[{i}]" for i in range(len(value))]
    return [f"{shown}:{n}: {table}[{i}]" for i, n in enumerate(lines)]


def _short(where: str, shown: str) -> str:
    """``price[0] (line 3)`` of ``FILE:3: price[0]``, for a message that already names the file."""
    rest = where.removeprefix(shown)
    line, _, entry = rest.removeprefix(":").partition(": ")
    return f"{entry} (line {line})" if entry else rest.removeprefix(": ")


def _no_gpu_type_without_gpus(sku: Sku, where: str) -> None:
    # a VM without GPUs listed under `--gpu V100`, and weighed by the planner as one
    if sku.gpus == 0 and sku.gpu_type:
        raise CatalogError(f"SKU {sku.name!r} has 0 GPUs but gpu_type {sku.gpu_type!r}", where=where,
                           fix="give its GPU count (gpus = 1, ...), or drop gpu_type for a VM without GPUs")


def _nearest(name: str, names: list[str], n: int = 3) -> list[str]:
    by_key = {_key(x): x for x in names}
    return [by_key[k] for k in difflib.get_close_matches(_key(name), list(by_key), n=n, cutoff=0.5)]
