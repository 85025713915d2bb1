#!/usr/bin/env python3
"""Write the project's own training prompts for EAGLE draft-head self-distillation.

Outputs (Spec-Bench format, one JSON object per line):
    data/train/code_prompts.jsonl  -- programming prompts, mostly Python
    data/train/chat_prompts.jsonl  -- general assistant prompts

Everything is built combinatorially from the hand-written lists below, with a fixed
random seed, so the files are reproducible: run `python scripts/make_train_prompts.py`.
Standard library only.

None of the text is taken from the evaluation sets (HumanEval, MT-bench, GSM8K). The
Python function specs below are the project's own, their doctest outputs are computed by
running the reference implementations written here, and no function name is a HumanEval
entry point. If the evaluation prompt files are present (../shared/data/prompts/*.jsonl)
the script also checks that no generated prompt shares an 8-word sequence with any of
them and fails if one does; the output does not depend on those files being present.
"""

from __future__ import annotations

import copy
import inspect
import json
import random
import re
import signal
import sys
import textwrap
from pathlib import Path

SEED = 20241122
ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "data" / "train"
EVAL_DIR = ROOT.parent / "shared" / "data" / "prompts"

# HumanEval entry points: none of our function names may be one of these.
HUMANEVAL_NAMES = set("""
has_close_elements separate_paren_groups truncate_number below_zero mean_absolute_deviation
intersperse parse_nested_parens filter_by_substring sum_product rolling_max make_palindrome
is_palindrome string_xor longest greatest_common_divisor all_prefixes string_sequence
count_distinct_characters parse_music how_many_times sort_numbers find_closest_elements
rescale_to_unit filter_integers strlen largest_divisor factorize remove_duplicates flip_case
concatenate filter_by_prefix get_positive is_prime poly find_zero sort_third unique max_element
fizz_buzz sort_even encode_cyclic decode_cyclic prime_fib triples_sum_to_zero car_race_collision
incr_list pairs_sum_to_zero change_base triangle_area fib4 median modp encode_shift decode_shift
remove_vowels below_threshold add same_chars fib correct_bracketing monotonic common
largest_prime_factor sum_to_n derivative fibfib vowels_count circular_shift digitSum
fruit_distribution pluck search strange_sort_list will_it_fly smallest_change total_match
is_multiply_prime is_simple_power iscube hex_key decimal_to_binary is_happy
numerical_letter_grade prime_length starts_one_ends solve anti_shuffle get_row sort_array
encrypt next_smallest is_bored any_int encode skjkasdkd check_dict_case count_up_to multiply
count_upper closest_integer make_a_pile words_string choose_num rounded_avg unique_digits
by_length f even_odd_palindrome count_nums move_one_ball exchange histogram reverse_delete
odd_count minSubArraySum max_fill select_words get_closest_vowel match_parens maximum solution
add_elements get_odd_collatz valid_date split_words is_sorted intersection prod_signs minPath
tri digits is_nested sum_squares check_if_last_char_is_a_letter can_arrange
largest_smallest_integers compare_one is_equal_to_sum_even special_factorial fix_spaces
file_name_check words_in_sentence simplify order_by_points specialFilter get_max_triples bf
sorted_list_sum x_or_y double_the_difference compare Strongest_Extension cycpattern_check
even_odd_count int_to_mini_roman right_angle_triangle find_max eat do_algebra string_to_md5
generate_integers
""".split())


# ---------------------------------------------------------------------------------------
# Python function specs: (source, one-line spec in the imperative, example argument tuples)
# ---------------------------------------------------------------------------------------

