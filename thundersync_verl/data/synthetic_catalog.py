"""The tiny repositories and planted bugs of the synthetic SWE set (``swe_synthetic.py`` builds from them).

Why a catalog written by hand:
1. The set must run end to end on a 2-core CPU: each repository is one package module with three
   small functions and six pytest tests, so a verifier run costs well under a second.
2. Each bug is one small source edit (a comparator, an operator, a constant), shaped like SWE-smith's
   procedural modifications; its issue text says what a user would see, never where the bug is.
3. Which tests a bug breaks is not written here: the generator runs the tests on the clean and the
   bugged repository and records FAIL_TO_PASS / PASS_TO_PASS from the outcomes, as SWE-smith's
   validation harness does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    name: str
    old: str  # exact text in the clean module
    new: str  # what the bug puts in its place
    issue: str  # the problem statement


@dataclass(frozen=True)
class Family:
    package: str
    source: str
    tests: str
    bugs: tuple[Bug, ...]


TEXTKIT = Family("textkit", '''\
def slugify(text):
    words = [w for w in text.lower().split() if w]
    return "-".join(words)


def truncate(text, limit):
    if len(text) <= limit:
        return text
    return text[: limit - 3] + "..."


def count_vowels(text):
    return sum(1 for ch in text.lower() if ch in "aeiou")
''', '''\
from textkit.core import count_vowels, slugify, truncate


def test_slugify_words():
    assert slugify("Hello Big World") == "hello-big-world"


def test_slugify_single():
    assert slugify("  Python ") == "python"


def test_truncate_short_text_is_kept():
    assert truncate("abcde", 5) == "abcde"


def test_truncate_long_text():
    assert truncate("abcdefghij", 6) == "abc..."


def test_count_vowels():
    assert count_vowels("Education") == 5


def test_count_vowels_none():
    assert count_vowels("rhythm") == 0
''', (
    Bug("join_separator", '"-".join(words)', '"_".join(words)',
        "slugify('Hello Big World') returns 'hello_big_world'; slugs must use hyphens: 'hello-big-world'."),
    Bug("boundary", "len(text) <= limit", "len(text) < limit",
        "truncate('abcde', 5) returns 'ab...' but a text exactly at the limit must be returned unchanged."),
    Bug("vowel_set", '"aeiou"', '"aeio"',
        "count_vowels('Education') returns 4, expected 5: the letter u is not counted."),
))

MATHKIT = Family("mathkit", '''\
def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value


def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def gcd(a, b):
    while b:
        a, b = b, a % b
    return abs(a)
''', '''\
import pytest

from mathkit.core import clamp, gcd, mean


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_above():
    assert clamp(15, 0, 10) == 10


def test_mean():
    assert mean([1, 2, 3, 6]) == 3


def test_mean_empty():
    with pytest.raises(ValueError):
        mean([])


def test_gcd():
    assert gcd(12, 18) == 6


def test_gcd_negative():
    assert gcd(-4, 6) == 2
''', (
    Bug("upper_bound", "        return high\n", "        return low\n",
        "clamp(15, 0, 10) returns 0; a value above the range must be clamped to the upper bound 10."),
    Bug("divisor", "sum(values) / len(values)", "sum(values) / (len(values) + 1)",
        "mean([1, 2, 3, 6]) returns 2.4 instead of 3."),
    Bug("result_var", "return abs(a)", "return abs(b)",
        "gcd(12, 18) returns 0; expected 6."),
))

LISTKIT = Family("listkit", '''\
def chunks(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


def flatten(nested):
    out = []
    for part in nested:
        out.extend(part)
    return out


def dedupe(items):
    seen = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out
''', '''\
from listkit.core import chunks, dedupe, flatten


def test_chunks_even():
    assert chunks([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_chunks_remainder():
    assert chunks([1, 2, 3], 2) == [[1, 2], [3]]


def test_flatten():
    assert flatten([[1], [2, 3], []]) == [1, 2, 3]


def test_flatten_empty():
    assert flatten([]) == []


def test_dedupe_keeps_order():
    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]


def test_dedupe_empty():
    assert dedupe([]) == []
''', (
    Bug("last_chunk", "range(0, len(items), size)", "range(0, len(items) - 1, size)",
        "chunks([1, 2, 3], 2) returns [[1, 2]]: the last, shorter chunk [3] is lost."),
    Bug("extend_append", "out.extend(part)", "out.append(part)",
        "flatten([[1], [2, 3], []]) returns [[1], [2, 3], []] instead of [1, 2, 3]."),
    Bug("membership", "if item not in seen:", "if item in seen:",
        "dedupe([3, 1, 3, 2, 1]) returns [] instead of [3, 1, 2]."),
))

DATEKIT = Family("datekit", '''\
def is_leap(year):
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    if month == 2:
        return 29 if is_leap(year) else 28
    return 30 if month in (4, 6, 9, 11) else 31


def day_of_year(year, month, day):
    return sum(days_in_month(year, m) for m in range(1, month)) + day
''', '''\
from datekit.core import day_of_year, days_in_month, is_leap


def test_leap_years():
    assert is_leap(2024) and is_leap(2000)


def test_common_years():
    assert not is_leap(1900) and not is_leap(2023)


def test_days_in_april():
    assert days_in_month(2023, 4) == 30


def test_days_in_november():
    assert days_in_month(2023, 11) == 30


def test_day_of_year_march():
    assert day_of_year(2023, 3, 1) == 60


def test_day_of_year_january():
    assert day_of_year(2023, 1, 15) == 15
''', (
    Bug("century_rule", "year % 100 != 0", "year % 100 == 0",
        "is_leap(2024) returns False; 2024 is a leap year."),
    Bug("thirty_days", "(4, 6, 9, 11)", "(4, 6, 9)",
        "days_in_month(2023, 11) returns 31; November has 30 days."),
    Bug("month_range", "range(1, month)", "range(1, month + 1)",
        "day_of_year(2023, 1, 15) returns 46 instead of 15."),
))

STACKKIT = Family("stackkit", '''\
class Stack:
    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty stack")
        return self._items.pop()

    def peek(self):
        return self._items[-1] if self._items else None

    def __len__(self):
        return len(self._items)
''', '''\
import pytest

from stackkit.core import Stack


def _stack(*items):
    stack = Stack()
    for item in items:
        stack.push(item)
    return stack


def test_pop_is_last_in_first_out():
    assert _stack(1, 2, 3).pop() == 3


def test_pop_empty():
    with pytest.raises(IndexError):
        Stack().pop()


def test_peek():
    assert _stack("a", "b").peek() == "b"


def test_peek_empty():
    assert Stack().peek() is None


def test_len():
    assert len(_stack(1, 2)) == 2


def test_len_empty():
    assert len(Stack()) == 0
''', (
    Bug("fifo", "self._items.pop()", "self._items.pop(0)",
        "Stack.pop returns the oldest item: after pushing 1, 2, 3, pop() gives 1 instead of 3."),
    Bug("peek_bottom", "self._items[-1] if", "self._items[0] if",
        "Stack.peek returns the bottom item: after pushing 'a' then 'b', peek() gives 'a'."),
    Bug("length", "return len(self._items)", "return len(self._items) + 1",
        "len(Stack()) is 1 for an empty stack."),
))

PARSEKIT = Family("parsekit", '''\
def parse_bool(text):
    return text.strip().lower() in ("1", "true", "yes", "on")


def parse_pairs(text):
    pairs = {}
    for part in text.split(","):
        if "=" in part:
            key, value = part.split("=", 1)
            pairs[key.strip()] = value.strip()
    return pairs


def parse_range(text):
    start, _, end = text.partition("-")
    return list(range(int(start), int(end) + 1))
''', '''\
from parsekit.core import parse_bool, parse_pairs, parse_range


def test_parse_bool_true_words():
    assert parse_bool(" Yes") and parse_bool("on") and parse_bool("1")


def test_parse_bool_false():
    assert not parse_bool("off")


def test_parse_pairs():
    assert parse_pairs("a=1, b = 2") == {"a": "1", "b": "2"}


def test_parse_pairs_value_with_equals():
    assert parse_pairs("url=x=y") == {"url": "x=y"}


def test_parse_range():
    assert parse_range("3-5") == [3, 4, 5]


def test_parse_range_single():
    assert parse_range("7-7") == [7]
''', (
    Bug("yes_word", '("1", "true", "yes", "on")', '("1", "true", "on")',
        "parse_bool('yes') returns False; yes must count as true."),
    Bug("split_all", 'part.split("=", 1)', 'part.split("=")',
        "parse_pairs('url=x=y') raises ValueError; the value may contain '='."),
    Bug("inclusive_end", "int(end) + 1", "int(end)",
        "parse_range('3-5') returns [3, 4]; the range must include its end: [3, 4, 5]."),
))

MONEYKIT = Family("moneykit", '''\
def to_cents(amount):
    return int(round(amount * 100))


def format_cents(cents):
    sign = "-" if cents < 0 else ""
    cents = abs(cents)
    return f"{sign}${cents // 100}.{cents % 100:02d}"


def split_bill(total_cents, people):
    base, extra = divmod(total_cents, people)
    return [base + 1 if i < extra else base for i in range(people)]
''', '''\
from moneykit.core import format_cents, split_bill, to_cents


def test_to_cents_rounds():
    assert to_cents(0.29) == 29


def test_to_cents_whole():
    assert to_cents(3) == 300


def test_format_cents_pads():
    assert format_cents(1005) == "$10.05"


def test_format_cents_negative():
    assert format_cents(-250) == "-$2.50"


def test_split_bill_remainder():
    assert split_bill(100, 3) == [34, 33, 33]


def test_split_bill_even():
    assert split_bill(90, 3) == [30, 30, 30]
''', (
    Bug("truncation", "int(round(amount * 100))", "int(amount * 100)",
        "to_cents(0.29) returns 28 instead of 29."),
    Bug("zero_pad", "{cents % 100:02d}", "{cents % 100:d}",
        "format_cents(1005) returns '$10.5' instead of '$10.05'."),
    Bug("extra_share", "if i < extra else", "if i <= extra else",
        "split_bill(100, 3) returns [34, 34, 33], which adds up to 101 cents."),
))

GRIDKIT = Family("gridkit", '''\
def neighbors(row, col, rows, cols):
    out = []
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        r, c = row + dr, col + dc
        if 0 <= r < rows and 0 <= c < cols:
            out.append((r, c))
    return out


def transpose(grid):
    return [list(col) for col in zip(*grid)]


def manhattan(a, b):
    return abs(a[0] - b[0]) + abs(a[1] - b[1])
''', '''\
from gridkit.core import manhattan, neighbors, transpose


def test_neighbors_corner():
    assert sorted(neighbors(0, 0, 3, 3)) == [(0, 1), (1, 0)]


def test_neighbors_middle():
    assert len(neighbors(1, 1, 3, 3)) == 4


def test_transpose():
    assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]


def test_transpose_empty():
    assert transpose([]) == []


def test_manhattan():
    assert manhattan((4, 1), (1, 5)) == 7


def test_manhattan_same_point():
    assert manhattan((2, 2), (2, 2)) == 0
''', (
    Bug("first_row", "0 <= r < rows", "0 < r < rows",
        "neighbors(1, 1, 3, 3) misses the cell above in row 0: it returns 3 cells instead of 4."),
    Bug("zip_rows", "zip(*grid)", "zip(grid)",
        "transpose([[1, 2, 3], [4, 5, 6]]) returns the rows wrapped in lists instead of the columns."),
    Bug("signed_column", "abs(a[1] - b[1])", "(a[1] - b[1])",
        "manhattan((4, 1), (1, 5)) returns -1 instead of 7; distances are never negative."),
))

FAMILIES: tuple[Family, ...] = (TEXTKIT, MATHKIT, LISTKIT, DATEKIT, STACKKIT, PARSEKIT, MONEYKIT, GRIDKIT)
