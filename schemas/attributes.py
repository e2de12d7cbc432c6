"""Attribute ratings of multi-response records by name, and the weighted sums over them: the
score preprocessing orders a prompt's responses by, and the reward of a regression head."""

from __future__ import annotations

import math

from rmflow.schemas.options import ConfigError


def attribute_names(text: str) -> tuple[str, ...]:
    """``name,name`` -> the names, in order; a ConfigError names a repeated or empty one."""
    names = tuple(n.strip() for n in text.split(",")) if text.strip() else ()
    if any(not n for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"attributes {text!r}: give name,name,... each name once")
    return names


def parse_weights(text: str) -> dict[str, float]:
    """``name=weight,name=weight`` -> {name: weight}; a ConfigError names what is wrong."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not name.strip() or not math.isfinite(weight) or name.strip() in out:
            raise ConfigError(f"attribute_weights {part!r}: write name=weight (a finite number), each name once")
        out[name.strip()] = weight
    if not out or not any(out.values()):
        raise ConfigError(f"attribute_weights {text!r}: give at least one name=weight with a weight that is not 0")
    return out


def weights_over(names: tuple[str, ...], weights: dict[str, float], what: str) -> tuple[float, ...]:
    """``weights`` by name -> one weight per attribute of ``names`` (0 for one not named); a
    ConfigError when a weight names an attribute not in ``names`` (``what``: where they come from)
    or none of them is weighted."""
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ConfigError(f"{what} weigh {', '.join(unknown)}, which the records do not keep (they keep "
                          f"{', '.join(names) or 'no attributes'}): keep them at preprocessing (--attributes) or "
                          "give the weights of the kept ones (--attribute-weights)")
    out = tuple(float(weights.get(n, 0.0)) for n in names)
    if not any(out):
        raise ConfigError(f"{what} weigh none of the attributes the records keep ({', '.join(names)})")
    return out