SPECS = [
    ('''
def count_words(text: str) -> int:
    return len(text.split())
''', "Return the number of whitespace-separated words in text.",
     [("the quick brown fox",), ("",), ("  spaced   out  ",)]),
    ('''
def capitalize_words(text: str) -> str:
    return " ".join(word[:1].upper() + word[1:] for word in text.split())
''', "Return text with the first letter of every word upper-cased, joining the words with single spaces.",
     [("hello   world",), ("python is fun",)]),
    ('''
def chunk_list(items: list, size: int) -> list:
    return [items[i:i + size] for i in range(0, len(items), size)]
''', "Split items into consecutive chunks of length size. The last chunk may be shorter.",
     [([1, 2, 3, 4, 5], 2), ([], 3)]),
    ('''
def flatten(nested: list) -> list:
    result = []
    for item in nested:
        if isinstance(item, list):
            result.extend(flatten(item))
        else:
            result.append(item)
    return result
''', "Flatten an arbitrarily nested list of lists into a single flat list, preserving order.",
     [([1, [2, [3, 4]], 5],), ([[], [[]]],)]),
    ('''
def running_total(nums: list) -> list:
    totals = []
    current = 0
    for n in nums:
        current += n
        totals.append(current)
    return totals
''', "Return a list where the i-th element is the sum of nums[0] through nums[i].",
     [([3, 1, 4, 1, 5],), ([],)]),
    ('''
from typing import Optional

def second_largest(nums: list) -> Optional[int]:
    distinct = sorted(set(nums), reverse=True)
    return distinct[1] if len(distinct) > 1 else None
''', "Return the second largest distinct value in nums, or None if there is no such value.",
     [([4, 1, 7, 7, 3],), ([5, 5],)]),
    ('''
def char_frequency(text: str) -> dict:
    counts = {}
    for ch in text:
        if ch != " ":
            counts[ch] = counts.get(ch, 0) + 1
    return counts
''', "Count how many times each non-space character occurs in text, as a dict in order of first appearance.",
     [("banana",), ("a b a",)]),
    ('''
def is_anagram(first: str, second: str) -> bool:
    def normalize(s):
        return sorted(s.replace(" ", "").lower())
    return normalize(first) == normalize(second)
''', "Check whether two phrases are anagrams of each other, ignoring spaces and letter case.",
     [("Dormitory", "dirty room"), ("hello", "world")]),
    ('''
def run_length_encode(text: str) -> str:
    if not text:
        return ""
    parts = []
    current, count = text[0], 1
    for ch in text[1:]:
        if ch == current:
            count += 1
        else:
            parts.append(f"{current}{count}")
            current, count = ch, 1
    parts.append(f"{current}{count}")
    return "".join(parts)
''', "Compress text using run-length encoding, writing each character followed by the length of its run.",
     [("aaabccdddd",), ("x",), ("",)]),
    ('''
import re

def run_length_decode(encoded: str) -> str:
    return "".join(ch * int(count) for ch, count in re.findall(r"(\\D)(\\d+)", encoded))
''', "Decode a run-length encoded string such as 'a3b1' back into the original text.",
     [("a3b1c2",), ("z10",)]),
    ('''
def merge_sorted(left: list, right: list) -> list:
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged
''', "Merge two already sorted lists into one sorted list without calling sort().",
     [([1, 4, 9], [2, 3, 10, 12]), ([], [5])]),
    ('''
def binary_search(items: list, target: int) -> int:
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1
''', "Return the index of target in the sorted list items, or -1 if it is not present.",
     [([1, 3, 5, 7, 9, 11], 7), ([2, 4, 6], 5), ([1, 3, 5, 7, 9, 11], 1)]),
    ('''
def transpose(matrix: list) -> list:
    return [list(row) for row in zip(*matrix)]
''', "Return the transpose of a matrix given as a list of equal-length rows.",
     [([[1, 2, 3], [4, 5, 6]],)]),
    ('''
def dot_product(a: list, b: list) -> float:
    if len(a) != len(b):
        raise ValueError("vectors must have the same length")
    return sum(x * y for x, y in zip(a, b))
''', "Return the dot product of two vectors of equal length, raising ValueError if the lengths differ.",
     [([1, 2, 3], [4, 5, 6]), ([0.5, 2], [4, 0.25])]),
    ('''
def celsius_to_fahrenheit(celsius: float) -> float:
    return celsius * 9 / 5 + 32
''', "Convert a temperature from degrees Celsius to degrees Fahrenheit.",
     [(100,), (-40,), (25,)]),
    ('''
def seconds_to_hms(seconds: int) -> str:
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}"
''', "Format a number of seconds as an 'HH:MM:SS' string.",
     [(3725,), (59,), (86399,)]),
    ('''
def parse_key_values(text: str) -> dict:
    result = {}
    for pair in text.split(";"):
        if "=" in pair:
            key, value = pair.split("=", 1)
            result[key.strip()] = value.strip()
    return result
''', "Parse a string like 'a=1; b=2' into a dict mapping keys to string values, skipping malformed pairs.",
     [("name=Ada; lang=Python",), ("x=1;broken;y = 2",)]),
    ('''
def longest_word(sentence: str) -> str:
    best = ""
    for word in sentence.split():
        if len(word) > len(best):
            best = word
    return best
''', "Return the longest word in sentence, or the first of them if several words tie.",
     [("I love programming in Python",), ("cat dog",)]),
    ('''
import math
from functools import reduce

def lcm_of_list(nums: list) -> int:
    return reduce(lambda a, b: a * b // math.gcd(a, b), nums, 1)
''', "Return the least common multiple of a list of positive integers.",
     [([4, 6, 10],), ([7],)]),
    ('''
def digital_root(n: int) -> int:
    while n >= 10:
        n = sum(int(d) for d in str(n))
    return n
''', "Sum the digits of a non-negative integer repeatedly until a single digit remains; the result is that digit.",
     [(9875,), (10,), (7,)]),
    ('''
def is_perfect_number(n: int) -> bool:
    if n < 2:
        return False
    total = 1
    for d in range(2, int(n ** 0.5) + 1):
        if n % d == 0:
            total += d
            if d != n // d:
                total += n // d
    return total == n
''', "Check whether n equals the sum of its proper divisors (for example 6 = 1 + 2 + 3).",
     [(28,), (12,), (1,)]),
    ('''
def count_set_bits(n: int) -> int:
    count = 0
    while n:
        count += n & 1
        n >>= 1
    return count
''', "Return the number of 1 bits in the binary representation of a non-negative integer.",
     [(13,), (0,), (255,)]),
    ('''
def hamming_distance(a: str, b: str) -> int:
    if len(a) != len(b):
        raise ValueError("strings must have equal length")
    return sum(1 for x, y in zip(a, b) if x != y)
''', "Return the number of positions at which two equal-length strings differ.",
     [("karolin", "kathrin"), ("abc", "abc")]),
    ('''
def rotate_list(items: list, k: int) -> list:
    if not items:
        return []
    k %= len(items)
    return items[-k:] + items[:-k]
''', "Rotate items to the right by k positions, producing a new list.",
     [([1, 2, 3, 4, 5], 2), ([1, 2, 3], 4)]),
    ('''
def pairwise_differences(nums: list) -> list:
    return [b - a for a, b in zip(nums, nums[1:])]
''', "Return the differences between each pair of consecutive numbers.",
     [([1, 4, 9, 16],), ([5],)]),
    ('''
def group_by_length(words: list) -> dict:
    groups = {}
    for word in words:
        groups.setdefault(len(word), []).append(word)
    return dict(sorted(groups.items()))
''', "Group words by their length, returning a dict from length to the words of that length, with keys in increasing order.",
     [(["hi", "cat", "to", "dog", "bird"],)]),
    ('''
def collapse_repeats(items: list) -> list:
    result = []
    for item in items:
        if not result or result[-1] != item:
            result.append(item)
    return result
''', "Collapse runs of consecutive equal elements into a single element, keeping the original order.",
     [([1, 1, 2, 2, 2, 1, 3, 3],), (["a", "a", "b", "a"],)]),
    ('''
def snake_to_camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.capitalize() for part in rest)
''', "Convert a snake_case identifier to camelCase.",
     [("user_id",), ("parse_http_response",), ("value",)]),
    ('''
import re

def camel_to_snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
''', "Convert a camelCase or PascalCase identifier to snake_case.",
     [("userId",), ("ParseHttpResponse",)]),
    ('''
def mask_email(email: str) -> str:
    local, domain = email.split("@", 1)
    if len(local) <= 2:
        masked = local[0] + "*" * (len(local) - 1)
    else:
        masked = local[0] + "*" * (len(local) - 2) + local[-1]
    return masked + "@" + domain
''', "Hide the middle of the part of an email address before the '@', keeping only its first and last characters.",
     [("john.doe@example.com",), ("al@site.org",)]),
    ('''
def is_valid_ipv4(address: str) -> bool:
    parts = address.split(".")
    if len(parts) != 4:
        return False
    for part in parts:
        if not part.isdigit() or int(part) > 255:
            return False
        if len(part) > 1 and part[0] == "0":
            return False
    return True
''', "Check whether address is a valid dotted-decimal IPv4 address without leading zeros.",
     [("192.168.0.1",), ("256.1.1.1",), ("10.01.0.1",)]),
    ('''
def matrix_trace(matrix: list) -> int:
    return sum(matrix[i][i] for i in range(len(matrix)))
''', "Return the sum of the main diagonal of a square matrix.",
     [([[1, 2], [3, 4]],), ([[5]],)]),
    ('''
def count_islands(grid: list) -> int:
    rows, cols = len(grid), len(grid[0]) if grid else 0
    seen = set()
    islands = 0
    for r in range(rows):
        for c in range(cols):
            if grid[r][c] == "#" and (r, c) not in seen:
                islands += 1
                stack = [(r, c)]
                seen.add((r, c))
                while stack:
                    y, x = stack.pop()
                    for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                        if 0 <= ny < rows and 0 <= nx < cols and grid[ny][nx] == "#" and (ny, nx) not in seen:
                            seen.add((ny, nx))
                            stack.append((ny, nx))
    return islands
''', "Count groups of '#' cells in a grid of strings that are connected horizontally or vertically.",
     [(["##..", "#..#", "...#"],), (["#.#", ".#.", "#.#"],), ([],)]),
    ('''
def brackets_balanced(text: str) -> bool:
    pairs = {")": "(", "]": "[", "}": "{"}
    stack = []
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack
''', "Check whether the round, square and curly brackets in text are balanced and properly nested; other characters are ignored.",
     [("f(a[1], {b: 2})",), ("(]",), ("((",)]),
    ('''
def word_lengths(sentence: str) -> dict:
    return {word: len(word) for word in sentence.split()}
''', "Map each word in sentence to its length.",
     [("to be or not",)]),
    ('''
from collections import Counter

def top_k_frequent(words: list, k: int) -> list:
    counts = Counter(words)
    return sorted(counts, key=lambda w: (-counts[w], w))[:k]
''', "Return the k most frequent words, breaking ties alphabetically.",
     [(["b", "a", "c", "a", "b", "d"], 2), (["x"], 3)]),
    ('''
def moving_average(nums: list, window: int) -> list:
    return [sum(nums[i:i + window]) / window for i in range(len(nums) - window + 1)]
''', "Return the averages of every run of window consecutive numbers in nums.",
     [([1, 2, 3, 4, 5], 3), ([10, 20], 2)]),
    ('''
def clamp(value: float, low: float, high: float) -> float:
    return max(low, min(value, high))
''', "Limit value to the closed interval from low to high.",
     [(15, 0, 10), (-3, 0, 10), (4, 0, 10)]),
    ('''
def normalize_whitespace(text: str) -> str:
    return " ".join(text.split())
''', "Replace every run of whitespace in text with a single space, with no whitespace left at either end.",
     [("  hello \t\n world  ",)]),
    ('''
def interleave(first: list, second: list) -> list:
    result = []
    for i in range(max(len(first), len(second))):
        if i < len(first):
            result.append(first[i])
        if i < len(second):
            result.append(second[i])
    return result
''', "Alternate elements from two lists, appending the leftover elements of the longer list at the end.",
     [([1, 2, 3], ["a", "b"]), ([], [7])]),
    ('''
def repeated_items(items: list) -> list:
    seen, repeated = set(), []
    for item in items:
        if item in seen and item not in repeated:
            repeated.append(item)
        seen.add(item)
    return repeated
''', "Return the elements that occur more than once in items, each listed once in the order of its second appearance.",
     [([3, 1, 3, 2, 1, 3],), ([1, 2],)]),
    ('''
def sum_of_multiples(limit: int, divisors: list) -> int:
    return sum(n for n in range(1, limit) if any(n % d == 0 for d in divisors))
''', "Return the sum of all positive integers below limit that are divisible by at least one of the divisors.",
     [(20, [3, 5]), (10, [7])]),
    ('''
def pascal_row(n: int) -> list:
    row = [1]
    for _ in range(n):
        row = [a + b for a, b in zip([0] + row, row + [0])]
    return row
''', "Return row n of Pascal's triangle, where row 0 is [1].",
     [(0,), (4,)]),
    ('''
def is_leap_year(year: int) -> bool:
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
''', "Check whether year is a leap year in the Gregorian calendar.",
     [(2024,), (1900,), (2000,), (2023,)]),
    ('''
def days_in_month(year: int, month: int) -> int:
    if month == 2:
        return 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28
    return 30 if month in (4, 6, 9, 11) else 31
''', "Return the number of days in the given month (1-12) of the given year.",
     [(2024, 2), (2023, 2), (2023, 9)]),
    ('''
def ordinal_suffix(n: int) -> str:
    if 10 <= n % 100 <= 20:
        suffix = "th"
    else:
        suffix = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
''', "Return n followed by its English ordinal suffix, such as '1st', '12th' or '23rd'.",
     [(1,), (12,), (23,), (111,)]),
    ('''
def spiral_order(matrix: list) -> list:
    result = []
    while matrix:
        result.extend(matrix[0])
        matrix = [list(row) for row in zip(*matrix[1:])][::-1]
    return result
''', "Return the elements of a matrix in clockwise spiral order starting from the top-left corner.",
     [([[1, 2, 3], [4, 5, 6], [7, 8, 9]],)]),
    ('''
def kth_smallest(nums: list, k: int) -> int:
    return sorted(nums)[k - 1]
''', "Return the k-th smallest element of nums, where k = 1 means the minimum.",
     [([7, 2, 9, 4], 2), ([3], 1)]),
    ('''
from collections import Counter

def mode_of_list(nums: list) -> int:
    counts = Counter(nums)
    best = max(counts.values())
    return min(n for n, c in counts.items() if c == best)
''', "Return the most common value in nums, preferring the smallest value when several are equally common.",
     [([4, 1, 2, 2, 4, 3],), ([9],)]),
    ('''
def population_variance(nums: list) -> float:
    mean = sum(nums) / len(nums)
    return sum((x - mean) ** 2 for x in nums) / len(nums)
''', "Return the population variance of a non-empty list of numbers.",
     [([2, 4, 4, 4, 5, 5, 7, 9],), ([3, 3],)]),
    ('''
def reverse_words(sentence: str) -> str:
    return " ".join(reversed(sentence.split()))
''', "Reverse the order of the words in sentence.",
     [("one two three",)]),
    ('''
import string

def is_pangram(text: str) -> bool:
    return set(string.ascii_lowercase) <= set(text.lower())
''', "Check whether text contains every letter of the English alphabet at least once.",
     [("The quick brown fox jumps over the lazy dog",), ("Hello world",)]),
    ('''
def remove_punctuation(text: str) -> str:
    return "".join(ch for ch in text if ch.isalnum() or ch.isspace())
''', "Remove every character from text that is neither a letter, a digit nor whitespace.",
     [("Hello, world! It's 9:30.",)]),
    ('''
import re

def make_acronym(phrase: str) -> str:
    return "".join(word[0].upper() for word in re.split(r"[\\s-]+", phrase) if word)
''', "Build an acronym from the first letter of each word in phrase, treating hyphens as word separators.",
     [("portable network graphics",), ("Complementary metal-oxide semiconductor",)]),
    ('''
def safe_divide(a: float, b: float, fallback: float = 0.0) -> float:
    try:
        return a / b
    except ZeroDivisionError:
        return fallback
''', "Divide a by b, returning fallback instead of raising an error when b is zero.",
     [(7, 2), (1, 0), (1, 0, -1.0)]),
    ('''
def invert_dict(mapping: dict) -> dict:
    inverted = {}
    for key, value in mapping.items():
        inverted.setdefault(value, []).append(key)
    return inverted
''', "Invert a dict so that each value maps to the list of keys that had that value.",
     [({"a": 1, "b": 2, "c": 1},)]),
    ('''
def merge_counts(first: dict, second: dict) -> dict:
    merged = dict(first)
    for key, value in second.items():
        merged[key] = merged.get(key, 0) + value
    return merged
''', "Merge two dicts of counts, adding the values of keys that appear in both.",
     [({"apples": 3, "pears": 1}, {"pears": 2, "plums": 5})]),
    ('''
def deep_get(data: dict, path: str, fallback=None):
    current = data
    for key in path.split("."):
        if not isinstance(current, dict) or key not in current:
            return fallback
        current = current[key]
    return current
''', "Look up a dotted path such as 'a.b.c' in nested dicts, returning fallback if any key is missing.",
     [({"a": {"b": {"c": 42}}}, "a.b.c"), ({"a": {}}, "a.x", "n/a")]),
    ('''
def flatten_dict(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            flat.update(flatten_dict(value, name))
        else:
            flat[name] = value
    return flat
''', "Flatten nested dicts into a single dict whose keys are dotted paths.",
     [({"db": {"host": "localhost", "port": 5432}, "debug": True},)]),
    ('''
def parse_csv_line(line: str) -> list:
    return [field.strip() for field in line.split(",")]
''', "Split a simple comma-separated line into fields with surrounding spaces removed.",
     [("alice, 30 , Paris",)]),
    ('''
def format_currency(amount: float) -> str:
    sign = "-" if amount < 0 else ""
    return f"{sign}${abs(amount):,.2f}"
''', "Format amount as US dollars with thousands separators and two decimals, such as '$1,234.50'.",
     [(1234.5,), (-0.5,), (1000000,)]),
    ('''
def human_readable_size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"
''', "Format a byte count using binary units (B, KB, MB, GB, TB) with one decimal place.",
     [(512,), (1536,), (5368709120,)]),
    ('''
def time_to_minutes(hhmm: str) -> int:
    hours, minutes = hhmm.split(":")
    return int(hours) * 60 + int(minutes)
''', "Convert a 'HH:MM' time string into the number of minutes since midnight.",
     [("02:30",), ("23:59",)]),
    ('''
def next_power_of_two(n: int) -> int:
    power = 1
    while power < n:
        power *= 2
    return power
''', "Return the smallest power of two that is greater than or equal to n.",
     [(5,), (16,), (1,)]),
    ('''
def is_armstrong_number(n: int) -> bool:
    digits = str(n)
    return n == sum(int(d) ** len(digits) for d in digits)
''', "Check whether n equals the sum of its digits each raised to the power of the number of digits.",
     [(153,), (154,), (9474,)]),
    ('''
def sum_digits_in_text(text: str) -> int:
    return sum(int(ch) for ch in text if ch.isdigit())
''', "Return the sum of all digit characters that appear in text.",
     [("a1b2c3",), ("no digits",)]),
    ('''
import re

def extract_numbers(text: str) -> list:
    return [int(match) for match in re.findall(r"-?\\d+", text)]
''', "Extract all integers, including negative ones, from text in the order they appear.",
     [("Temps ranged from -5 to 12 degrees over 3 days",)]),
    ('''
def max_window_sum(nums: list, k: int) -> int:
    window = sum(nums[:k])
    best = window
    for i in range(k, len(nums)):
        window += nums[i] - nums[i - k]
        best = max(best, window)
    return best
''', "Return the largest sum of any k consecutive elements of nums.",
     [([2, 1, 5, 1, 3, 2], 3), ([4, -1, 2], 1)]),
    ('''
from typing import Optional

def two_sum_indices(nums: list, target: int) -> Optional[tuple]:
    seen = {}
    for i, n in enumerate(nums):
        if target - n in seen:
            return (seen[target - n], i)
        seen[n] = i
    return None
''', "Return the indices of two different elements of nums that add up to target, or None if no such pair exists.",
     [([2, 7, 11, 15], 9), ([1, 2, 3], 10)]),
    ('''
def longest_common_prefix(words: list) -> str:
    if not words:
        return ""
    prefix = words[0]
    for word in words[1:]:
        while not word.startswith(prefix):
            prefix = prefix[:-1]
    return prefix
''', "Return the longest string that is a prefix of every word in words.",
     [(["flower", "flow", "flight"],), (["dog", "racecar"],)]),
    ('''
def is_rotation(a: str, b: str) -> bool:
    return len(a) == len(b) and b in a + a
''', "Check whether string b can be obtained by rotating string a.",
     [("waterbottle", "erbottlewat"), ("abc", "acb")]),
    ('''
def count_divisors(n: int) -> int:
    count = 0
    for d in range(1, int(n ** 0.5) + 1):
        if n % d == 0:
            count += 1 if d * d == n else 2
    return count
''', "Return how many positive divisors the positive integer n has.",
     [(12,), (16,), (1,)]),
    ('''
def edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]
''', "Return the Levenshtein distance between a and b: the minimum number of single-character insertions, deletions and substitutions that turn a into b.",
     [("kitten", "sitting"), ("", "abc")]),
    ('''
def count_coin_combinations(amount: int, coins: list) -> int:
    ways = [1] + [0] * amount
    for coin in coins:
        for value in range(coin, amount + 1):
            ways[value] += ways[value - coin]
    return ways[amount]
''', "Return the number of distinct ways to make amount from unlimited coins of the given denominations, ignoring order.",
     [(5, [1, 2, 5]), (3, [2])]),
    ('''
def fewest_coins(amount: int, coins: list) -> int:
    inf = float("inf")
    best = [0] + [inf] * amount
    for value in range(1, amount + 1):
        for coin in coins:
            if coin <= value and best[value - coin] + 1 < best[value]:
                best[value] = best[value - coin] + 1
    return best[amount] if best[amount] != inf else -1
''', "Return the minimum number of coins needed to make amount, or -1 if it cannot be made.",
     [(11, [1, 2, 5]), (3, [2])]),
    ('''
def stair_climbing_ways(n: int) -> int:
    a, b = 1, 1
    for _ in range(n):
        a, b = b, a + b
    return a
''', "Return the number of ways to climb n stairs when each move climbs either one or two stairs.",
     [(1,), (4,), (0,)]),
    ('''
def max_pair_product(nums: list) -> int:
    ordered = sorted(nums)
    return max(ordered[0] * ordered[1], ordered[-1] * ordered[-2])
''', "Return the largest product of any two elements of nums, which must contain at least two numbers.",
     [([1, 10, -5, 1, -100],), ([3, 4],)]),
    ('''
def matrix_multiply(a: list, b: list) -> list:
    return [[sum(x * y for x, y in zip(row, col)) for col in zip(*b)] for row in a]
''', "Multiply two matrices given as lists of rows.",
     [([[1, 2], [3, 4]], [[5, 6], [7, 8]])]),
    ('''
def rotate_matrix(matrix: list) -> list:
    return [list(row) for row in zip(*matrix[::-1])]
''', "Rotate a square matrix 90 degrees clockwise, producing a new matrix.",
     [([[1, 2], [3, 4]],)]),
    ('''
def is_strong_password(password: str) -> bool:
    return (
        len(password) >= 8
        and any(c.islower() for c in password)
        and any(c.isupper() for c in password)
        and any(c.isdigit() for c in password)
    )
''', "Check whether password has at least 8 characters and contains a lowercase letter, an uppercase letter and a digit.",
     [("Secret123",), ("password",)]),
    ('''
import re

def slugify(title: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower())
    return slug.strip("-")
''', "Turn a title into a URL slug made of lowercase letters, digits and single hyphens.",
     [("Hello, World! 2024 Edition",)]),
    ('''
def truncate_text(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:max(limit - 3, 0)].rstrip() + "..."
''', "Shorten text to at most limit characters, ending with '...' when anything was cut off.",
     [("The quick brown fox", 10), ("short", 10)]),
    ('''
def wrap_text(text: str, width: int) -> list:
    lines, current = [], ""
    for word in text.split():
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    if current:
        lines.append(current)
    return lines
''', "Wrap the words of text greedily into lines no longer than width characters; a word longer than width gets a line of its own.",
     [("the quick brown fox jumps over the lazy dog", 10)]),
    ('''
def parse_query_string(query: str) -> dict:
    params = {}
    for pair in query.lstrip("?").split("&"):
        if not pair:
            continue
        key, _, value = pair.partition("=")
        params.setdefault(key, []).append(value)
    return params
''', "Parse a URL query string such as '?a=1&b=2&a=3' into a dict mapping each key to the list of its values.",
     [("?a=1&b=2&a=3",), ("flag&x=",)]),
    ('''
def zip_to_dict(keys: list, values: list, fill=None) -> dict:
    return {key: values[i] if i < len(values) else fill for i, key in enumerate(keys)}
''', "Pair up keys with values into a dict, using fill for keys that have no matching value.",
     [(["a", "b", "c"], [1, 2]), (["x"], [9, 8])]),
    ('''
def sort_by_second(pairs: list) -> list:
    return sorted(pairs, key=lambda p: (p[1], p[0]))
''', "Sort a list of pairs by their second element, using the first element to break ties.",
     [([("b", 2), ("a", 2), ("c", 1)],)]),
    ('''
def group_anagrams(words: list) -> list:
    groups = {}
    for word in words:
        groups.setdefault("".join(sorted(word)), []).append(word)
    return list(groups.values())
''', "Group words that are anagrams of each other, keeping groups in order of first appearance.",
     [(["eat", "tea", "tan", "ate", "nat", "bat"],)]),
    ('''
def first_unique_char(text: str) -> int:
    counts = {}
    for ch in text:
        counts[ch] = counts.get(ch, 0) + 1
    for i, ch in enumerate(text):
        if counts[ch] == 1:
            return i
    return -1
''', "Return the index of the first character in text that occurs exactly once, or -1 if there is none.",
     [("swiss",), ("aabb",)]),
    ('''
from collections import Counter

def election_winner(votes: list) -> str:
    counts = Counter(votes)
    return min(counts, key=lambda name: (-counts[name], name))
''', "Return the candidate with the most votes, choosing the alphabetically first name when there is a tie.",
     [(["ana", "bo", "ana", "cy", "bo"],), (["zoe"],)]),
    ('''
def alternating_sum(nums: list) -> int:
    return sum(n if i % 2 == 0 else -n for i, n in enumerate(nums))
''', "Return nums[0] - nums[1] + nums[2] - nums[3] + ... for the given list.",
     [([5, 3, 2, 1],), ([],)]),
    ('''
def count_inversions(nums: list) -> int:
    return sum(1 for i in range(len(nums)) for j in range(i + 1, len(nums)) if nums[i] > nums[j])
''', "Return the number of pairs (i, j) with i < j and nums[i] > nums[j].",
     [([2, 4, 1, 3, 5],), ([1, 2, 3],)]),
    ('''
def round_to_multiple(n: int, m: int) -> int:
    return (n + m // 2) // m * m
''', "Round n to the nearest multiple of m, rounding halfway cases up.",
     [(17, 5), (25, 10), (3, 4)]),
    ('''
def bar_chart(counts: dict, symbol: str = "#") -> str:
    width = max((len(str(k)) for k in counts), default=0)
    return "\\n".join(f"{str(k).ljust(width)} | {symbol * v}" for k, v in counts.items())
''', "Render a dict of counts as a text bar chart with one line per key and aligned labels.",
     [({"cats": 3, "dogs": 5, "fish": 1},)]),
    ('''
def average_word_length(text: str) -> float:
    words = text.split()
    if not words:
        return 0.0
    return sum(len(w) for w in words) / len(words)
''', "Return the mean length of the words in text, or 0.0 for text without words.",
     [("a bb ccc dddd",), ("",)]),
    ('''
def triangle_kind(a: float, b: float, c: float) -> str:
    x, y, z = sorted((a, b, c))
    if x <= 0 or x + y <= z:
        return "invalid"
    if x == z:
        return "equilateral"
    if x == y or y == z:
        return "isosceles"
    return "scalene"
''', "Classify a triangle by its side lengths as 'equilateral', 'isosceles', 'scalene' or 'invalid'.",
     [(3, 3, 3), (3, 4, 4), (3, 4, 5), (1, 2, 3)]),
    ('''
def bmi_category(weight_kg: float, height_m: float) -> str:
    bmi = weight_kg / height_m ** 2
    if bmi < 18.5:
        return "underweight"
    if bmi < 25:
        return "normal"
    if bmi < 30:
        return "overweight"
    return "obese"
''', "Compute the body-mass index from weight and height, giving its category: 'underweight', 'normal', 'overweight' or 'obese'.",
     [(70, 1.75), (50, 1.8), (95, 1.75)]),
    ('''
def compound_interest(principal: float, rate: float, years: int) -> float:
    return round(principal * (1 + rate) ** years, 2)
''', "Return the balance after compounding principal yearly at the given rate for a number of years, rounded to cents.",
     [(1000, 0.05, 3), (500, 0.0, 10)]),
    ('''
def identity_matrix(n: int) -> list:
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]
''', "Return the n by n identity matrix as a list of rows.",
     [(3,)]),
    ('''
def manhattan_distance(p: tuple, q: tuple) -> int:
    return sum(abs(a - b) for a, b in zip(p, q))
''', "Return the Manhattan distance between two points given as coordinate tuples.",
     [((1, 2), (4, 6)), ((0, 0, 0), (1, -1, 2))]),
    ('''
import math

def polygon_perimeter(points: list) -> float:
    total = 0.0
    for i in range(len(points)):
        (x1, y1), (x2, y2) = points[i], points[(i + 1) % len(points)]
        total += math.hypot(x2 - x1, y2 - y1)
    return total
''', "Return the perimeter of a polygon whose vertices are given in order as (x, y) pairs.",
     [([(0, 0), (3, 0), (3, 4)],), ([(0, 0), (1, 0), (1, 1), (0, 1)],)]),
    ('''
def expand_ranges(spec: str) -> list:
    result = []
    for part in spec.split(","):
        if "-" in part:
            start, end = part.split("-")
            result.extend(range(int(start), int(end) + 1))
        elif part.strip():
            result.append(int(part))
    return result
''', "Expand a range specification such as '1-3,7,10-12' into the full list of integers.",
     [("1-3,7,10-12",)]),
    ('''
def compress_ranges(nums: list) -> str:
    parts = []
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        parts.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(parts)
''', "Describe a sorted list of distinct integers compactly, collapsing runs of consecutive values into 'start-end'.",
     [([1, 2, 3, 5, 7, 8],), ([],)]),
    ('''
def spreadsheet_column(n: int) -> str:
    letters = ""
    while n > 0:
        n, rem = divmod(n - 1, 26)
        letters = chr(ord("A") + rem) + letters
    return letters
''', "Convert a positive column number to its spreadsheet column label (1 -> 'A', 27 -> 'AA').",
     [(1,), (28,), (702,)]),
    ('''
def sentence_case(text: str) -> str:
    text = text.strip().lower()
    return text[:1].upper() + text[1:]
''', "Lower-case text with surrounding whitespace removed, keeping only its first character upper-case.",
     [("  hELLO THERE, General  ",)]),
    ('''
def top_scorers(scores: dict, n: int) -> list:
    return [name for name, _ in sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]
''', "Return the names of the n highest scores, breaking ties by name.",
     [({"ana": 90, "ben": 75, "cy": 90, "dee": 60}, 2)]),
    ('''
def find_peak(nums: list) -> int:
    for i in range(len(nums)):
        left = nums[i - 1] if i > 0 else float("-inf")
        right = nums[i + 1] if i + 1 < len(nums) else float("-inf")
        if nums[i] > left and nums[i] > right:
            return i
    return -1
''', "Return the index of the first element that is strictly greater than its neighbours, or -1 if there is none.",
     [([1, 3, 2, 4, 1],), ([2, 2],)]),
    ('''
def product_except_self(nums: list) -> list:
    result = [1] * len(nums)
    prefix = 1
    for i in range(len(nums)):
        result[i] = prefix
        prefix *= nums[i]
    suffix = 1
    for i in range(len(nums) - 1, -1, -1):
        result[i] *= suffix
        suffix *= nums[i]
    return result
''', "Return a list where each element is the product of all other elements of nums, without using division.",
     [([1, 2, 3, 4],)]),
    ('''
def has_unique_chars(text: str) -> bool:
    return len(set(text)) == len(text)
''', "Check whether no character appears more than once in text.",
     [("python",), ("hello",)]),
    ('''
def factorial_trailing_zeros(n: int) -> int:
    count = 0
    while n:
        n //= 5
        count += n
    return count
''', "Return the number of trailing zeros in n! without computing the factorial.",
     [(10,), (100,)]),
    ('''
def merge_intervals(intervals: list) -> list:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
''', "Merge overlapping intervals given as [start, end] pairs into a list sorted by start.",
     [([[1, 3], [8, 10], [2, 6], [15, 18]],), ([[1, 4], [4, 5]],)]),
    ('''
def sum_nested(data) -> float:
    if isinstance(data, (int, float)):
        return data
    if isinstance(data, dict):
        data = data.values()
    return sum(sum_nested(item) for item in data)
''', "Add up every number inside an arbitrarily nested structure of lists, tuples and dicts.",
     [([1, [2, 3], {"a": 4, "b": [5]}],), ([],)]),
    ('''
def weighted_average(values: list, weights: list) -> float:
    total_weight = sum(weights)
    if total_weight == 0:
        raise ValueError("weights must not sum to zero")
    return sum(v * w for v, w in zip(values, weights)) / total_weight
''', "Return the weighted average of values using the matching weights.",
     [([80, 90], [1, 3]), ([2, 4, 6], [1, 1, 1])]),
    ('''
def format_duration(seconds: int) -> str:
    if seconds == 0:
        return "now"
    parts = []
    for name, size in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        amount, seconds = divmod(seconds, size)
        if amount:
            parts.append(f"{amount} {name}" + ("s" if amount > 1 else ""))
    return ", ".join(parts)
''', "Describe a duration given in seconds in words, such as '1 hour, 2 minutes'.",
     [(3720,), (90061,), (0,)]),
    ('''
def count_char_types(text: str) -> dict:
    return {
        "letters": sum(c.isalpha() for c in text),
        "digits": sum(c.isdigit() for c in text),
        "spaces": sum(c.isspace() for c in text),
        "other": sum(not (c.isalnum() or c.isspace()) for c in text),
    }
''', "Count the letters, digits, whitespace characters and other characters in text.",
     [("Room 101, floor 3!",)]),
    ('''
def luhn_check(number: str) -> bool:
    digits = [int(d) for d in number if d.isdigit()]
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return bool(digits) and total % 10 == 0
''', "Validate a card or account number with the Luhn checksum, ignoring spaces.",
     [("7992 7398 713",), ("79927398710",)]),
    ('''
def split_bill(total: float, people: int, tip_percent: float = 15.0) -> float:
    return round(total * (1 + tip_percent / 100) / people, 2)
''', "Return each person's share of a bill including tip, rounded to cents.",
     [(120.0, 4), (59.99, 3, 20)]),
    ('''
def vigenere_encrypt(text: str, key: str) -> str:
    result, k = [], 0
    for ch in text:
        if ch.isalpha():
            shift = ord(key[k % len(key)].lower()) - ord("a")
            base = ord("A") if ch.isupper() else ord("a")
            result.append(chr((ord(ch) - base + shift) % 26 + base))
            k += 1
        else:
            result.append(ch)
    return "".join(result)
''', "Encrypt text with the Vigenere cipher using key, leaving non-letters unchanged and preserving case.",
     [("Attack at dawn", "lemon")]),
    ('''
def is_symmetric(matrix: list) -> bool:
    n = len(matrix)
    return all(matrix[i][j] == matrix[j][i] for i in range(n) for j in range(i + 1, n))
''', "Check whether a square matrix equals its own transpose.",
     [([[1, 2], [2, 1]],), ([[1, 0], [5, 1]],)]),
    ('''
def bin_values(values: list, width: float) -> dict:
    bins = {}
    for v in values:
        start = (v // width) * width
        bins[start] = bins.get(start, 0) + 1
    return dict(sorted(bins.items()))
''', "Count how many values fall into each bin of the given width, keyed by the lower edge of the bin.",
     [([1, 4, 5, 11, 12, 19], 5)]),
    ('''
def max_depth(nested) -> int:
    if not isinstance(nested, list):
        return 0
    return 1 + max((max_depth(item) for item in nested), default=0)
''', "Return how deeply lists are nested inside nested; a flat list has depth 1 and a non-list has depth 0.",
     [([1, [2, [3]], 4],), ([],), (5,)]),
    ('''
def max_profit(prices: list) -> int:
    best, lowest = 0, float("inf")
    for price in prices:
        lowest = min(lowest, price)
        best = max(best, price - lowest)
    return best
''', "Return the largest profit from buying once and selling once later, given daily prices, or 0 if no profit is possible.",
     [([7, 1, 5, 3, 6, 4],), ([5, 4, 3],)]),
    ('''
def is_subsequence(small: str, big: str) -> bool:
    it = iter(big)
    return all(ch in it for ch in small)
''', "Check whether the characters of small appear in big in the same order, not necessarily adjacent.",
     [("ace", "abcde"), ("aec", "abcde")]),
    ('''
def char_histogram_top(text: str) -> str:
    letters = [c for c in text.lower() if c.isalpha()]
    if not letters:
        return ""
    return max(sorted(set(letters)), key=letters.count)
''', "Return the letter that occurs most often in text, ignoring case and choosing the alphabetically first on ties.",
     [("Mississippi",), ("abc",), ("123",)]),
    ('''
def nth_weekday_name(start: str, offset: int) -> str:
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    return days[(days.index(start) + offset) % 7]
''', "Return the name of the weekday that comes offset days after the weekday start.",
     [("Friday", 3), ("Monday", -1), ("Sunday", 14)]),
    ('''
def elapsed_minutes(start: str, end: str) -> int:
    def minutes(t):
        h, m = map(int, t.split(":"))
        return h * 60 + m
    diff = minutes(end) - minutes(start)
    return diff if diff >= 0 else diff + 24 * 60
''', "Return the number of minutes from clock time start to clock time end, both 'HH:MM', wrapping past midnight.",
     [("09:15", "17:45"), ("23:30", "00:15")]),
    ('''
def cumulative_max(nums: list) -> list:
    result, best = [], None
    for n in nums:
        best = n if best is None or n > best else best
        result.append(best)
    return result
''', "Return a list whose i-th element is the largest value among the first i + 1 elements of nums.",
     [([3, 1, 4, 1, 5, 9, 2],), ([],)]),
]


