"""Parameter checks for the public entry points (layer L0), in the spirit of scikit-learn's
``_parameter_constraints``: each public function validates its arguments once, before any cluster starts or
any file is written, and raises :class:`~scaleattn.errors.ParameterError` naming the parameter.
"""
from __future__ import annotations

import argparse
import json
import math
import numbers

from .errors import ParameterError

__all__ = ["choice", "integer", "real", "heads_spec", "positive_seconds",
           "int_at_least", "seed", "seconds", "MAX_SECONDS", "parse_storage_options", "storage_option_pairs"]

#: the longest duration any option or parameter takes (a timeout, a time budget): 30 days. Longer is no
#: deliberate choice (``1e308`` was taken as is and handed to Dask's, asyncio's and the OS's timers)
MAX_SECONDS = 30 * 86400


def choice(name: str, value, choices):
    """``value`` if it is one of ``choices``, else :class:`ParameterError` listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ParameterError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def integer(name: str, value, minimum: int | None = None, maximum: int | None = None, none_ok: bool = False):
    """``int(value)`` within ``[minimum, maximum]`` (bools and non-integral numbers refused)."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            value = int(value)
        else:
            raise ParameterError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ParameterError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ParameterError(f"{name} must be <= {maximum}, got {value}")
    return value


def real(name: str, value, low: float | None = None, high: float | None = None, *, low_open: bool = False,
         high_open: bool = False, none_ok: bool = False):
    """``float(value)``, finite, within the interval (``low_open``/``high_open`` exclude the ends)."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParameterError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ParameterError(f"{name} must be finite, got {value}")
    lo_bad = low is not None and (value <= low if low_open else value < low)
    hi_bad = high is not None and (value >= high if high_open else value > high)
    if lo_bad or hi_bad:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
        interval = f"{lo}, {hi}" if lo and hi else (f">{'' if low_open else '='} {low:g}" if lo else
                                                    f"<{'' if high_open else '='} {high:g}")
        raise ParameterError(f"{name} must be {'in ' if lo and hi else ''}{interval}, got {value:g}")
    return value


def heads_spec(heads):
    """``"svd"``, ``"minimal"`` or a positive head count (``"3"`` or 3)."""
    if isinstance(heads, str) and heads in ("svd", "minimal"):
        return heads
    try:
        h = int(heads)
        if isinstance(heads, bool) or (not isinstance(heads, str) and h != heads):
            raise ValueError
    except (TypeError, ValueError):
        raise ParameterError(f"heads must be 'svd', 'minimal' or a positive integer, got {heads!r}") from None
    if h < 1:
        raise ParameterError(f"heads must be >= 1, got {h}")
    return h


def seconds(name: str, value, none_ok: bool = True):
    """A duration parameter (a timeout, a time budget): ``float(value)`` in ``(0, MAX_SECONDS]``, or None.

    Raises
    ------
    ParameterError
        Naming ``name``, e.g. ``heads_budget must be in (0, 2.592e+06], got 1e+308``.
    """
    return real(name, value, 0.0, MAX_SECONDS, low_open=True, none_ok=none_ok)


def positive_seconds(text: str) -> float:
    """argparse type of the command line's durations: a number of seconds in ``(0, MAX_SECONDS]`` (argparse then
    exits 2 naming the option)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    if x > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SECONDS} seconds (30 days), got {text}")
    return x


def int_at_least(low: int):
    """argparse type of an integer ``>= low`` (argparse then exits 2 naming the option).

    Examples
    --------
    >>> int_at_least(1)("3")
    3
    """
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n

    return parse


#: argparse type of a random seed: an integer >= 0 (numpy's generators refuse negative seeds with a bare
#: ValueError, which the command line reported as an internal error)
seed = int_at_least(0)


def parse_storage_options(options) -> dict | None:
    """fsspec options from a dict or from ``["KEY=VALUE", ...]`` (the CLI's ``--storage-option``): values
    are parsed as JSON where they parse (numbers, true/false, objects), and ``endpoint_url`` moves into s3fs's
    ``client_kwargs``. The one parser for the CLI and the API. Raises :class:`ParameterError` for a pair
    without ``=`` or a non-string key.

    Examples
    --------
    >>> parse_storage_options(["endpoint_url=http://localhost:9000", "anon=false"])
    {'anon': False, 'client_kwargs': {'endpoint_url': 'http://localhost:9000'}}
    """
    if not options:
        return None
    if isinstance(options, dict):
        out = {**options}
    else:
        out = {}
        for k, v in storage_option_pairs(options).items():
            try:
                out[k] = json.loads(v)
            except json.JSONDecodeError:
                out[k] = v
    if any(not isinstance(k, str) or not k for k in out):
        raise ParameterError(f"storage option names must be non-empty strings, got {sorted(map(repr, out))}")
    if "endpoint_url" in out:  # s3fs takes the endpoint inside client_kwargs
        out["client_kwargs"] = {**out.get("client_kwargs", {}), "endpoint_url": out.pop("endpoint_url")}
    return out


def storage_option_pairs(pairs, option: str = "`storage_options`") -> dict[str, str]:
    """``["KEY=VALUE", ...]`` -> ``{KEY: VALUE}`` as text (no parsing of the values); the first step of
    :func:`parse_storage_options`, also used by ``scaleattn submit`` to pass them on unchanged. Raises
    :class:`ParameterError` for a pair without ``=`` or with an empty key (naming ``option``)."""
    out = {}
    for p in pairs or []:
        if not isinstance(p, str) or "=" not in p or not p.split("=", 1)[0]:
            raise ParameterError(f"{option} expects KEY=VALUE, got {p!r}")
        k, v = p.split("=", 1)
        out[k] = v
    return out
