"""The command line's argparse types of counts: each parser of `bench.config` wrapped so that its
ValueError message reaches the user as a usage error (shared by every command's options)."""

from __future__ import annotations

import argparse
from typing import Callable

from .bench.config import parse_count, parse_count_or_zero, parse_counts


def typed(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type`` whose ValueError message reaches the user."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


#: The argparse types of the counts: each at most `bench.config.MAX_COUNT`, so that an
#: out-of-range one is a usage error.
COUNT = typed(parse_count)
COUNTS = typed(parse_counts)
COUNT_OR_ZERO = typed(parse_count_or_zero)