# ---------------------------------------------------------------------------------------
# Helpers for the function specs
# ---------------------------------------------------------------------------------------

class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _run(fn, args, seconds=0.2):
    """Call fn(*args) with a time limit; returns ('ok', value) or ('err', exception name)."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return ("ok", repr(fn(*_copy(args))))
    except _Timeout:
        return ("err", "timeout")
    except Exception as exc:  # noqa: BLE001 - any error counts as a different behaviour
        return ("err", type(exc).__name__)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _copy(args):
    return copy.deepcopy(args)


def _load(source):
    namespace = {}
    exec(compile(source, "<spec>", "exec"), namespace)  # noqa: S102 - our own code
    return namespace


def third_person(doc):
    """'Return the x.' -> 'returns the x.'"""
    verb, rest = doc.split(" ", 1)
    v = verb.lower()
    if v.endswith("y") and v[-2] not in "aeiou":
        v = v[:-1] + "ies"
    elif v.endswith(("s", "sh", "ch", "x", "z")):
        v += "es"
    else:
        v += "s"
    return f"{v} {rest}"


def lower_first(doc):
    return doc[:1].lower() + doc[1:]


MUTATIONS = [
    ("<=", "<"), (">=", ">"), ("< ", "<= "), ("> ", ">= "), ("!=", "=="), ("==", "!="),
    ("+ 1", ""), ("- 1", ""), ("range(0,", "range(1,"), ("range(1,", "range(2,"),
    ("[1:]", "[2:]"), ("[:-1]", "[:-2]"), ("max(", "min("), ("min(", "max("),
    (" and ", " or "), (" or ", " and "), ("+=", "-="), ("*=", "+="), ("[-1]", "[0]"),
    ("[0]", "[1]"), ("return True", "return False"), ("reverse=True", "reverse=False"),
    ("append(", "insert(0, "), ("upper()", "lower()"), (".strip()", ""), ("// 2", "/ 2"),
    ("% 2 == 0", "% 2 == 1"), ("-k", "k"), ("+ b", "- b"),
]


class Spec:
    def __init__(self, source, doc, examples):
        self.source = source.strip("\n") + "\n"
        self.doc = doc
        lines = self.source.splitlines()
        def_idx = next(i for i, line in enumerate(lines) if line.startswith("def "))
        self.header = "\n".join(lines[:def_idx]).strip()  # imports, may be ''
        self.def_line = lines[def_idx]
        self.body = "\n".join(lines[def_idx + 1:]) + "\n"
        self.name = re.match(r"def (\w+)\(", self.def_line).group(1)
        self.signature = self.def_line[4:].rstrip(":")
        fn = _load(self.source)[self.name]
        self.params = list(inspect.signature(fn).parameters.values())
        self.calls = []  # (call text, repr(result))
        for args in examples:
            status, value = _run(fn, args)
            if status != "ok":
                raise RuntimeError(f"{self.name}{args!r} failed: {value}")
            call = f"{self.name}({', '.join(repr(a) for a in args)})"
            self.calls.append((call, value, args))
        self.bug = self._make_bug(fn)

    def _make_bug(self, fn):
        """First mutation of the body that changes the result of some example."""
        for old, new in MUTATIONS:
            if old not in self.body:
                continue
            body = self.body.replace(old, new, 1)
            mutated = (self.header + "\n\n" if self.header else "") + self.def_line + "\n" + body
            try:
                bad = _load(mutated)[self.name]
            except Exception:  # noqa: BLE001
                continue
            for call, expected, args in self.calls:
                got = _run(bad, args)
                if got != ("ok", expected):
                    return mutated, call, expected, got
        return None

    def completion_code(self, with_examples):
        doc_lines = textwrap.wrap(self.doc, width=76)
        parts = [self.header + "\n\n" if self.header else "", self.def_line, '\n    """']
        parts.append(doc_lines[0])
        for line in doc_lines[1:]:
            parts.append("\n    " + line)
        if with_examples:
            parts.append("\n")
            for call, value, _ in self.calls:
                if value == "None":  # doctest prints nothing for None
                    call, value = f"{call} is None", "True"
                parts.append(f"\n    >>> {call}\n    {value}")
            parts.append('\n    """\n')
        else:
            parts.append('\n    """\n' if len(doc_lines) > 1 else '"""\n')
        return "".join(parts)


def camel(name):
    first, *rest = name.split("_")
    return first + "".join(p.capitalize() for p in rest)


def js_params(spec):
    out = []
    for p in spec.params:
        if p.default is inspect.Parameter.empty:
            out.append(camel(p.name))
        else:
            d = p.default
            lit = "null" if d is None else json.dumps(d)
            if isinstance(d, float) and d == int(d):
                lit = str(int(d))
            out.append(f"{camel(p.name)} = {lit}")
    return ", ".join(out)


# ---------------------------------------------------------------------------------------
# Code prompt lists
# ---------------------------------------------------------------------------------------

COMPLETE_TEMPLATES = [
    (3, "Complete the code I provided.\n\n{code}"),
    (2, "Complete this function:\n```python\n{code}```"),
    (1, "Complete the following Python function.\n\n```python\n{code}```"),
    (1, "{code}"),
    (1, "Implement the body of this function so that it matches its docstring:\n\n{code}"),
    (1, "Fill in the implementation:\n\n```python\n{code}```"),
    (1, "Finish writing this Python function. Return only the code.\n\n```python\n{code}```"),
]

WRITE_TEMPLATES = [
    "Write a Python function `{sig}` that {d3}",
    "Implement `{sig}` in Python. It {d3}",
    "I need a Python function called `{name}` that {d3} Please include a docstring and a couple of examples.",
    "Create a function `{sig}` that {d3} Handle edge cases such as empty input.",
    "Write a function in Python that {d3} Name it `{name}`.",
    "Write an efficient Python function `{sig}`. It should {base}",
    "Using only the standard library, write `{sig}`, which {d3} Explain your approach briefly.",
]

EXPLAIN_TEMPLATES = [
    "Explain what this code does:\n```python\n{src}```",
    "What does the following Python function do? Walk through it step by step.\n\n```python\n{src}```",
    "Explain this function line by line to a beginner.\n\n```python\n{src}```",
    "What is the time and space complexity of this function?\n\n```python\n{src}```",
    "Give this function a docstring that describes its arguments, return value and behaviour:\n\n```python\n{src}```",
]

FIX_TEMPLATES = [
    "The following function is supposed to {base_np}, but it has a bug. Find and fix it.\n\n```python\n{bug}```",
    "Fix the bug in this Python function. Calling `{call}` should return `{expected}`, but {got_text}.\n\n```python\n{bug}```",
    "My function `{name}` gives wrong results. It should {base}\n\n```python\n{bug}```\nWhat's wrong and how do I fix it?",
    "Find the mistake in this code and explain it:\n```python\n{bug}```\nExpected: `{call}` == `{expected}`.",
]

TEST_TEMPLATES = [
    "Write pytest unit tests for this function, covering normal cases and edge cases:\n\n```python\n{src}```",
    "Write a unittest.TestCase for the following function.\n\n```python\n{src}```",
    "What edge cases should I test for this function? Write the tests too.\n\n```python\n{src}```",
]

REFACTOR_TEMPLATES = [
    "Rewrite this function to be more readable and Pythonic:\n\n```python\n{src}```",
    "Add type hints where missing, a docstring, and comments to this code:\n\n```python\n{src}```",
    "Can this function be made faster or simpler? Show an improved version.\n\n```python\n{src}```",
    "Review this Python code and suggest improvements:\n\n```python\n{src}```",
]

TRANSLATE_TEMPLATES = [
    "Translate this Python function to JavaScript:\n\n```python\n{src}```",
    "Convert the following Python code to TypeScript with proper types:\n\n```python\n{src}```",
    "Rewrite this Python function in idiomatic modern JavaScript (ES2020+).\n\n```python\n{src}```",
]

JS_WRITE_TEMPLATES = [
    "Write a JavaScript function `{jsname}({jsparams})` that {d3}",
    "In JavaScript, implement `{jsname}({jsparams})`, which {d3}",
    "Write a TypeScript function `{jsname}` that {d3} Include type annotations.",
]

CLASSES = [
    ("Stack", "with push, pop, peek, is_empty and __len__ methods, raising IndexError when popping from an empty stack"),
    ("QueueFromStacks", "that implements a FIFO queue using two Python lists as stacks, with enqueue, dequeue and __len__"),
    ("LRUCache", "with a fixed capacity and get(key) and put(key, value) methods that evict the least recently used item"),
    ("BankAccount", "with deposit, withdraw and a balance property, raising ValueError on overdrafts and keeping a transaction history"),
    ("Matrix", "that supports addition, multiplication, transpose and a readable __repr__"),
    ("Vector2D", "with addition, subtraction, scalar multiplication, a magnitude method and equality comparison"),
    ("Rational", "that stores a fraction in lowest terms and supports +, -, *, / and comparison"),
    ("Inventory", "that tracks product quantities and prices, with add_item, remove_item and total_value methods"),
    ("TodoList", "with methods to add tasks, mark them done, list pending tasks and save everything to a JSON file"),
    ("Timer", "usable as a context manager that measures and prints how long the block took"),
    ("RateLimiter", "that allows at most max_calls calls per period seconds, with an allow() method"),
    ("Trie", "with insert, search and starts_with methods for lowercase words"),
    ("MinHeap", "with push, pop and peek, implemented without the heapq module"),
    ("LinkedList", "(singly linked) with append, prepend, remove, __iter__ and __len__"),
    ("BinarySearchTree", "with insert, contains, min_value and an in-order traversal generator"),
    ("Graph", "for an undirected graph with add_edge, neighbors, bfs and shortest_path methods"),
    ("UnionFind", "with find (using path compression), union (by rank) and connected methods"),
    ("RingBuffer", "with a fixed capacity that overwrites the oldest item when full, plus to_list()"),
    ("Temperature", "with a celsius attribute and a fahrenheit property that can be read and set"),
    ("EventEmitter", "with on(event, handler), off(event, handler) and emit(event, *args) methods"),
    ("ShoppingCart", "that supports adding and removing items, discount codes and computing the total with tax"),
    ("LibraryCatalog", "that lets members check out and return books and lists overdue loans"),
    ("Polynomial", "with evaluation at x, addition, multiplication, derivative and a __str__ like '3x^2 + 1'"),
    ("Money", "that stores an amount in cents and a currency code and refuses to add different currencies"),
    ("WordCounter", "that is built from a text and offers most_common(n) and count(word) methods"),
    ("DeckOfCards", "that can shuffle with a seed, deal a hand of n cards and report how many cards remain"),
    ("TicTacToe", "that stores the board, accepts moves, rejects illegal ones and detects a winner or a draw"),
    ("ParkingLot", "with a number of spots per vehicle size, park and leave methods, and availability reporting"),
    ("Interval", "with start and end, an overlaps method, a merge method and a length property"),
    ("TaskScheduler", "that stores tasks with priorities and deadlines and returns the next task to work on"),
    ("Config", "that loads settings from a dict, allows attribute access (config.db.host) and has sensible defaults"),
    ("Histogram", "that collects numbers into fixed-width bins and can print itself as a text bar chart"),
]

CLASS_TEMPLATES = [
    "Implement a Python class `{name}` {desc}.",
    "Write a class `{name}` in Python {desc}. Include docstrings and a short usage example.",
    "Design a `{name}` class {desc}. Use type hints and write a few tests for it.",
    "Create a Python dataclass or regular class called `{name}` {desc}. Explain your design choices.",
]

ALGORITHMS = [
    "bubble sort", "insertion sort", "selection sort", "merge sort", "quicksort with a random pivot",
    "heap sort", "counting sort", "radix sort for non-negative integers", "recursive binary search",
    "breadth-first search on a grid maze", "depth-first search on an adjacency list",
    "Dijkstra's shortest path algorithm", "the Bellman-Ford algorithm", "the Floyd-Warshall algorithm",
    "Kruskal's minimum spanning tree algorithm", "Prim's minimum spanning tree algorithm",
    "topological sorting with Kahn's algorithm", "cycle detection in a directed graph",
    "the Knuth-Morris-Pratt string search", "the Rabin-Karp string search",
    "the sieve of Eratosthenes", "fast modular exponentiation", "the extended Euclidean algorithm",
    "the 0/1 knapsack problem with dynamic programming", "the longest increasing subsequence in O(n log n)",
    "the N-Queens problem with backtracking", "a Sudoku solver using backtracking",
    "generating all permutations of a list without itertools", "generating the power set of a list",
    "reservoir sampling", "the Fisher-Yates shuffle", "flood fill on a 2D grid",
    "A* search on a grid with Manhattan distance", "the sliding window maximum using a deque",
    "the interval scheduling greedy algorithm", "Huffman coding", "matrix exponentiation for linear recurrences",
    "quickselect for the k-th smallest element", "a bloom filter", "consistent hashing",
    "the two-pointer technique for finding pairs in a sorted array", "binary search on the answer",
    "Kadane-style maximum sum of a circular array", "detecting a cycle in a linked list with Floyd's algorithm",
    "run-length encoding and decoding", "converting an infix expression to postfix (shunting-yard)",
]

ALGORITHM_TEMPLATES = [
    "Implement {algo} in Python.",
    "Write a Python implementation of {algo} with comments explaining each step.",
    "Explain how {algo} works and give a Python implementation.",
    "What is the time and space complexity of {algo}? Show a short Python implementation.",
    "Write {algo} in Python and include a small example showing it in action.",
]

CONCEPT_PAIRS = [
    ("a list", "a tuple"), ("`is`", "`==`"), ("a shallow copy", "a deep copy"),
    ("`__str__`", "`__repr__`"), ("a generator expression", "a list comprehension"),
    ("`@staticmethod`", "`@classmethod`"), ("threads", "processes"), ("`append`", "`extend`"),
    ("`*args`", "`**kwargs`"), ("`list.sort()`", "`sorted()`"), ("`dict.get(key)`", "`dict[key]`"),
    ("an iterator", "an iterable"), ("`import module`", "`from module import name`"),
    ("a module", "a package"), ("`async def` functions", "regular functions"),
    ("`@property`", "a regular method"), ("a set", "a frozenset"), ("`json.dumps`", "`json.dump`"),
    ("`raise`", "`assert`"), ("`except Exception`", "a bare `except`"), ("composition", "inheritance"),
    ("`None`", "`False`"), ("`break`", "`continue`"), ("local variables", "global variables"),
]

CONCEPT_PAIR_TEMPLATES = [
    "What is the difference between {a} and {b} in Python?",
    "When should I use {a} instead of {b} in Python?",
    "Explain {a} vs {b} in Python with a short example.",
]

CONCEPTS = [
    "decorators", "context managers and the `with` statement", "the global interpreter lock (GIL)",
    "list comprehensions", "closures", "descriptors", "metaclasses", "`async` and `await`",
    "dataclasses", "type hints", "the iterator protocol", "the walrus operator `:=`", "f-strings",
    "mutable default arguments", "`try`/`except`/`else`/`finally`", "virtual environments",
    "`__slots__`", "`functools.lru_cache`", "`itertools.groupby`", "`collections.defaultdict`",
    "duck typing", "the method resolution order", "`enumerate` and `zip`", "slicing with a step",
    "unpacking with `*` and `**`", "`__init__.py` files", "`yield from`", "abstract base classes",
    "`__eq__` and `__hash__`", "structural pattern matching with `match`",
    "`if __name__ == \"__main__\":`", "the `logging` module", "`functools.partial`",
    "generators", "lambda functions", "exception chaining with `raise ... from`",
]

CONCEPT_TEMPLATES = [
    "Explain {c} in Python with an example.",
    "How does {c} work in Python?",
    "What is {c} in Python, and when is it useful?",
    "Can you give me a beginner-friendly explanation of {c} in Python?",
]

CS_CONCEPTS = [
    "Big-O notation", "recursion", "hash tables", "the difference between the stack and the heap",
    "REST APIs", "Git branching and merging", "the difference between unit tests and integration tests",
    "dynamic programming", "object-oriented programming", "functional programming", "race conditions",
    "floating-point rounding errors", "Unicode and UTF-8", "garbage collection", "memoization",
    "binary numbers and two's complement", "caching", "dependency injection", "regular expressions",
    "the difference between compiled and interpreted languages",
]

CS_TEMPLATES = [
    "Explain {c} to a new programmer.",
    "What is {c}? Give a small Python example.",
    "I'm learning to code. Can you explain {c} with an everyday analogy?",
]

PYTHON_TASKS = [
    "Write a Python script that reads a CSV file named `sales.csv` with columns `region` and `amount`, and prints the total amount per region.",
    "Write a decorator `retry(times)` that re-runs a function up to `times` times if it raises an exception.",
    "Write a context manager that temporarily changes the current working directory and restores it afterwards.",
    "Write a generator function that yields the lines of a large text file one at a time, skipping blank lines and lines starting with '#'.",
    "Write a command-line tool with argparse that takes a directory path and prints the ten largest files in it.",
    "Write a Python function that recursively finds all files with a given extension under a directory using pathlib.",
    "Write a function that loads a JSON configuration file and fills in default values for missing keys.",
    "Write a Python script that counts how many times each HTTP status code appears in a web server access log.",
    "Write a dataclass `Book` with title, author, year and isbn fields, and a function that sorts a list of books by year and then title.",
    "Write a Python function that downloads a web page with urllib and returns the text of its <title> tag.",
    "Use asyncio to run three simulated network requests concurrently and print their results as they finish.",
    "Write a memoization decorator without using functools.lru_cache.",
    "Write a regular expression that matches dates in the format YYYY-MM-DD and a Python function that extracts all of them from a text.",
    "Write a function that converts a list of dictionaries into a CSV string with a header row.",
    "Write a thread-safe counter class using threading.Lock and demonstrate it with several threads.",
    "Write a Python script that renames all .jpeg files in a folder to .jpg.",
    "Write a function that takes a date string like '2024-03-15' and returns the day of the week.",
    "Write a Python function that joins two CSV files on a shared `id` column without using pandas.",
    "Using pandas, load a CSV of employees and compute the average salary per department.",
    "Write a simple Flask app with one endpoint `/health` that returns JSON `{\"status\": \"ok\"}`.",
    "Write a Python program that simulates flipping a coin 1,000 times and reports the longest streak of heads.",
    "Write a class-based iterator in Python that counts down from n to 0.",
    "Write a Python function that pretty-prints a nested dictionary with indentation.",
    "Write a function that splits a list into training and test sets with a given ratio and random seed.",
    "Write a script that watches a folder and prints the name of any new file that appears (polling every second is fine).",
    "Write a unit test with unittest.mock that checks a function calls `requests.get` with the right URL.",
    "Write a Python function that computes the SHA-256 hash of a file without reading it all into memory.",
    "Write a Python script that generates a random password of a given length containing letters, digits and symbols using the secrets module.",
    "Write a function that parses a duration string like '1h30m15s' into a number of seconds.",
    "Implement a simple command-line to-do list in Python that stores tasks in a JSON file.",
    "Write a Python function that inserts a user into a SQLite table and returns the new row id, using parameterized queries.",
    "Show how to use `itertools.groupby` to group a sorted list of (city, temperature) tuples by city and compute the maximum temperature.",
    "Write a Python logging setup that writes INFO messages to a file and WARNING messages and above to the console.",
    "Write a function that schedules a callback to run every N seconds using threading.Timer, with a way to stop it.",
    "Write a Python program that draws a text-based progress bar for a long-running loop.",
    "Write a Python script that compares two text files and prints the lines that differ, using difflib.",
    "Write a function that reads database settings from environment variables, with defaults and type conversion.",
    "Write a generator that produces an endless sequence of prime numbers.",
    "Write a Python function that converts an integer below one million to English words, e.g. 123 -> 'one hundred twenty-three'.",
    "Create a small Tkinter window with a button that counts how many times it was clicked.",
    "Write a Python function that checks whether two rectangles, given as (x, y, width, height), overlap.",
    "Write a script that reads a JSON file of orders and writes a summary report of revenue per month.",
    "Write a Python function that finds all pairs of duplicate files in a directory by comparing their hashes.",
    "Write a minimal HTTP server with http.server that serves a JSON list of items at /items.",
    "Write a Python function that validates a Sudoku board given as a 9x9 list of lists (0 means empty).",
    "Write a simple rock-paper-scissors game for the terminal in Python.",
    "Write a Python script that fetches JSON from a URL, retries on failure with exponential backoff, and prints one field.",
    "Write a small Python class that wraps `sqlite3` and offers `add_note`, `list_notes` and `delete_note`.",
]

ERRORS = [
    "TypeError: 'NoneType' object is not subscriptable",
    "IndexError: list index out of range",
    "KeyError: 'name'",
    "AttributeError: 'str' object has no attribute 'append'",
    "ValueError: invalid literal for int() with base 10: 'abc'",
    "UnboundLocalError: cannot access local variable 'count' where it is not associated with a value",
    "RecursionError: maximum recursion depth exceeded",
    "ModuleNotFoundError: No module named 'requests'",
    "TypeError: unsupported operand type(s) for +: 'int' and 'str'",
    "ZeroDivisionError: division by zero",
    "IndentationError: unexpected indent",
    "RuntimeError: dictionary changed size during iteration",
    "TypeError: 'int' object is not iterable",
    "ImportError: cannot import name 'helper' from partially initialized module 'utils' (most likely due to a circular import)",
    "FileNotFoundError: [Errno 2] No such file or directory: 'data.csv'",
    "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte",
    "TypeError: Report.render() missing 1 required positional argument: 'self'",
    "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)",
]

ERROR_TEMPLATES = [
    "What does this Python error mean and how can I fix it?\n\n{e}",
    "My script crashes with `{e}`. What are the common causes?",
    "Explain the error `{e}` and show a small example that triggers it and a corrected version.",
]

JS_PROMPTS = [
    "Write a JavaScript `debounce(fn, wait)` function and explain when you would use it.",
    "Write a `throttle` function in JavaScript and compare it with debounce.",
    "Write a JavaScript function that deep-clones an object containing nested arrays and plain objects.",
    "Show how to fetch JSON from an API with async/await in JavaScript and handle network errors.",
    "Explain the difference between `let`, `const` and `var` in JavaScript.",
    "What does `this` refer to in JavaScript arrow functions compared with regular functions?",
    "Explain closures in JavaScript with an example.",
    "Explain the JavaScript event loop, including microtasks and macrotasks.",
    "Write a JavaScript function that groups an array of objects by a given key.",
    "Use `Array.prototype.reduce` to compute the total price of items in a shopping cart array.",
    "What is the difference between `==` and `===` in JavaScript?",
    "Write a function that returns a Promise that resolves after a given number of milliseconds, and use it in an async function.",
    "Write JavaScript that adds a click handler to every button with class `copy` that copies its `data-text` attribute to the clipboard.",
    "Explain `Promise.all`, `Promise.allSettled` and `Promise.race` with examples.",
    "Write a Node.js script that reads a text file and prints the number of lines.",
    "Write a simple Express.js server with a GET /users endpoint that returns a JSON array.",
    "Convert this callback-based code to use async/await:\n```javascript\nfs.readFile('a.txt', 'utf8', function (err, data) {\n  if (err) { console.error(err); return; }\n  console.log(data.length);\n});\n```",
    "Write a JavaScript function that checks whether a string is a valid US ZIP code (5 digits, optionally followed by a dash and 4 digits).",
    "Write a React functional component that shows a counter with increment and decrement buttons.",
    "Explain what this JavaScript does:\n```javascript\nconst unique = arr => [...new Set(arr)];\n```",
    "Write a JavaScript function that formats a Date object as YYYY-MM-DD.",
    "How do JavaScript ES modules (import/export) differ from CommonJS require?",
    "Write a TypeScript interface for a blog post with an optional list of tags, and a function that filters posts by tag.",
    "Explain what this JavaScript prints and why:\n```javascript\nfor (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 0);\n}\n```",
    "Write a JavaScript function that converts a nested object into a query string.",
    "How do I remove duplicates from an array of objects by their `id` property in JavaScript?",
]

SCHEMA_HR = (
    "employees(id, name, department_id, salary, hire_date, manager_id)\n"
    "departments(id, name, location)"
)
SCHEMA_SHOP = (
    "customers(id, name, city, signup_date)\n"
    "orders(id, customer_id, order_date, status)\n"
    "order_items(order_id, product_id, quantity, unit_price)\n"
    "products(id, name, category, price)"
)
SQL_QUERIES = [
    (SCHEMA_HR, "the three highest-paid employees in each department"),
    (SCHEMA_HR, "departments whose average salary is above 70000"),
    (SCHEMA_HR, "employees who earn more than their manager"),
    (SCHEMA_HR, "the number of employees hired each year"),
    (SCHEMA_HR, "employees who have no manager"),
    (SCHEMA_HR, "the second highest salary in the company"),
    (SCHEMA_HR, "every department's name with its total payroll, including departments with no employees"),
    (SCHEMA_HR, "employees hired in the last 90 days"),
    (SCHEMA_HR, "a running total of payroll ordered by hire date, using a window function"),
    (SCHEMA_SHOP, "customers who have never placed an order"),
    (SCHEMA_SHOP, "the total revenue per product category in 2023"),
    (SCHEMA_SHOP, "the top 5 customers by total spending"),
    (SCHEMA_SHOP, "the month with the most orders"),
    (SCHEMA_SHOP, "products that were never ordered"),
    (SCHEMA_SHOP, "each customer's most recent order date"),
    (SCHEMA_SHOP, "the average order value per city"),
    (SCHEMA_SHOP, "orders containing more than 3 distinct products"),
    (SCHEMA_SHOP, "the percentage of orders with status 'cancelled'"),
    (SCHEMA_SHOP, "customers who placed orders in two consecutive months"),
]
SQL_TEMPLATES = [
    "Given these tables:\n{schema}\n\nWrite a SQL query to find {q}.",
    "Using the schema below, write a SQL query that returns {q}.\n\n{schema}",
]
SQL_PROMPTS = [
    "Explain the difference between INNER JOIN and LEFT JOIN with an example.",
    "What is the difference between WHERE and HAVING in SQL?",
    "What is a database index, and when can adding one make things slower?",
    "Explain database normalization up to third normal form with a small example.",
    "What does ACID mean for database transactions?",
    "When should I use a window function instead of GROUP BY?",
    "How do I prevent SQL injection in a Python application?",
    "What is a common table expression (CTE) in SQL? Show an example.",
    "What is the difference between UNION and UNION ALL?",
    "Write the CREATE TABLE statements for a small library system with books, members and loans.",
    "Explain the difference between a primary key and a foreign key.",
]

SHELL_PROMPTS = [
    "Write a bash one-liner that finds all `.log` files larger than 10 MB under /var/log.",
    "Write a bash script that backs up a directory into a timestamped .tar.gz archive and deletes backups older than 7 days.",
    "Explain what this command does: `grep -rn --include='*.py' 'TODO' .`",
    "How can I count the number of lines in all Python files in a directory tree from the shell?",
    "Write a shell script that checks whether a website returns HTTP 200 and prints an alert if it does not.",
    "Explain this command: `find . -name '*.tmp' -mtime +30 -delete`",
    "How do I undo my last git commit but keep the changes in my working tree?",
    "What is the difference between `git merge` and `git rebase`?",
    "Write a bash loop that renames every `.txt` file in the current directory to have a `.md` extension.",
    "How do I see which process is listening on port 8080 on Linux?",
    "Explain what `chmod 755 script.sh` does.",
    "Write a bash script that reads a file line by line and prints each line with its line number.",
    "Explain this pipeline: `cat access.log | awk '{print $1}' | sort | uniq -c | sort -rn | head`",
    "How do I set an environment variable permanently for my user in bash?",
    "Write a cron entry that runs `/home/app/cleanup.sh` every day at 2:30 am.",
    "Write a bash function that creates a directory and immediately changes into it.",
    "How do I search my shell history for a command I ran last week?",
    "Write a shell command that replaces every occurrence of 'foo' with 'bar' in all .conf files in a directory using sed.",
    "What do `>`, `>>`, `2>&1` and `|` mean in bash?",
    "Write a bash script that takes a filename as an argument and prints an error if the file doesn't exist.",
    "How can I compress a folder with tar and then extract it somewhere else?",
    "Explain the difference between `$@` and `$*` in a bash script.",
    "Write a Dockerfile for a small Python web app that installs dependencies from requirements.txt and runs `app.py`.",
    "How do I create and activate a Python virtual environment from the terminal on Linux and on Windows?",
    "Write a Makefile with targets to install dependencies, run tests and lint a Python project.",
    "How do I squash my last three git commits into one?",
]


# ---------------------------------------------------------------------------------------
# Chat prompt lists
# ---------------------------------------------------------------------------------------

EXPLAIN_TOPICS = [
    "how vaccines train the immune system", "why the sky is blue", "how compound interest works",
    "plate tectonics", "the water cycle", "how a refrigerator keeps food cold", "black holes",
    "how GPS works out your location", "the greenhouse effect", "how airplanes stay in the air",
    "why we have seasons", "how the stock market works", "what a blockchain is",
    "the causes of the French Revolution", "the Silk Road", "the Industrial Revolution",
    "the fall of the Western Roman Empire", "how neural networks learn from examples", "entropy",
    "how batteries store energy", "ocean tides", "the placebo effect", "opportunity cost",
    "supply and demand", "how credit scores work", "how data travels across the internet",
    "public-key cryptography", "how noise-cancelling headphones work", "why bread dough rises",
    "fermentation", "circadian rhythms", "how muscles grow after exercise", "the stages of sleep",
    "the Doppler effect", "why leaves change color in autumn", "how volcanoes form",
    "how hurricanes form", "the impact of the printing press", "the Cold War",
    "antibiotic resistance", "herd immunity", "index funds", "how solar panels make electricity",
    "nuclear fusion", "how a compiler turns code into a program", "what an API is",
    "how search engines rank web pages", "how recommendation systems work", "cloud computing",
    "ranked-choice voting", "the scientific method", "confirmation bias",
    "why prime numbers matter for online security", "how the heart pumps blood",
    "how bees communicate", "bird migration", "coral reef bleaching", "the Renaissance",
    "why the Titanic sank", "how 3D printing works", "how electric cars work",
    "why a moving bicycle stays upright", "the Monty Hall problem", "exponential growth",
    "why we dream, according to current theories", "how a bill becomes law in the United States",
    "how the immune system tells friend from foe", "how glaciers shape landscapes",
    "what causes the northern lights", "how a camera lens focuses light", "the Big Bang theory",
    "how wind turbines generate power", "why ice floats", "how mortgages work",
    "the difference between weather and climate", "how the kidneys filter blood",
    "how encryption keeps messages private", "how submarines dive and surface",
]

EXPLAIN_TEMPLATES_CHAT = [
    "Explain {t} in simple terms.",
    "Can you explain {t} to a 12-year-old?",
    "Give me a short, clear explanation of {t}.",
    "Write a three-paragraph explanation of {t} for a general audience.",
    "I never really understood {t}. Could you walk me through it with an everyday analogy?",
    "What are the most common misconceptions about {t}?",
    "Explain {t} in five bullet points.",
]

HOWTO_TASKS = [
    "change a flat tire", "start a vegetable garden on a balcony", "prepare for a job interview",
    "make a sourdough starter", "learn a new language as an adult", "set up a monthly budget",
    "train for my first 5K run", "negotiate a higher salary", "write a good cover letter",
    "organize a small home office", "improve my sleep", "meal prep for a busy week",
    "start a journaling habit", "back up the photos on my phone", "clean a cast iron pan",
    "keep a succulent alive", "cut down on screen time", "plan a road trip",
    "give a good presentation", "learn to touch type", "make cold brew coffee",
    "teach a puppy to sit", "remove a coffee stain from a shirt", "secure my home Wi-Fi network",
    "start investing with a small amount of money", "write a clear bug report",
    "memorize a speech", "declutter my closet", "make friends as an adult",
    "take better photos with my phone", "paint a room", "fix a squeaky door",
    "brew a good cup of tea", "start running again after an injury", "prepare for a long-haul flight",
    "write a résumé with no work experience", "study effectively for an exam",
    "plan a small wedding on a budget", "care for a cast iron skillet", "make homemade pasta",
    "deal with jet lag", "learn to juggle", "lower my electricity bill", "read faster",
    "set up a home compost bin", "make a simple website for my small business",
    "stay productive while working from home", "sharpen a kitchen knife", "start birdwatching",
    "organize my digital files", "keep houseplants alive while on vacation",
]

HOWTO_TEMPLATES = [
    "How do I {t}?",
    "What's the best way to {t}?",
    "Give me a step-by-step guide to {t}.",
    "I'm a complete beginner. How should I {t}?",
    "What are common mistakes people make when they try to {t}?",
    "Write a short checklist for how to {t}.",
]

EMAIL_PURPOSES = [
    "ask my landlord to fix a leaking faucet", "politely decline a job offer",
    "ask my professor for a one-week extension on an assignment",
    "thank a colleague who helped me finish a difficult project", "follow up after a job interview",
    "invite my team to a farewell lunch for a coworker", "apologize to a customer for a delayed shipment",
    "ask my neighbor to keep the noise down after 11 pm", "request a refund for a broken blender",
    "introduce myself to a new client", "remind a friend about money they borrowed",
    "propose a four-day work week trial to my manager", "announce a new product to our newsletter subscribers",
    "cancel my gym membership", "ask a former manager for a letter of recommendation",
    "tell my team about a change in the project deadline", "welcome a new employee to the team",
    "ask a local bakery to cater a small office party", "complain to an airline about lost luggage",
    "congratulate a colleague on their promotion",
]

EMAIL_TEMPLATES = [
    "Write an email to {p}.",
    "Draft a brief, friendly email to {p}.",
    "Write a formal email to {p}. Keep it under 150 words.",
    "Help me write a polite but firm email to {p}.",
]

STORY_GENRES = [
    "science fiction", "mystery", "fantasy", "funny", "heartwarming", "spooky (but not gory)",
    "adventure", "fairy-tale style", "slice-of-life", "historical fiction",
]
STORY_CHARACTERS = [
    "a retired lighthouse keeper", "a robot vacuum cleaner", "a nervous first-year teacher",
    "a dragon who is afraid of heights", "a food-truck owner with a fierce rival", "a girl who can talk to plants",
    "a detective who is also a cat", "an astronaut stuck in quarantine", "a grandmother learning to skateboard",
    "a forgetful wizard", "a street musician", "a sock that got lost in the laundry", "a shy bookshop owner",
    "a goat that wants to be a racehorse",
]
STORY_SITUATIONS = [
    "finds a map hidden inside a library book", "has to fix a problem before sunrise",
    "finds a key that opens every door in town", "must win a baking competition",
    "discovers that every clock in town has stopped", "gets lost during a snowstorm",
    "has to keep a secret during a family dinner", "finds an unusual creature in the backyard",
    "must teach someone a new skill in one week", "receives a mysterious package with no return address",
    "accidentally becomes the mayor of a small village", "tries to return a lost wallet to its owner",
]
STORY_TEMPLATES = [
    "Write a short {genre} story about {char} who {sit}.",
    "Write a {genre} story of about 300 words in which {char} {sit}.",
    "Tell me a bedtime story about {char} who {sit}.",
    "Write the opening scene of a {genre} story about {char} who {sit}.",
]

POEM_FORMS = [
    "a haiku", "a limerick", "a sonnet", "a short free-verse poem", "a rhyming poem for children",
    "a four-line poem", "an ode", "a poem in the style of a nursery rhyme", "a poem with three stanzas",
]
POEM_SUBJECTS = [
    "morning coffee", "the first snow of winter", "a city at night", "an old bicycle",
    "the ocean at low tide", "learning to code", "a lost umbrella", "friendship", "autumn leaves",
    "a thunderstorm", "the moon over a quiet lake", "a busy train station", "homemade bread",
    "a cat watching birds", "the last day of school", "a lighthouse", "Monday mornings",
    "a garden after rain", "a grandparent's kitchen", "a long road trip",
]
ACROSTIC_WORDS = ["SPRING", "RIVER", "COURAGE", "PYTHON", "KINDNESS", "SUMMER", "HOME", "JOURNEY"]

WRITING_PROMPTS = [
    "Write a product description for a reusable water bottle that keeps drinks cold for 24 hours.",
    "Write a product description for a solar-powered camping lantern.",
    "Write a short product description for a handmade ceramic mug.",
    "Write a toast for my sister's wedding. She loves hiking and terrible puns.",
    "Write a short speech for the retirement party of a teacher who worked at our school for 30 years.",
    "Write a welcome speech for the opening of a community garden.",
    "Write a LinkedIn post announcing that I've started a new job as a data analyst.",
    "Write a short news article about a fictional town festival celebrating giant pumpkins.",
    "Write a thank-you note to my neighbors who looked after my cat while I was away.",
    "Write five catchy slogans for a bicycle repair shop.",
    "Write a 100-word bio for a freelance graphic designer.",
    "Write a restaurant review of a fictional ramen shop, in an enthusiastic tone.",
    "Write a diary entry from the point of view of a dog on its first day in a new home.",
    "Write a cover letter for a junior marketing assistant position.",
    "Write an Instagram caption for a photo of a sunset over the mountains.",
    "Write a short motivational message for a friend who is running their first marathon tomorrow.",
    "Write the rules for a simple card game that can be played by two people.",
    "Write a haiku-style fortune cookie message for a tech company's office party.",
    "Write a short FAQ section for a dog-walking business website.",
    "Write a letter to your future self to be opened in ten years.",
    "Write a funny out-of-office email reply for someone on a fishing trip.",
    "Write a short description of a fictional planet for a science fiction game.",
    "Write a one-paragraph pitch for a mobile app that helps people swap houseplants.",
    "Write a eulogy for a beloved family goldfish, in a gently humorous tone.",
    "Write a short scene of dialogue between a customer and a very literal-minded shopkeeper.",
    "Write a recipe introduction for grandmother's apple cake, the kind you'd see on a food blog.",
    "Write a persuasive paragraph encouraging people to visit their local library.",
    "Write a short children's story that teaches why sharing is important.",
    "Write the text for a poster advertising a lost cat named Biscuit.",
    "Write a job advertisement for a part-time barista at a small cafe.",
    "Write a short, encouraging note for a student who failed a test.",
    "Write a press release announcing that a small town library has extended its opening hours.",
    "Write a limerick about a programmer who forgot to save their work.",
    "Write a friendly reminder message for a book club meeting on Thursday.",
    "Write a two-sentence horror story set in an office.",
    "Write a description of a cozy mountain cabin for a vacation rental listing.",
    "Write a short monologue for a villain who is secretly very polite.",
    "Write a heartfelt birthday card message for my best friend turning 30.",
    "Write a set of house rules for a shared student apartment, in a lighthearted tone.",
    "Write a short opinion piece on whether schools should teach personal finance.",
]

PASSAGES = [
    "When the city council approved the plan to turn the empty lot on Maple Street into a community garden, few residents expected much. Two years later, the garden has forty raised beds, a waiting list of sixty families, and a weekly stall where surplus vegetables are sold to pay for seeds and tools. Volunteers say the biggest change is social: neighbors who had never spoken now share watering schedules, recipes, and childcare. The council is now considering three more lots for similar projects.",
    "A two-year study of about 1,500 staff at a logistics firm found that letting employees work from home two days a week had no measurable effect on their performance reviews, while the number of people quitting fell by roughly a third. The effect was strongest for employees with long commutes and for parents of young children. Many managers had predicted a drop in productivity at the start of the trial, but by the end most said they had changed their minds.",
    "Octopuses have around 500 million neurons, and about two-thirds of them are located in their arms rather than in their central brain. This unusual layout means each arm can taste, touch, and even make simple decisions on its own. Researchers have watched octopuses open jars, escape from tanks, and recognize individual keepers. Because their last common ancestor with humans lived hundreds of millions of years ago, octopus intelligence is often described as a separate experiment in evolving a complex mind.",
    "Several public library systems have stopped charging late fees in recent years. Librarians argued that fines brought in little money compared with the cost of collecting them, and that they kept away the very people who most needed the library, often children and low-income families. After dropping fines, many libraries reported that more overdue books came back, not fewer, and that new card registrations went up.",
    "Brightleaf, a small startup based in Leeds, announced on Tuesday a compostable laptop sleeve made from pressed hemp fibers and a plant-based resin. The company says the sleeve protects against drops of up to one meter and breaks down in an industrial composting facility within six months. It will cost 29 pounds and ship in March. Critics point out that few households have access to industrial composting, so many sleeves may still end up in landfill.",
    "During deep sleep, the brain replays patterns of activity from the day, a process scientists believe helps move memories from short-term storage in the hippocampus to longer-term storage in the cortex. In experiments, people who sleep after learning a list of words remember more of them the next day than people who stay awake for the same amount of time. Disrupting deep sleep, even without fully waking the sleeper, reduces this benefit.",
    "In the hot summer of 1858, the smell from the sewage-filled River Thames became so overwhelming that Parliament considered leaving London. The crisis, later nicknamed the Great Stink, finally pushed lawmakers to fund a huge sewer network designed by the engineer Joseph Bazalgette. His intercepting sewers carried waste away from the city center and helped end the cholera outbreaks that had killed tens of thousands of Londoners. Much of the system is still in use today.",
    "Notes from Monday's team meeting: the website redesign is two weeks behind because the new image library arrived late. Priya will check whether we can launch with the old images and swap them later. Marco raised concerns about the accessibility audit, which has not been scheduled yet; he will contact the vendor by Wednesday. The budget is on track. The next meeting moves to Thursday at 10 am because of the public holiday.",
    "I bought this stand mixer for my bakery after my old one broke. The motor is powerful and handled stiff bread dough without straining, and the bowl is easy to clean. However, it is very loud, the attachments feel cheap compared with the machine itself, and the instructions were confusing. Customer service did replace a missing splash guard within three days. Overall I'm happy, but I'd only recommend it if noise isn't a concern.",
    "When a forager honeybee finds a good patch of flowers, she returns to the hive and performs a waggle dance on the vertical surface of the comb. The angle of her run relative to straight up tells the other bees the direction of the food relative to the sun, and the length of the waggle signals the distance. Other bees follow the dance and then fly out to find the flowers themselves. The biologist Karl von Frisch decoded the dance and shared a Nobel Prize for the work in 1973.",
    "Last spring the town of Hollins Bay closed its main shopping street to cars on weekends as a trial. Shop owners worried that customers who drove in from nearby villages would stop coming. Instead, foot traffic rose by about a fifth, and most cafes reported higher sales. Businesses that rely on bulky purchases, such as a furniture store and a hardware shop, did see fewer customers. The council will vote next month on whether to make the closure permanent and add more bike parking.",
    "The year 1816 became known as the Year Without a Summer. A massive eruption of Mount Tambora in Indonesia the year before had thrown enormous amounts of ash and sulfur into the upper atmosphere, which reflected sunlight and cooled the planet. Crops failed across Europe and North America, food prices soared, and snow fell in New England in June. The gloomy weather also kept a group of writers indoors near Lake Geneva, where Mary Shelley began writing Frankenstein.",
]
SUMMARY_TEMPLATES = [
    "Summarize the following text in one sentence.\n\n{p}",
    "Give me a three-bullet summary of this passage:\n\n{p}",
    "What is the main point of the following paragraph? Answer in two sentences.\n\n{p}",
    "Read this and write a short headline and a one-sentence summary:\n\n{p}",
    "Summarize this for a busy reader in under 40 words:\n\n{p}",
    "List the key facts in this text:\n\n{p}",
]

REWRITE_SENTENCES = [
    "hey, just wanted to let u know the meeting got moved to 3, dont be late lol",
    "The results of the experiment which was conducted by the team last week were not as good as what we had hoped they would be.",
    "Our product is good and it has many features and it is also cheap and people like it.",
    "Me and him was going to the store when it started raining real hard.",
    "Due to the fact that the printer is broken at this point in time, we are unable to print the reports.",
    "I think maybe we could possibly consider changing the deadline if that is okay with everyone.",
    "The new software update makes the app faster, fixes bugs, and adds a dark mode.",
    "its been a long week and honestly im kind of over it but the project is finally done",
    "Customers who purchase a subscription prior to the end of the month will be eligible to receive a complimentary tote bag.",
    "The cat, which was black and which was sitting on the fence, looked at the dog that was barking.",
    "Your order has been delayed because of problems in our warehouse.",
    "Their going to announce the winners tomorrow, so everyone should of submitted there entries by now.",
]
REWRITE_INSTRUCTIONS = [
    "Rewrite this sentence to sound more professional:",
    "Make this sentence more concise:",
    "Fix the grammar and spelling in this sentence:",
    "Rewrite this so a 7-year-old could understand it:",
    "Rewrite this sentence in a friendly, upbeat tone:",
    "Paraphrase this sentence in two different ways:",
]

ADVICE_SITUATIONS = [
    "I keep procrastinating on important tasks until the last minute",
    "I just moved to a new city and don't know anyone",
    "My coworker often takes credit for my ideas in meetings",
    "I want to switch careers from accounting to software development",
    "I get very nervous before speaking in public",
    "My roommate never does the dishes",
    "I have trouble falling asleep because my mind keeps racing",
    "I'm starting my first job as a manager next week",
    "I want to read more books but never find the time",
    "My teenager spends most evenings gaming and skipping homework",
    "I have $2,000 in savings and some high-interest credit card debt",
    "I want to get back into exercise after a long break",
    "My best friend forgot my birthday and I feel hurt",
    "I have two job offers: one pays more, the other has better work-life balance",
    "I feel overwhelmed by the number of emails I get every day",
    "I'm learning to play guitar but my progress has stalled",
    "I want to ask for a raise but I'm afraid of being turned down",
    "My elderly parents live far away and I worry about them",
    "I keep spending too much money on takeout food",
    "I need to give difficult feedback to a team member who is also a friend",
    "I'm a college student struggling to stay focused while studying",
    "I want to start a small online business selling handmade jewelry",
    "I'm going on my first solo trip abroad next month",
    "My neighbors' dog barks all night",
    "I've been feeling lonely since I started working from home",
    "I want to eat healthier but I don't enjoy cooking",
    "I made a mistake at work that cost my team a day of work",
    "I'm preparing for my first half marathon in four months",
    "I want to become more confident in social situations",
    "My small team keeps missing deadlines",
    "I'm thinking about adopting a dog but I live in a small apartment",
    "I have a big exam in three weeks and haven't started studying",
    "I want to spend less time on my phone",
    "I was rejected from a job I really wanted",
    "I'm a new parent and feel exhausted all the time",
    "My family always argues about politics at holiday dinners",
    "I want to learn to cook but I only have a tiny kitchen",
]
ADVICE_TEMPLATES = [
    "{s}. What should I do?",
    "{s}. Can you give me some practical advice?",
    "{s}. What are a few concrete steps I could take this week?",
    "Here's my situation: {s}. How would you approach it?",
]

COMPARISONS = [
    ("renting a home", "buying a home", ""), ("cats", "dogs", " as pets"),
    ("electric cars", "gasoline cars", ""), ("Python", "JavaScript", " as a first programming language"),
    ("paper books", "e-readers", ""), ("working from home", "working in an office", ""),
    ("index funds", "individual stocks", " for a new investor"), ("trains", "planes", " for travel within Europe"),
    ("tea", "coffee", " as a morning drink"), ("running", "swimming", " for general fitness"),
    ("freelancing", "full-time employment", ""), ("SQL databases", "NoSQL databases", ""),
    ("learning from videos", "learning from books", ""), ("taking a gap year", "going straight to university", ""),
    ("solar panels", "a heat pump", " as a first home energy upgrade"),
    ("living in a big city", "living in a small town", ""), ("a standing desk", "a regular desk", ""),
    ("Linux", "Windows", " for software development"), ("baking with butter", "baking with oil", ""),
    ("credit cards", "debit cards", ""), ("group study", "studying alone", ""),
    ("camping", "staying in hotels", " on a road trip"), ("a gas stove", "an induction cooktop", ""),
    ("leasing a car", "buying a car", ""), ("nuclear power", "wind power", " for cutting emissions"),
    ("public transport", "cycling", " for a daily commute"), ("a laptop", "a desktop computer", " for a student"),
    ("hiring a personal trainer", "following an online workout program", ""),
    ("impressionism", "realism", " in painting"), ("Stoicism", "Epicureanism", " as guides for everyday life"),
    ("agile", "waterfall", " project management"), ("cloud hosting", "running your own servers", " for a small company"),
    ("learning piano", "learning guitar", " as an adult beginner"), ("a savings account", "a bond fund", " for an emergency fund"),
]
COMPARE_TEMPLATES = [
    "Compare {a} and {b}{ctx}.",
    "What are the pros and cons of {a} versus {b}{ctx}?",
    "Should I choose {a} or {b}{ctx}? Help me think it through.",
    "Make a table comparing {a} and {b}{ctx} on the factors that matter most.",
    "Write a balanced short essay comparing {a} and {b}{ctx}.",
]

ROLES = [
    ("a medieval blacksmith", ["Describe a typical day in your forge.", "A young apprentice asks how to choose good iron. What do you tell them?"]),
    ("a tour guide in ancient Rome", ["Welcome a group of visitors to the Forum and describe what they are seeing.", "A visitor asks where to find the best food in the city. Answer in character."]),
    ("a barista who loves puns", ["Take my order for a large oat-milk latte.", "Recommend a drink for someone who had a terrible day."]),
    ("a grumpy pirate captain", ["Explain the rules of your ship to a new crew member.", "Your crew wants a day off. Respond to their request."]),
    ("a patient chess coach", ["I keep losing my queen early in games. Coach me.", "Explain to a beginner why controlling the center matters."]),
    ("a detective in 1920s Chicago", ["Describe the scene as you walk into a jazz club looking for a witness.", "Question me: I'm a suspect who claims I was at the cinema all night."]),
    ("a friendly librarian", ["Recommend three books to a teenager who loved a fantasy series and wants something new.", "Explain to a child how to find a book using the library catalog."]),
    ("a customer support agent for an internet provider", ["My internet keeps dropping every evening. Help me troubleshoot.", "I want to cancel my plan. Handle my request politely."]),
    ("an interviewer for a junior software developer role", ["Ask me the first interview question and wait for my answer.", "Give me feedback on this answer: 'My biggest weakness is that I work too hard.'"]),
    ("a nature documentary narrator", ["Narrate a house cat trying to catch a fly.", "Narrate office workers gathering around a box of donuts."]),
    ("a robot who is learning about human emotions", ["Describe what you think 'nostalgia' means.", "Ask me three questions to understand why people cry at weddings."]),
    ("a travel agent", ["I have one week and a modest budget in early spring. Suggest a destination and sell it to me.", "I want a quiet beach holiday without a long flight from London. What do you propose?"]),
    ("a personal fitness coach", ["Motivate me to go for a run on a cold, rainy morning.", "I can only train 20 minutes a day at home. What's my plan?"]),
    ("a Victorian-era inventor", ["Present your newest invention to a skeptical audience.", "Describe what you imagine homes will look like in 150 years."]),
    ("a kind kindergarten teacher", ["Explain to the class why we wash our hands.", "Help two children who both want the same toy."]),
    ("a game master running a fantasy tabletop game", ["Start a new adventure for me; my character is an elf ranger.", "My character tries to persuade a suspicious innkeeper. Describe what happens."]),
    ("a sommelier", ["Recommend a wine for a mushroom risotto and explain why.", "Describe a cheap supermarket wine as elegantly as you can."]),
    ("a guide at a natural history museum", ["Explain the dinosaur skeleton in front of us to a group of ten-year-olds.", "A visitor asks how we know how old the fossils are. Answer."]),
    ("a startup founder pitching to investors", ["Pitch an app that helps neighbors share tools.", "An investor asks how you'll make money. Respond."]),
    ("a medieval town crier", ["Announce the opening of the new market square.", "Announce that the king's prize pig has escaped."]),
]
ROLE_TEMPLATES = [
    "Pretend you are {role}. {req}",
    "Act as {role}. {req}",
    "I want you to role-play as {role}. {req}",
    "You are {role}. Stay in character. {req}",
]

BRAINSTORM_TOPICS = [
    "fun rainy-day activities for kids", "names for a neighborhood bakery",
    "birthday gifts for a grandmother who loves gardening", "science fair projects for middle school students",
    "ways to reduce food waste at home", "team-building activities for a remote team",
    "blog post topics about personal finance for students", "themes for a board game",
    "ways to save water at home", "icebreaker questions for a workshop",
    "side projects for a beginner programmer", "day trips for a weekend away from the city",
    "low-cost date night ideas", "ways a small cafe could attract more customers",
    "topics for a school podcast", "uses for an old glass jar", "plot twists for a mystery novel",
    "names for a fantasy kingdom", "healthy snacks to take to work", "ways to make a long flight more comfortable",
    "fundraising ideas for a school library", "questions to ask at the end of a job interview",
    "features for a habit-tracking app", "costume ideas made from household items",
    "activities for a family reunion", "ways to learn vocabulary in a new language",
    "small habits that improve productivity", "ways to make a small apartment feel bigger",
    "themes for a company hackathon", "community projects for a neighborhood association",
    "titles for a travel memoir", "ways to celebrate a coworker's promotion",
    "mobile game ideas that could be built in a weekend", "creative ways to teach fractions",
    "questions for getting to know a new friend", "ideas for a 30-day photography challenge",
    "eco-friendly wedding ideas", "ways to use leftover rice", "topics for a short TED-style talk",
    "welcome activities for a new employee's first week",
]
BRAINSTORM_TEMPLATES = [
    "Give me {n} {t}.",
    "Brainstorm {n} {t}, with a one-line explanation for each.",
    "List {n} creative {t}.",
    "I need some inspiration. Can you suggest {n} {t}?",
]

KNOWLEDGE = [
    "What were the main causes of the First World War?",
    "Who was Ada Lovelace and why is she remembered?",
    "Why did the Roman Empire split into eastern and western halves?",
    "How did the printing press change Europe?",
    "What is the significance of the Magna Carta?",
    "Why is the Amazon rainforest important for the whole planet?",
    "How do bees make honey?",
    "Why do cats purr?",
    "What is the tallest mountain in Africa and how tall is it?",
    "How were the pyramids of Giza most likely built, according to current evidence?",
    "What was the Marshall Plan?",
    "What are the three branches of the US government and what does each do?",
    "What is the difference between a virus and a bacterium?",
    "Why is Pluto no longer classified as a planet?",
    "What is the Fibonacci sequence and where does it show up in nature?",
    "How does the United Nations Security Council work?",
    "What happened during the Apollo 13 mission?",
    "What was the Harlem Renaissance?",
    "Why do we have leap years?",
    "What is the Turing test?",
    "What are microplastics and why are scientists concerned about them?",
    "Who was Marie Curie and what did she discover?",
    "What is the origin of the Olympic Games?",
    "Why is the Dead Sea so salty?",
    "What is the difference between an alligator and a crocodile?",
    "How did the Netherlands reclaim land from the sea?",
    "What is impressionism in painting?",
    "What does a central bank do?",
    "Why is the ocean salty while most rivers are not?",
    "What is the Rosetta Stone and why was it important?",
    "What is the Great Barrier Reef and what threatens it?",
    "What are decibels and how is loudness measured?",
    "Who built Machu Picchu and what was it used for?",
    "What was the Berlin Wall and why did it fall?",
    "How do tides differ between the Atlantic and the Mediterranean, and why?",
    "What is the difference between a comet and an asteroid?",
    "Why do onions make people cry?",
    "What was the Meiji Restoration?",
]

CITIES = ["Lisbon", "Kyoto", "Mexico City", "Edinburgh", "Cape Town", "Montreal", "Istanbul",
          "Buenos Aires", "Vienna", "Singapore", "Seoul", "Marrakech", "Copenhagen", "Hanoi"]
INTERESTS = ["food", "history", "art museums", "hiking and nature", "a tight budget",
             "traveling with young kids", "architecture", "live music"]
PLANNING_OTHER = [
    "Create a 5-day vegetarian dinner plan for a family of four on a limited budget.",
    "Create a one-week meal plan for someone who wants more protein but doesn't eat meat.",
    "Make a simple weekly meal plan for a college student with only a microwave and a kettle.",
    "Design a 4-week beginner workout plan for someone who wants to be able to do ten push-ups.",
    "Design a 3-days-a-week strength training plan for a beginner with only dumbbells.",
    "Make a 6-week plan to go from walking to running 5 km without stopping.",
    "Make a 4-week study plan for learning the basics of Spanish, 30 minutes a day.",
    "Make a 6-week plan for learning the basics of Python for data analysis.",
    "Create a study schedule for someone preparing for a statistics exam in three weeks.",
    "Plan a surprise 40th birthday party for 20 people on a modest budget.",
    "Plan a one-day offsite for a team of 12, with a mix of work sessions and fun activities.",
    "Plan a science-themed birthday party for an eight-year-old.",
    "Plan a neighborhood cleanup day, including a timeline and a list of supplies.",
    "Create a morning routine for someone who wants to be more productive but isn't a morning person.",
    "Plan a weekend camping trip for beginners, including a packing list.",
    "Create a 30-day plan to declutter a three-bedroom house.",
    "Plan a Thanksgiving-style dinner for eight people, with a cooking timeline.",
    "Plan the first week of onboarding for a new junior developer.",
]

LOGIC_PUZZLES = [
    "Three friends, Asha, Ben and Carla, each own exactly one pet: a cat, a dog or a parrot. Asha is allergic to fur. Ben's pet cannot fly. Carla does not own the dog. Who owns which pet? Explain your reasoning.",
    "I am thinking of a two-digit number. The sum of its digits is 11, and if you reverse the digits, the number increases by 27. What is the number?",
    "A clock shows 3:15. What is the angle between the hour hand and the minute hand?",
    "If 4 printers can print 4 posters in 4 minutes, how long would 12 printers take to print 12 posters?",
    "A snail is at the bottom of a 10-meter well. Each day it climbs 3 meters, and each night it slides back 2 meters. On which day does it reach the top?",
    "You have two ropes that each take exactly one hour to burn, but they burn unevenly. How can you measure exactly 45 minutes?",
    "A farmer has chickens and cows. Together they have 30 heads and 74 legs. How many chickens and how many cows are there?",
    "What number comes next in the sequence 2, 6, 12, 20, 30, ...? Explain the pattern.",
    "What comes next in the sequence 1, 1, 2, 6, 24, ...? Explain.",
    "A notebook and a pencil cost $1.30 together. The notebook costs $1.00 more than the pencil. How much does the pencil cost?",
    "Is this argument valid? 'All roses are flowers. Some flowers fade quickly. Therefore, some roses fade quickly.' Explain.",
    "Four people must cross a bridge at night with one flashlight. At most two can cross at a time, and a pair moves at the slower person's pace. Their crossing times are 1, 2, 5 and 10 minutes. What is the shortest total time for everyone to cross?",
    "Mia is taller than Leo. Leo is taller than Sam. Sam is taller than Ivy. Who is the second shortest, and how do you know?",
    "How many times does the digit 7 appear when you write out all the whole numbers from 1 to 100?",
    "A drawer contains 6 red socks and 8 blue socks. In the dark, how many socks must you take out to be sure of getting a matching pair? How many to be sure of getting two blue socks?",
    "If you write the numbers from 1 to 50, how many of them contain the digit 3 at least once?",
    "A shop sells a shirt for $40 after a 20% discount. What was the original price? Explain why the answer is not $48.",
    "Five friends shake hands with each other exactly once. How many handshakes are there in total? Generalize the answer for n people.",
]

NAMES = ["Maya", "Omar", "Priya", "Lucas", "Sofia", "Kenji", "Amara", "Diego", "Hannah", "Tariq",
         "Elena", "Noah", "Zara", "Felix", "Ines", "Ravi", "Greta", "Jonah"]
ITEMS = ["jacket", "pair of headphones", "backpack", "desk lamp", "pair of running shoes", "coffee grinder",
         "board game", "winter coat", "bicycle helmet", "blender"]
MATH_SUFFIXES = ["", "", " Explain your reasoning step by step.", " Show your work.", " Explain each step briefly."]


def money(x):
    return f"${x:.2f}" if x != int(x) else f"${int(x)}"


def math_problem(kind, rng):
    name = rng.choice(NAMES)
    if kind == 0:
        a = rng.choice([2, 2.5, 3, 3.5, 4, 4.5, 5]); b = rng.choice([0.75, 1, 1.25, 1.5, 2])
        x = rng.randint(2, 6); y = rng.randint(2, 5)
        cost = a * x + b * y
        bill = 20 if cost < 20 else 50
        return f"{name} buys {x} notebooks at {money(a)} each and {y} pens at {money(b)} each, paying with a {money(bill)} bill. How much change does {name} get back?"
    if kind == 1:
        v = rng.randint(12, 25); t = rng.randint(2, 4); k = rng.randint(5, 9)
        return f"A cyclist rides {v * t} km in {t} hours at a constant speed. How long will it take the cyclist to ride {v * k} km at the same speed?"
    if kind == 2:
        p = rng.choice([40, 60, 80, 120, 150, 200]); pct = rng.choice([10, 15, 20, 25, 30]); c = rng.choice([5, 10, 15])
        item = rng.choice(ITEMS)
        return f"A {item} costs {money(p)}. The store takes {pct}% off, and then {name} uses a {money(c)} coupon on the discounted price. What is the final price?"
    if kind == 3:
        a, b = rng.choice([(3, 6), (4, 12), (6, 12), (10, 15), (2, 3), (5, 20), (4, 6), (12, 24)])
        return f"One hose can fill a pool in {a} hours and a second hose can fill it in {b} hours. How long will it take to fill the pool if both hoses run together?"
    if kind == 4:
        b = rng.randint(3, 12); k = rng.randint(2, 4); y = rng.randint(2, 10)
        s = k * b + b + 2 * y
        return f"{name} is {k} times as old as a younger cousin. In {y} years, the sum of their two ages will be {s}. How old is {name} now?"
    if kind == 5:
        scores = [rng.randint(60, 95) for _ in range(4)]
        for avg in range(90, 60, -1):
            need = 5 * avg - sum(scores)
            if 60 <= need <= 100:
                break
        return f"{name} scored {scores[0]}, {scores[1]}, {scores[2]} and {scores[3]} on four quizzes. What score does {name} need on the fifth quiz to have an average of exactly {avg}?"
    if kind == 6:
        n = rng.choice([12, 18, 24, 30]); f = rng.choice([1.5, 2, 2.5, 3])
        m = rng.choice([n // 2 * 3, n * 2, n // 3 * 4])
        return f"A recipe for {n} muffins uses {f} cups of flour. How many cups of flour are needed to make {m} muffins?"
    if kind == 7:
        l = rng.randint(8, 30); w = rng.randint(5, 20); c = rng.choice([4, 6, 7.5, 9, 12]); g = rng.choice([1, 2, 3])
        return f"A rectangular garden measures {l} m by {w} m. Fencing costs {money(c)} per meter. How much will it cost to fence the whole garden if a {g} m gap is left for a gate?"
    if kind == 8:
        r = rng.randint(3, 8); b = rng.randint(2, 7); g = rng.randint(1, 5)
        return f"A jar holds {r} red, {b} blue and {g} green marbles. Two marbles are drawn without putting the first one back. What is the probability that both are red?"
    if kind == 9:
        h = rng.randint(1, 9); m = rng.choice([0, 10, 15, 20, 30, 40, 45, 50]); d = rng.randint(85, 175)
        return f"A film starts at {h}:{m:02d} pm and runs for {d} minutes. At what time does it end?"
    if kind == 10:
        a = rng.randint(2, 9); x = rng.randint(-10, 15); b = rng.randint(-20, 20) or 7
        c = a * x + b
        op = f"+ {b}" if b > 0 else f"- {-b}"
        return f"Solve for x: {a}x {op} = {c}."
    if kind == 11:
        x = rng.randint(3, 40); y = rng.randint(1, x - 1)
        return f"Find two numbers whose sum is {x + y} and whose difference is {x - y}."
    if kind == 12:
        a = rng.choice([15, 20, 25, 30, 40]); s = rng.choice([0, 35, 60, 85, 120]); p = rng.choice([249, 320, 450, 599, 700])
        item = rng.choice(ITEMS)
        return f"{name} saves {money(a)} every week and already has {money(s)}. How many weeks will it take until {name} can afford a {item} that costs {money(p)}?"
    if kind == 13:
        w = rng.choice([3, 4, 5, 6]); h = rng.choice([2, 3, 4]); d = rng.choice([6, 8, 10, 12]); w2 = w * rng.choice([2, 3]); h2 = h * rng.choice([2, 3, 4])
        return f"If {w} workers can paint {h} houses in {d} days, how many days would {w2} workers need to paint {h2} houses, assuming everyone works at the same rate?"
    if kind == 14:
        n = rng.choice([20, 24, 30, 40, 50]); p = rng.choice([10, 20, 30, 40, 50, 60])
        return f"In a class of {n} students, {p}% walk to school, and half of the remaining students take the bus. How many students take the bus?"
    if kind == 15:
        l = rng.choice([5.5, 6, 6.5, 7, 8]); d = rng.choice([240, 320, 450, 600, 780]); c = rng.choice([1.6, 1.75, 1.8, 1.9])
        return f"A car uses {l} liters of fuel per 100 km. How much fuel does it need for a {d} km trip, and how much will that fuel cost at {money(c)} per liter?"
    if kind == 16:
        p = rng.choice([500, 1200, 2500, 4000, 8000]); y = rng.randint(2, 6); r = rng.choice([2, 3, 3.5, 4, 5])
        return f"How much interest does {money(p)} earn in {y} years at a simple annual interest rate of {r}%? What is the total amount at the end?"
    if kind == 17:
        l = rng.choice([3, 3.5, 4, 4.5, 5, 6]); w = rng.choice([2.5, 3, 3.5, 4])
        return f"A room is {l} m long and {w} m wide. How many square tiles measuring 50 cm by 50 cm are needed to cover the floor?"
    if kind == 18:
        adult = rng.choice([8, 10, 12, 15]); student = rng.choice([4, 5, 6]); na = rng.randint(40, 120); ns = rng.randint(30, 150)
        return f"A school sold {na + ns} tickets to a play. Adult tickets cost {money(adult)} and student tickets cost {money(student)}. If ticket sales brought in {money(adult * na + student * ns)}, how many adult tickets were sold?"
    if kind == 19:
        n = rng.choice([120, 240, 360, 480]); a = rng.choice([2, 3, 4]); b = rng.choice([3, 4, 5, 6])
        return f"A bakery made {n} cookies. It sold 1/{a} of them in the morning and 1/{b} of the remaining cookies in the afternoon. How many cookies are left?"
    raise ValueError(kind)


N_MATH_KINDS = 20


# ---------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------

def weighted_choice(rng, weighted):
    total = sum(w for w, _ in weighted)
    r = rng.uniform(0, total)
    for w, item in weighted:
        r -= w
        if r <= 0:
            return item
    return weighted[-1][1]


def build_code(rng):
    specs = [Spec(*s) for s in SPECS]
    names = [s.name for s in specs]
    assert len(set(names)) == len(names), "duplicate spec name"
    clash = sorted(set(names) & HUMANEVAL_NAMES)
    assert not clash, f"spec names collide with HumanEval entry points: {clash}"

    pools = {k: [] for k in ["code-complete", "code-write", "code-explain", "code-fix", "code-test",
                             "code-refactor", "code-translate", "javascript", "code-class",
                             "code-algorithm", "code-concept", "code-task", "code-error", "sql", "shell"]}
    for s in specs:
        for with_examples in (True, False):
            tpl = weighted_choice(rng, COMPLETE_TEMPLATES)
            pools["code-complete"].append(tpl.format(code=s.completion_code(with_examples)))
        d3, base = third_person(s.doc), lower_first(s.doc)
        for tpl in rng.sample(WRITE_TEMPLATES, 2):
            pools["code-write"].append(tpl.format(sig=s.signature, name=s.name, d3=d3, base=base))
        pools["code-explain"].append(rng.choice(EXPLAIN_TEMPLATES).format(src=s.source))
        if s.bug:
            bug, call, expected, got = s.bug
            got_text = f"it returns `{got[1]}`" if got[0] == "ok" else (
                "it never finishes" if got[1] == "timeout" else f"it raises {got[1]}")
            pools["code-fix"].append(rng.choice(FIX_TEMPLATES).format(
                bug=bug, call=call, expected=expected, got_text=got_text, name=s.name,
                base=base, base_np=base.rstrip(".")))
        pools["code-test"].append(rng.choice(TEST_TEMPLATES).format(src=s.source))
        pools["code-refactor"].append(rng.choice(REFACTOR_TEMPLATES).format(src=s.source))
        pools["code-translate"].append(rng.choice(TRANSLATE_TEMPLATES).format(src=s.source))
        if not re.search(r"\b(dicts?|None|ValueError|tuples?|Python)\b", s.doc):
            d3js = re.sub(r"\blist\b", "array", re.sub(r"\blists\b", "arrays", re.sub(r"\ba list\b", "an array", d3)))
            pools["javascript"].append(rng.choice(JS_WRITE_TEMPLATES).format(
                jsname=camel(s.name), jsparams=js_params(s), d3=d3js))
    pools["javascript"] += JS_PROMPTS  # hand-written ones are added in full below
    for name, desc in CLASSES:
        for tpl in rng.sample(CLASS_TEMPLATES, 2):
            pools["code-class"].append(tpl.format(name=name, desc=desc))
    for algo in ALGORITHMS:
        for tpl in rng.sample(ALGORITHM_TEMPLATES, 2):
            pools["code-algorithm"].append(tpl.format(algo=algo))
    for a, b in CONCEPT_PAIRS:
        pools["code-concept"].append(rng.choice(CONCEPT_PAIR_TEMPLATES).format(a=a, b=b))
    for c in CONCEPTS:
        pools["code-concept"].append(rng.choice(CONCEPT_TEMPLATES).format(c=c))
    for c in CS_CONCEPTS:
        pools["code-concept"].append(rng.choice(CS_TEMPLATES).format(c=c))
    pools["code-task"] += PYTHON_TASKS
    for e in ERRORS:
        pools["code-error"].append(rng.choice(ERROR_TEMPLATES).format(e=e))
    for schema, q in SQL_QUERIES:
        pools["sql"].append(rng.choice(SQL_TEMPLATES).format(schema=schema, q=q))
    pools["sql"] += SQL_PROMPTS
    pools["shell"] += SHELL_PROMPTS

    quotas = {
        "code-complete": 150, "code-write": 110, "code-explain": 40, "code-fix": 55, "code-test": 22,
        "code-refactor": 28, "code-translate": 15, "javascript": 42, "code-class": 45,
        "code-algorithm": 60, "code-concept": 50, "code-task": 40, "code-error": 14, "sql": 25, "shell": 24,
    }
    must_keep = {"javascript": JS_PROMPTS}
    return select(pools, quotas, rng, must_keep)


def build_chat(rng):
    pools = {k: [] for k in ["explain", "howto", "writing-email", "writing-story", "writing-poem", "writing",
                             "summarize", "rewrite", "advice", "compare", "roleplay", "brainstorm", "math",
                             "reasoning", "knowledge", "planning"]}
    for t in EXPLAIN_TOPICS:
        for tpl in rng.sample(EXPLAIN_TEMPLATES_CHAT, 2):
            pools["explain"].append(tpl.format(t=t))
    for t in HOWTO_TASKS:
        for tpl in rng.sample(HOWTO_TEMPLATES, 2):
            pools["howto"].append(tpl.format(t=t))
    for p in EMAIL_PURPOSES:
        for tpl in rng.sample(EMAIL_TEMPLATES, 2):
            pools["writing-email"].append(tpl.format(p=p))
    for _ in range(120):
        pools["writing-story"].append(rng.choice(STORY_TEMPLATES).format(
            genre=rng.choice(STORY_GENRES), char=rng.choice(STORY_CHARACTERS), sit=rng.choice(STORY_SITUATIONS)))
    for form in POEM_FORMS:
        for subject in rng.sample(POEM_SUBJECTS, 5):
            pools["writing-poem"].append(f"Write {form} about {subject}.")
    for word in ACROSTIC_WORDS:
        pools["writing-poem"].append(f"Write an acrostic poem using the word {word}.")
    pools["writing"] += WRITING_PROMPTS
    for p in PASSAGES:
        for tpl in rng.sample(SUMMARY_TEMPLATES, 3):
            pools["summarize"].append(tpl.format(p=p))
    for s in REWRITE_SENTENCES:
        for ins in rng.sample(REWRITE_INSTRUCTIONS, 3):
            pools["rewrite"].append(f"{ins}\n\n\"{s}\"")
    for s in ADVICE_SITUATIONS:
        for tpl in rng.sample(ADVICE_TEMPLATES, 2):
            pools["advice"].append(tpl.format(s=s))
    for a, b, ctx in COMPARISONS:
        for tpl in rng.sample(COMPARE_TEMPLATES, 2):
            pools["compare"].append(tpl.format(a=a, b=b, ctx=ctx))
    for role, reqs in ROLES:
        for req in reqs:
            pools["roleplay"].append(rng.choice(ROLE_TEMPLATES).format(role=role, req=req))
    for t in BRAINSTORM_TOPICS:
        for tpl in rng.sample(BRAINSTORM_TEMPLATES, 2):
            pools["brainstorm"].append(tpl.format(n=rng.choice([5, 7, 8, 10, 12]), t=t))
    for kind in range(N_MATH_KINDS):
        for _ in range(8):
            pools["math"].append(math_problem(kind, rng) + rng.choice(MATH_SUFFIXES))
    pools["reasoning"] += LOGIC_PUZZLES
    pools["knowledge"] += KNOWLEDGE
    for city in CITIES:
        for interest in rng.sample(INTERESTS, 2):
            days = rng.choice([2, 3, 4, 5])
            pools["planning"].append(f"Plan a {days}-day itinerary in {city} for someone interested in {interest}.")
    pools["planning"] += PLANNING_OTHER

    quotas = {
        "explain": 85, "howto": 60, "writing-email": 32, "writing-story": 38, "writing-poem": 34,
        "writing": 36, "summarize": 30, "rewrite": 28, "advice": 52, "compare": 46, "roleplay": 34,
        "brainstorm": 46, "math": 90, "reasoning": 18, "knowledge": 38, "planning": 34,
    }
    return select(pools, quotas, rng, {"planning": PLANNING_OTHER})


def select(pools, quotas, rng, must_keep):
    """Dedupe each pool, keep the must-keep prompts, fill up to the quota at random.

    -> (chosen, leftover): the leftover prompts feed the `--extra` files."""
    out, leftover = [], []
    seen = set()
    for cat, pool in pools.items():
        uniq = list(dict.fromkeys(pool))
        keep = [p for p in uniq if p in set(must_keep.get(cat, []))]
        rest = [p for p in uniq if p not in set(keep)]
        n = max(0, min(len(rest), quotas[cat] - len(keep)))
        chosen = keep + rng.sample(rest, n)
        leftover += [(cat, p) for p in rest if p not in set(chosen)]
        for p in chosen:
            key = " ".join(p.lower().split())
            if key not in seen:
                seen.add(key)
                out.append((cat, p))
    rng.shuffle(out)
    picked = {" ".join(p.lower().split()) for _, p in out}
    leftover = [(c, p) for c, p in dict.fromkeys(leftover) if " ".join(p.lower().split()) not in picked]
    random.Random(len(leftover)).shuffle(leftover)
    return out, leftover


# Instruction wrappers shared on purpose with the evaluation prompts (format, not content).
BOILERPLATE = ["Complete the code I provided."]


def shingles(text, n=8):
    for phrase in BOILERPLATE:
        text = text.replace(phrase, " ")
    words = re.findall(r"[a-z0-9]+", text.lower())
    grams = (words[i:i + n] for i in range(len(words) - n + 1))
    return {" ".join(g) for g in grams if not all(w.isdigit() for w in g)}  # skip pure number runs


def check_against_eval(rows):
    """Fail if any prompt shares an 8-word sequence with an evaluation prompt."""
    files = sorted(EVAL_DIR.glob("*.jsonl")) if EVAL_DIR.is_dir() else []
    if not files:
        print(f"note: {EVAL_DIR} not found; skipped the overlap check against the evaluation sets")
        return
    eval_shingles = {}
    for f in files:
        for line in f.read_text().splitlines():
            for turn in json.loads(line)["turns"]:
                for sh in shingles(turn):
                    eval_shingles.setdefault(sh, f.name)
    bad = []
    for cat, p in rows:
        hit = next((sh for sh in shingles(p) if sh in eval_shingles), None)
        if hit:
            bad.append((cat, hit, eval_shingles[hit], p[:120]))
    for cat, hit, fname, p in bad:
        print(f"OVERLAP [{cat}] '{hit}' ({fname}): {p!r}", file=sys.stderr)
    if bad:
        sys.exit(f"{len(bad)} prompts overlap the evaluation sets; edit the lists")
    print(f"overlap check against {', '.join(f.name for f in files)}: none")


def write(rows, prefix, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i, (cat, p) in enumerate(rows):
            fh.write(json.dumps({"question_id": f"{prefix}-{i}", "category": cat, "turns": [p]},
                                ensure_ascii=False) + "\n")
    counts = {}
    for cat, _ in rows:
        counts[cat] = counts.get(cat, 0) + 1
    print(f"{path.relative_to(ROOT)}: {len(rows)} prompts  " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))


def main():
    code, code_extra = build_code(random.Random(SEED))
    chat, chat_extra = build_chat(random.Random(SEED + 1))
    if "--extra" in sys.argv[1:]:  # the pools' prompts that the quotas left out: more training data
        check_against_eval(code_extra + chat_extra)
        write(code_extra, "code-extra", OUT_DIR / "code_prompts_extra.jsonl")
        write(chat_extra, "chat-extra", OUT_DIR / "chat_prompts_extra.jsonl")
        return
    check_against_eval(code + chat)
    write(code, "code", OUT_DIR / "code_prompts.jsonl")
    write(chat, "chat", OUT_DIR / "chat_prompts.jsonl")


if __name__ == "__main__":
    main()
