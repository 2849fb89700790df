"""Writes the real-mini data set (every problem, test and completion here was written for mopd; no third-party
text) in the hub schemas, and `golden.jsonl`: completions with the reward the real verifiers must give them.

    python data/real_mini/build.py      # rewrites math.jsonl, code_lcb.jsonl, code_leetcode.jsonl, ifeval.jsonl,
                                        # ifeval_no_punkt.jsonl (its rows that need no NLTK data), golden.jsonl
                                        # next to this file (deterministic: same bytes every time)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from mopd_core.domains.ifeval_verifier import NEEDS_PUNKT  # noqa: E402 - one list of the punkt instructions
ESCAPE_DIR = "/tmp"  # where the file-writing escapes try to write; tests check nothing appeared there


def boxed(x: str, lead: str = "Working it out step by step, the result is") -> str:
    return f"{lead} \\boxed{{{x}}}."


# ---- math: verl RL schema --------------------------------------------------------------------------------
# (question, ground truth, verifier_args, [(name, completion, reward)])
MATH = [
    ("What is 17 + 25?", "42", {}, [
        ("correct", boxed("42"), 1.0), ("wrong", boxed("24"), 0.0), ("no_box", "The answer is 42.", 0.0),
        ("last_box_counts", "First guess \\boxed{40}; checking again, 17 + 25 = \\boxed{42}.", 1.0),
        ("last_box_wrong", "17 + 25 = \\boxed{42}, or rather \\boxed{43}.", 0.0),
        ("think_then_answer", "<think>17 + 25: 7 + 5 = 12, carry 1, so \\boxed{41}? no, 42.</think>\\boxed{42}", 1.0),
        ("unclosed_think", "<think>17 + 25 is \\boxed{42} I think", 0.0),
    ]),
    ("Compute 3/4 + 1/4 - 1/2. Give the answer as a fraction in lowest terms.", "\\frac{1}{2}", {}, [
        ("latex_fraction", boxed("\\frac{1}{2}"), 1.0), ("decimal", boxed("0.5"), 1.0),
        ("slash_fraction", boxed("1/2"), 1.0), ("wrong", boxed("\\frac{2}{3}"), 0.0),
    ]),
    ("Simplify \\sqrt{50}.", "5\\sqrt{2}", {}, [
        ("correct", boxed("5\\sqrt{2}"), 1.0), ("unsimplified_equal", boxed("\\sqrt{50}"), 1.0),
        ("wrong", boxed("25\\sqrt{2}"), 0.0),
    ]),
    ("Solve 2x + 3 = 13 for x.", "5", {}, [
        ("bare", boxed("5"), 1.0), ("assignment", boxed("x = 5"), 1.0), ("wrong_assignment", boxed("x = 6"), 0.0),
    ]),
    ("What is -7 times 6?", "-42", {}, [
        ("negative", boxed("-42"), 1.0), ("sign_lost", boxed("42"), 0.0),
    ]),
    ("What is 0.3 + 0.45?", "0.75", {}, [
        ("decimal", boxed("0.75"), 1.0), ("fraction", boxed("\\frac{3}{4}"), 1.0), ("wrong", boxed("0.7"), 0.0),
    ]),
    ("Find the positive solution of x^2 = 2.", "\\sqrt{2}", {}, [
        ("root", boxed("\\sqrt{2}"), 1.0), ("power", boxed("2^{1/2}"), 1.0), ("negative_root", boxed("-\\sqrt{2}"), 0.0),
    ]),
    ("Find the remainder when 2^{10} is divided by 1000.", "24", {"mode": "aime"}, [
        ("integer", boxed("24"), 1.0), ("leading_zero", boxed("024"), 1.0), ("not_reduced", boxed("1024"), 0.0),
        ("not_integer", boxed("24.5"), 0.0), ("no_box", "The remainder is 24.", 0.0),
    ]),
    ("A baker bakes 7 trays of 12 muffins and sells 60 of them. How many muffins are left?", "24",
     {"mode": "gsm8k"}, [
        ("correct", "7 trays of 12 make 7 * 12 = 84 muffins; 84 - 60 = 24 are left.\n#### 24", 1.0),
        ("trailing_period", "84 - 60 = 24\n#### 24.", 1.0), ("wrong", "84 - 50 = 34\n#### 34", 0.0),
        ("no_marker", "There are 24 muffins left.", 0.0),
    ]),
    ("Evaluate 2^{-1} + 2^{-2}.", "\\frac{3}{4}", {}, [
        ("fraction", boxed("\\frac{3}{4}"), 1.0), ("decimal", boxed("0.75"), 1.0), ("wrong", boxed("\\frac{1}{4}"), 0.0),
    ]),
    ("What is 15% of 80?", "12", {}, [
        ("integer", boxed("12"), 1.0), ("float", boxed("12.0"), 1.0), ("wrong", boxed("1200"), 0.0),
    ]),
    ("Write 0.125 as a fraction in lowest terms.", "\\frac{1}{8}", {}, [
        ("slash", boxed("1/8"), 1.0), ("latex", boxed("\\frac{1}{8}"), 1.0), ("wrong", boxed("\\frac{1}{4}"), 0.0),
    ]),
    ("What is the area of a circle of radius 3?", "9\\pi", {}, [
        ("correct", boxed("9\\pi"), 1.0), ("reordered", boxed("\\pi \\cdot 9"), 1.0), ("wrong", boxed("6\\pi"), 0.0),
    ]),
    ("How many positive divisors does 360 have?", "24", {"mode": "aime"}, [
        ("integer", boxed("24"), 1.0), ("text_wrapped", boxed("\\text{24}"), 1.0), ("wrong", boxed("12"), 0.0),
    ]),
    ("Compute (-3)^3.", "-27", {}, [
        ("correct", boxed("-27"), 1.0), ("sign_lost", boxed("27"), 0.0),
    ]),
    ("What is \\frac{2}{3} \\div \\frac{4}{9}?", "\\frac{3}{2}", {}, [
        ("decimal", boxed("1.5"), 1.0), ("slash", boxed("3/2"), 1.0), ("inverted", boxed("\\frac{2}{3}"), 0.0),
    ]),
    ("Simplify \\sqrt{12} + \\sqrt{27}.", "5\\sqrt{3}", {}, [
        ("correct", boxed("5\\sqrt{3}"), 1.0), ("single_root", boxed("\\sqrt{75}"), 1.0),
        ("added_radicands", boxed("\\sqrt{39}"), 0.0),
    ]),
    ("Find y if 3y - 4 = -19.", "-5", {}, [
        ("assignment", boxed("y = -5"), 1.0), ("bare", boxed("-5"), 1.0), ("sign_lost", boxed("5"), 0.0),
    ]),
    ("What is 7!/5!?", "42", {}, [
        ("integer", boxed("42"), 1.0), ("product", boxed("7 \\cdot 6"), 1.0), ("wrong", boxed("2"), 0.0),
    ]),
    ("Write 3/8 as a decimal.", "0.375", {}, [
        ("decimal", boxed("0.375"), 1.0), ("fraction", boxed("\\frac{3}{8}"), 1.0), ("rounded", boxed("0.38"), 0.0),
    ]),
    ("What is the cube root of 64?", "4", {}, [
        ("integer", boxed("4"), 1.0), ("radical", boxed("\\sqrt[3]{64}"), 1.0), ("square_root", boxed("8"), 0.0),
    ]),
    ("What is the sum of the interior angles of a hexagon, in degrees?", "720", {}, [
        ("integer", boxed("720"), 1.0), ("degrees", boxed("720^\\circ"), 1.0), ("wrong", boxed("360"), 0.0),
    ]),
    ("What is the slope of the line through (1, 2) and (3, 8)?", "3", {}, [
        ("integer", boxed("3"), 1.0), ("unreduced", boxed("\\frac{6}{2}"), 1.0), ("inverted", boxed("\\frac{1}{3}"), 0.0),
    ]),
    ("Evaluate \\log_2 32.", "5", {}, [
        ("correct", boxed("5"), 1.0), ("wrong", boxed("6"), 0.0),
    ]),
    ("Compute 1/3 + 1/6.", "\\frac{1}{2}", {}, [
        ("dfrac", boxed("\\dfrac{1}{2}"), 1.0), ("decimal", boxed("0.5"), 1.0), ("added_naively", boxed("\\frac{2}{9}"), 0.0),
    ]),
    ("Rationalize the denominator of \\frac{1}{\\sqrt{2}}.", "\\frac{\\sqrt{2}}{2}", {}, [
        ("rationalized", boxed("\\frac{\\sqrt{2}}{2}"), 1.0), ("equal_unrationalized", boxed("\\frac{1}{\\sqrt{2}}"), 1.0),
        ("wrong", boxed("\\sqrt{2}"), 0.0),
    ]),
    ("Solve x/4 = -3.", "-12", {}, [
        ("bare", boxed("-12"), 1.0), ("assignment", boxed("x = -12"), 1.0), ("sign_lost", boxed("12"), 0.0),
    ]),
    ("For which real x is x^2 < 4? Answer in interval notation.", "(-2, 2)", {}, [
        ("open_interval", boxed("(-2, 2)"), 1.0), ("closed_interval", boxed("[-2, 2]"), 0.0),
    ]),
    ("How many ordered pairs (a, b) of positive integers satisfy a + b = 20?", "19", {"mode": "aime"}, [
        ("correct", boxed("19"), 1.0), ("off_by_one", boxed("20"), 0.0),
    ]),
    ("Tom has 3 boxes of 14 pencils and gives away 9 pencils. How many pencils does he have left?", "33",
     {"mode": "gsm8k"}, [
        ("correct", "3 * 14 = 42 pencils; 42 - 9 = 33.\n#### 33", 1.0), ("wrong", "3 * 14 = 42; 42 - 10 = 32\n#### 32", 0.0),
    ]),
    ("Write 2.5 as an improper fraction.", "\\frac{5}{2}", {"mode": "any"}, [
        ("inline_latex", "It equals $\\frac{5}{2}$.", 1.0), ("decimal_text", "The value is $2.5$.", 1.0),
        ("wrong", "It equals $\\frac{2}{5}$.", 0.0),
    ]),
    ("What is 100 - 58?", "42", {"think_format_weight": 0.5}, [
        ("think_and_correct", "<think>100 - 58 = 42</think>\nSo the result is \\boxed{42}.", 1.0),
        ("correct_without_think", boxed("42"), 0.5),
        ("two_think_blocks", "<think>a</think><think>b</think> \\boxed{42}", 0.5),
        ("think_but_wrong", "<think>100 - 58 = 52</think> \\boxed{52}", 0.5),
    ]),
]
# zero_if_truncated: the same correct completion scores 0 when the caller says it hit the token budget
MATH_TRUNCATED = (0, {"zero_if_truncated": True}, [
    ("finished", boxed("42"), 1.0, False), ("truncated", boxed("42"), 0.0, True),
])

# ---- code: LiveCodeBench rows (stdin and functional) and LeetCodeDataset rows --------------------------------


def fence(code: str, lead: str = "Here is my solution.") -> str:
    return f"{lead}\n```python\n{code.strip()}\n```\n"


def escapes(qid: str, body: str) -> list[tuple[str, str]]:
    """Three sandbox-escape attempts that would still answer correctly if the attempt were allowed through."""
    path = f"{ESCAPE_DIR}/mopd-real-mini-escape-{qid}"
    return [
        ("escape_network", f"import socket\nsocket.create_connection(('10.255.255.1', 80), timeout=1).sendall(b'x')\n"
                           f"{body}"),
        ("escape_file_write", f"open({path!r}, 'w').write('escaped')\n{body}"),
        ("escape_subprocess", f"import subprocess\nsubprocess.run(['sh', '-c', 'echo escaped > {path}'])\n{body}"),
    ]


def stdin_cases(*pairs: tuple[str, str]) -> list[dict]:
    return [{"input": i, "output": o, "testtype": "stdin"} for i, o in pairs]


def call_cases(*pairs: tuple[str, str]) -> list[dict]:
    return [{"input": i, "output": o, "testtype": "functional"} for i, o in pairs]


LOOP_STDIN = "import sys\nn = 0\nwhile True:\n    n += 1\n"

# (question_id, title, content, starter_code, func_name or None, tests, correct, wrong, crash, extra completions)
CODE = [
    ("rm-c01", "Sum of two", "Read two integers a and b on one line and print a + b.", "", None,
     stdin_cases(("3 4\n", "7\n"), ("-5 12\n", "7\n"), ("1000000000 1000000000\n", "2000000000\n")),
     "a, b = map(int, input().split())\nprint(a + b)",
     "a, b = map(int, input().split())\nprint(a - b)",
     "a, b = map(int, input().split())\nprint(a + b // 0)",
     [("main_guard", "def main():\n    a, b = map(int, input().split())\n    print(a + b)\n\n"
                     "if __name__ == '__main__':\n    main()", 1.0)]),
    ("rm-c02", "Reverse a line", "Read one line of text and print it reversed.", "", None,
     stdin_cases(("hello\n", "olleh\n"), ("ab cd\n", "dc ba\n")),
     "print(input()[::-1])", "print(input())", "print(input()[::-1].decode())", []),
    ("rm-c03", "Count vowels", "Read a word and print how many of its letters are vowels (a, e, i, o, u; any case).",
     "", None, stdin_cases(("banana\n", "3\n"), ("sky\n", "0\n"), ("AEIOU\n", "5\n")),
     "s = input().lower()\nprint(sum(c in 'aeiou' for c in s))",
     "s = input()\nprint(sum(c in 'aeiou' for c in s))",
     "s = input()\nprint(len(s) / (len(s) - len(s)))", []),
    ("rm-c04", "Count up", "Read n and print the numbers 1 to n, one per line.", "", None,
     stdin_cases(("3\n", "1\n2\n3\n"), ("1\n", "1\n")),
     "n = int(input())\nfor i in range(1, n + 1):\n    print(i)",
     "n = int(input())\nprint(' '.join(str(i) for i in range(1, n + 1)))",
     "n = int(input())\nprint(undefined_name)", []),
    ("rm-c05", "Largest number", "The first line holds n, the second n integers. Print the largest.", "", None,
     stdin_cases(("5\n3 9 -2 7 9\n", "9\n"), ("1\n-4\n", "-4\n")),
     "input()\nprint(max(map(int, input().split())))",
     "input()\nprint(min(map(int, input().split())))",
     "input()\nprint(max(input().split(), key=int) + 1)", []),
    ("rm-c06", "Average", "The first line holds n, the second n integers. Print their average with two decimals.",
     "", None, stdin_cases(("4\n1 2 3 4\n", "2.50\n"), ("2\n1 2\n", "1.50\n")),
     "n = int(input())\nxs = list(map(int, input().split()))\nprint(f'{sum(xs) / n:.2f}')",
     "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs) // n)",
     "n = int(input())\nxs = list(map(int, input().split()))\nprint(xs[n])",
     [("same_value_other_digits", "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs) / n)", 1.0)]),
    ("rm-c07", "Fizz and Buzz",
     "Read n. For i from 1 to n print Fizz if 3 divides i, Buzz if 5 divides i, FizzBuzz if both, else i.", "", None,
     stdin_cases(("5\n", "1\n2\nFizz\n4\nBuzz\n"),
                 ("15\n", "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz\n")),
     "n = int(input())\nfor i in range(1, n + 1):\n    s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 "
     "else '')\n    print(s or i)",
     "n = int(input())\nfor i in range(1, n + 1):\n    print('Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)",
     "n = int(input())\nfor i in range(1, n + 1):\n    print(['Fizz', 'Buzz'][i])", []),
    ("rm-c08", "Word count", "Read one line and print the number of words in it (words are separated by spaces).",
     "", None, stdin_cases(("the quick brown fox\n", "4\n"), ("  spaced   out  \n", "2\n")),
     "print(len(input().split()))", "print(input().count(' ') + 1)", "print(len(input().split(maxsplit=-2)) / 0)",
     []),
    ("rm-c09", "Factorial", "Read n (0 <= n <= 20) and print n!.", "", None,
     stdin_cases(("5\n", "120\n"), ("20\n", "2432902008176640000\n"), ("0\n", "1\n")),
     "import math\nprint(math.factorial(int(input())))",
     "import math\nn = int(input())\nprint(math.prod(range(1, n)))",
     "import math\nprint(math.factorial(-int(input()) - 1))", []),
    ("rm-c10", "Prime test", "Read n (1 <= n <= 10^6) and print YES if n is prime, else NO.", "", None,
     stdin_cases(("7\n", "YES\n"), ("1\n", "NO\n"), ("91\n", "NO\n")),
     "n = int(input())\nok = n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\nprint('YES' if ok else 'NO')",
     "n = int(input())\nprint('YES' if n % 2 else 'NO')",
     "n = int(input())\nprint('YES' if all(n % d for d in range(0, n)) else 'NO')", []),
    ("rm-c11", "Count walls",
     "The first line holds r and c; then r lines of c characters follow. Print how many characters are '#'.", "",
     None, stdin_cases(("2 3\n#.#\n..#\n", "3\n"), ("1 1\n.\n", "0\n")),
     "r, c = map(int, input().split())\nprint(sum(input().count('#') for _ in range(r)))",
     "r, c = map(int, input().split())\nprint(input().count('#'))",
     "r, c = map(int, input().split())\nprint(sum(input().count('#') for _ in range(r + 1)))", []),
    ("rm-f01", "Add two numbers", "Return a + b.",
     "class Solution:\n    def addTwo(self, a: int, b: int) -> int:\n        ", "addTwo",
     call_cases(("3\n4", "7"), ("-1\n1", "0")),
     "class Solution:\n    def addTwo(self, a: int, b: int) -> int:\n        return a + b",
     "class Solution:\n    def addTwo(self, a: int, b: int) -> int:\n        return a * b",
     "class Solution:\n    def addTwo(self, a: int, b: int) -> int:\n        return a + b + None",
     [("main_guard_quiet", "class Solution:\n    def addTwo(self, a: int, b: int) -> int:\n        return a + b\n\n"
                           "if __name__ == '__main__':\n    print(Solution().addTwo(int(input()), int(input())))", 1.0)]),
    ("rm-f02", "Reverse words", "Return the words of s in reverse order, joined by single spaces.",
     "class Solution:\n    def reverseWords(self, s: str) -> str:\n        ", "reverseWords",
     call_cases(('"hello world"', '"world hello"'), ('"a"', '"a"')),
     "class Solution:\n    def reverseWords(self, s: str) -> str:\n        return ' '.join(reversed(s.split()))",
     "class Solution:\n    def reverseWords(self, s: str) -> str:\n        return s[::-1]",
     "class Solution:\n    def reverseWords(self, s: str) -> str:\n        return ' '.join(s.split()[::-1][5])", []),
    ("rm-f03", "Best single trade",
     "prices[i] is a price on day i. Return the largest profit of one buy followed by one later sell (0 if none).",
     "class Solution:\n    def maxProfit(self, prices: List[int]) -> int:\n        ", "maxProfit",
     call_cases(("[7,1,5,3,6,4]", "5"), ("[7,6,4,3,1]", "0")),
     "class Solution:\n    def maxProfit(self, prices: List[int]) -> int:\n        best, low = 0, float('inf')\n"
     "        for p in prices:\n            low = min(low, p)\n            best = max(best, p - low)\n        return best",
     "class Solution:\n    def maxProfit(self, prices: List[int]) -> int:\n        return max(prices) - min(prices)",
     "class Solution:\n    def maxProfit(self, prices: List[int]) -> int:\n        return prices[len(prices)]", []),
    ("rm-f04", "Palindrome", "Return whether s reads the same backwards.",
     "class Solution:\n    def isPalindrome(self, s: str) -> bool:\n        ", "isPalindrome",
     call_cases(('"racecar"', "true"), ('"ab"', "false")),
     "class Solution:\n    def isPalindrome(self, s: str) -> bool:\n        return s == s[::-1]",
     "class Solution:\n    def isPalindrome(self, s: str) -> bool:\n        return len(s) % 2 == 0",
     "class Solution:\n    def isPalindrome(self, s: str) -> bool:\n        return s == s.reverse()", []),
    ("rm-f05", "Count evens", "Return how many numbers in nums are even.",
     "class Solution:\n    def countEvens(self, nums: List[int]) -> int:\n        ", "countEvens",
     call_cases(("[1,2,3,4]", "2"), ("[]", "0")),
     "class Solution:\n    def countEvens(self, nums: List[int]) -> int:\n        return sum(x % 2 == 0 for x in nums)",
     "class Solution:\n    def countEvens(self, nums: List[int]) -> int:\n        return len(nums) // 2 + 1",
     "class Solution:\n    def countEvens(self, nums: List[int]) -> int:\n        return nums.count_even()", []),
    ("rm-f06", "Running sum", "Return the list of prefix sums of nums.",
     "class Solution:\n    def runningSum(self, nums: List[int]) -> List[int]:\n        ", "runningSum",
     call_cases(("[1,2,3]", "[1,3,6]"), ("[5]", "[5]")),
     "class Solution:\n    def runningSum(self, nums: List[int]) -> List[int]:\n        return list(accumulate(nums))",
     "class Solution:\n    def runningSum(self, nums: List[int]) -> List[int]:\n        return [sum(nums)]",
     "class Solution:\n    def runningSum(self, nums: List[int]) -> List[int]:\n        return nums + 1", []),
    ("rm-f07", "Smallest and largest", "Return [smallest, largest] of nums.",
     "class Solution:\n    def minMax(self, nums: List[int]) -> List[int]:\n        ", "minMax",
     call_cases(("[3,1,2]", "[1,3]"), ("[4]", "[4,4]")),
     "class Solution:\n    def minMax(self, nums: List[int]) -> List[int]:\n        return [min(nums), max(nums)]",
     "class Solution:\n    def minMax(self, nums: List[int]) -> List[int]:\n        return [max(nums), min(nums)]",
     "class Solution:\n    def minMax(self, nums: List[int]) -> List[int]:\n        return [min(nums), max(nums), nums[9]]",
     [("tuple_counts_as_list",
       "class Solution:\n    def minMax(self, nums: List[int]) -> List[int]:\n        return min(nums), max(nums)", 1.0)]),
    ("rm-f08", "Most frequent", "Return the value that occurs most often in nums (the smallest one on a tie).",
     "class Solution:\n    def mostFrequent(self, nums: List[int]) -> int:\n        ", "mostFrequent",
     call_cases(("[1,2,2,3,3]", "2"), ("[5]", "5")),
     "class Solution:\n    def mostFrequent(self, nums: List[int]) -> int:\n        c = Counter(nums)\n"
     "        return min(c, key=lambda x: (-c[x], x))",
     "class Solution:\n    def mostFrequent(self, nums: List[int]) -> int:\n        c = Counter(nums)\n"
     "        return max(c, key=lambda x: (c[x], x))",
     "class Solution:\n    def mostFrequent(self, nums: List[int]) -> int:\n        return Counter(nums).most_common()[len(nums)][0]",
     []),
    ("rm-f09", "Merge sorted lists", "a and b are sorted; return one sorted list with all their elements.",
     "class Solution:\n    def mergeSorted(self, a: List[int], b: List[int]) -> List[int]:\n        ", "mergeSorted",
     call_cases(("[1,3]\n[2,4]", "[1,2,3,4]"), ("[]\n[1]", "[1]")),
     "class Solution:\n    def mergeSorted(self, a: List[int], b: List[int]) -> List[int]:\n        return list(merge(a, b))",
     "class Solution:\n    def mergeSorted(self, a: List[int], b: List[int]) -> List[int]:\n        return a + b",
     "class Solution:\n    def mergeSorted(self, a: List[int], b: List[int]) -> List[int]:\n        return a.merge(b)", []),
    ("rm-f10", "Square", "Write a function square(x) that returns x * x.", "def square(x: int) -> int:\n    ",
     "square", call_cases(("3", "9"), ("-2", "4")),
     "def square(x: int) -> int:\n    return x * x",
     "def square(x: int) -> int:\n    return 2 * x",
     "def square(x: int) -> int:\n    return x * y", []),
]

LEETCODE_PRELUDE = ("from typing import *\nfrom collections import *\nfrom functools import *\nfrom itertools import *\n"
                    "from heapq import *\nfrom bisect import *\nfrom math import *\n")

# (task_id, query, entry_point, check source, reference completion, wrong, crash)
LEETCODE = [
    ("rm-pair-sum", "Given nums and target, return the indices [i, j] (i < j) of the two numbers that add up to "
     "target. Exactly one answer exists.", "Solution().pairSum",
     "def check(candidate):\n    assert candidate(nums=[2, 7, 11, 15], target=9) == [0, 1]\n"
     "    assert candidate(nums=[3, 3], target=6) == [0, 1]\n    assert candidate(nums=[1, 5, 4], target=9) == [1, 2]\n",
     "class Solution:\n    def pairSum(self, nums: List[int], target: int) -> List[int]:\n        seen = {}\n"
     "        for i, x in enumerate(nums):\n            if target - x in seen:\n                return [seen[target - x], i]\n"
     "            seen[x] = i\n        return []",
     "class Solution:\n    def pairSum(self, nums: List[int], target: int) -> List[int]:\n        return [0, 1]",
     "class Solution:\n    def pairSum(self, nums: List[int], target: int) -> List[int]:\n        return nums.index(target)"),
    ("rm-climb", "You climb a staircase of n steps taking 1 or 2 steps at a time. Return the number of distinct ways "
     "to reach the top.", "Solution().climb",
     "def check(candidate):\n    assert candidate(n=1) == 1\n    assert candidate(n=2) == 2\n"
     "    assert candidate(n=5) == 8\n",
     "class Solution:\n    def climb(self, n: int) -> int:\n        a, b = 1, 1\n        for _ in range(n):\n"
     "            a, b = b, a + b\n        return a",
     "class Solution:\n    def climb(self, n: int) -> int:\n        return n",
     "class Solution:\n    def climb(self, n: int) -> int:\n        return self.climb(n - 1) + self.climb(n - 2)"),
    ("rm-anagram", "Return true if t is an anagram of s.", "Solution().isAnagram",
     "def check(candidate):\n    assert candidate(s='anagram', t='nagaram') == True\n"
     "    assert candidate(s='rat', t='car') == False\n    assert candidate(s='aab', t='abb') == False\n",
     "class Solution:\n    def isAnagram(self, s: str, t: str) -> bool:\n        return Counter(s) == Counter(t)",
     "class Solution:\n    def isAnagram(self, s: str, t: str) -> bool:\n        return set(s) == set(t)",
     "class Solution:\n    def isAnagram(self, s: str, t: str) -> bool:\n        return sorted(s) == sorted(t) + None"),
]

LOOP_CALL = "class Solution:\n    def {name}(self, *args, **kwargs):\n        while True:\n            pass"

# ---- IFEval-format rows -----------------------------------------------------------------------------------
END = "Is there anything else I can help with?"
LONG_LOWER = ("the garden is full of roses and tall green trees that sway in the warm summer wind while bees move "
              "from flower to flower")
# (key, prompt, instruction ids, kwargs, [(name, completion, {verifier_args as json: reward})])
S, L, F = "strict", "loose", "fraction"
IFEVAL = [
    (1001, "Describe a sunrise without using any commas.", ["punctuation:no_comma"], [{}], [
        ("follows", "The sun rises slowly over the hills. Light spreads across the quiet valley.", {S: 1.0}),
        ("comma", "The sun rises, and the sky glows.", {S: 0.0}), ("empty", "   ", {S: 0.0, L: 0.0})]),
    (1002, "Write a short note about tea in fewer than 20 words.", ["length_constraints:number_words"],
     [{"relation": "less than", "num_words": 20}], [
        ("follows", "Tea is a warm drink made from the leaves of a small shrub.", {S: 1.0}),
        ("too_long", "Tea is a warm drink made from leaves, and people around the world enjoy it in the morning, at "
                     "noon and late in the evening with friends.", {S: 0.0})]),
    (1003, "Write about rivers in at least 3 sentences.", ["length_constraints:number_sentences"],
     [{"relation": "at least", "num_sentences": 3}], [
        ("follows", "Rivers carry water to the sea. They shape valleys over time. Many towns grow along their banks.",
         {S: 1.0}),
        ("one_sentence", "Rivers are long.", {S: 0.0})]),
    (1004, "List three fruits as markdown bullet points.", ["detectable_format:number_bullet_lists"],
     [{"num_bullets": 3}], [
        ("follows", "* Apple\n* Pear\n* Plum", {S: 1.0}), ("two", "* Apple\n* Pear", {S: 0.0})]),
    (1005, "Write a two-line poem with a title wrapped in double angular brackets, like <<title>>.",
     ["detectable_format:title"], [{}], [
        ("follows", "<<Morning Light>>\nThe dawn is quiet.\nThe birds wake up.", {S: 1.0}),
        ("no_title", "Morning Light\nThe dawn is quiet.\nThe birds wake up.", {S: 0.0})]),
    (1006, "Answer in JSON format: what is your favourite colour?", ["detectable_format:json_format"], [{}], [
        ("follows", '{"colour": "green"}', {S: 1.0}), ("fenced", '```json\n{"colour": "green"}\n```', {S: 1.0}),
        ("prose", "My favourite colour is green.", {S: 0.0})]),
    (1007, "Plan a day and highlight at least 2 sections with markdown, i.e. *highlighted section*.",
     ["detectable_format:number_highlighted_sections"], [{"num_highlights": 2}], [
        ("follows", "Plan: *buy bread* in the morning and then *bake a cake* after lunch.", {S: 1.0}),
        ("one", "Plan: *buy bread* in the morning and bake after lunch.", {S: 0.0})]),
    (1008, "Write two sections about cats. Mark the beginning of each section with SECTION X.",
     ["detectable_format:multiple_sections"], [{"section_spliter": "SECTION", "num_sections": 2}], [
        ("follows", "SECTION 1\nCats sleep for most of the day.\nSECTION 2\nCats like to play with string.", {S: 1.0}),
        ("unmarked", "Cats sleep for most of the day. Cats like to play with string.", {S: 0.0})]),
    (1009, "Explain how clouds form. Your entire response must be in English and in lowercase letters.",
     ["change_case:english_lowercase"], [{}], [
        ("follows", "clouds form when warm air rises and cools down so that the water vapour in it condenses into "
                    "tiny droplets that float high in the sky", {S: 1.0}),
        ("capitals", "Clouds form when warm air rises and cools down so that the water vapour in it condenses into "
                     "tiny droplets that float high in the sky", {S: 0.0})]),
    (1010, "Explain what wind is. Your entire response must be in English and in capital letters.",
     ["change_case:english_capital"], [{}], [
        ("follows", "WIND IS AIR THAT MOVES FROM PLACES WITH HIGH PRESSURE TO PLACES WITH LOW PRESSURE ACROSS THE "
                    "SURFACE OF THE EARTH", {S: 1.0}),
        ("mixed_case", "Wind is air that moves from places with high pressure to places with low pressure across "
                       "the surface of the earth", {S: 0.0})]),
    (1011, "Describe a storm, using at least 2 words written in all capital letters.",
     ["change_case:capital_word_frequency"], [{"capital_relation": "at least", "capital_frequency": 2}], [
        ("follows", "The storm was VERY loud and the rain was HEAVY all night.", {S: 1.0}),
        ("one_capital_word", "The storm was VERY loud all night.", {S: 0.0})]),
    (1012, "Describe a market. Include the keywords apple and river.", ["keywords:existence"],
     [{"keywords": ["apple", "river"]}], [
        ("follows", "The market by the river sells apple pies and fresh bread.", {S: 1.0}),
        ("missing_one", "The market sells apple pies and fresh bread.", {S: 0.0})]),
    (1013, "Describe a pet. Do not use the word cat.", ["keywords:forbidden_words"], [{"forbidden_words": ["cat"]}], [
        ("follows", "My dog is a loyal friend, not just a category of animal.", {S: 1.0}),
        ("forbidden", "My cat sleeps all day.", {S: 0.0})]),
    (1014, "Write about the sky. The word blue should appear at least 3 times.", ["keywords:frequency"],
     [{"keyword": "blue", "frequency": 3, "relation": "at least"}], [
        ("follows", "The blue sky meets the blue sea behind a small blue boat.", {S: 1.0}),
        ("once", "The blue sky is wide.", {S: 0.0})]),
    (1015, "Write one sentence in which the letter z appears at least 2 times.", ["keywords:letter_frequency"],
     [{"letter": "z", "let_frequency": 2, "let_relation": "at least"}], [
        ("follows", "The lazy zebra dozed in the sun.", {S: 1.0}), ("once", "The lazy dog slept in the sun.", {S: 0.0})]),
    (1016, f"Say goodbye politely. Finish your response with this exact phrase: {END}", ["startend:end_checker"],
     [{"end_phrase": END}], [
        ("follows", f"Goodbye for now, it was a pleasure. {END}", {S: 1.0}),
        ("other_ending", "Goodbye for now, it was a pleasure.", {S: 0.0})]),
    (1017, "Wrap your entire response with double quotation marks. What is rain?", ["startend:quotation"], [{}], [
        ("follows", '"Rain is water that falls from clouds."', {S: 1.0}),
        ("unquoted", "Rain is water that falls from clouds.", {S: 0.0}),
        ("preamble", 'Sure, here it is:\n"Rain is water that falls from clouds."', {S: 0.0, L: 1.0})]),
    (1018, "Write a short letter to a friend. At the end, add a postscript starting with P.S.",
     ["detectable_content:postscript"], [{"postscript_marker": "P.S."}], [
        ("follows", "Dear Sam,\nI hope you are well.\nP.S. Say hi to Max.", {S: 1.0}),
        ("no_postscript", "Dear Sam,\nI hope you are well.", {S: 0.0})]),
    (1019, "Write an invitation with at least 2 placeholders in square brackets, such as [address].",
     ["detectable_content:number_placeholders"], [{"num_placeholders": 2}], [
        ("follows", "Join us at [address] on [date] for cake.", {S: 1.0}),
        ("one", "Join us at the park on [date] for cake.", {S: 0.0})]),
    (1020, "Write a riddle about time. First repeat the request word for word without change, then give your "
           "answer (do not say anything before repeating the request; the request you need to repeat does not "
           "include this sentence)", ["combination:repeat_prompt"],
     [{"prompt_to_repeat": "Write a riddle about time."}], [
        ("follows", "Write a riddle about time. What runs all day but never walks? A clock.", {S: 1.0}),
        ("no_repeat", "Here is one: what runs all day but never walks? A clock.", {S: 0.0})]),
    (1021, "Give two different names for a boat. Separate the two responses with six asterisks: ******.",
     ["combination:two_responses"], [{}], [
        ("follows", "Sea Breeze\n******\nWave Runner", {S: 1.0}), ("single", "Sea Breeze", {S: 0.0})]),
    (1022, "Write 3 paragraphs about bread. Separate paragraphs with the markdown divider: ***",
     ["length_constraints:number_paragraphs"], [{"num_paragraphs": 3}], [
        ("follows", "Bread is very old.\n***\nBread is made from flour and water.\n***\nBread tastes good warm.",
         {S: 1.0}),
        ("two", "Bread is very old.\n***\nBread is made from flour and water.", {S: 0.0})]),
    (1023, "Write 2 paragraphs about winter separated by two new lines. The second paragraph must start with the "
           "word however.", ["length_constraints:nth_paragraph_first_word"],
     [{"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"}], [
        ("follows", "Winter is cold and dark.\n\nHowever, it can also be beautiful.", {S: 1.0}),
        ("other_word", "Winter is cold and dark.\n\nBut it can also be beautiful.", {S: 0.0})]),
    (1024, "Is the sky blue? Answer with one of the following options: My answer is yes., My answer is no., My "
           "answer is maybe.", ["detectable_format:constrained_response"], [{}], [
        ("follows", "My answer is yes.", {S: 1.0}), ("free_text", "Yes, it is.", {S: 0.0})]),
    (1025, "Describe a garden in English lowercase letters only and do not use any commas.",
     ["change_case:english_lowercase", "punctuation:no_comma"], [{}, {}], [
        ("follows", LONG_LOWER, {S: 1.0, F: 1.0}),
        ("comma_only", "the garden has roses, tulips and tall green trees that sway in the warm summer wind while "
                       "bees move from flower to flower", {S: 0.0, F: 0.5}),
        ("think_is_not_scored", "<think>I Will Write In Lowercase, Without Commas.</think>" + LONG_LOWER, {S: 1.0})]),
    (1026, "Write a short text with a title in double angular brackets, include the keyword moon, and end with the "
           "phrase Good night.", ["detectable_format:title", "keywords:existence", "startend:end_checker"],
     [{}, {"keywords": ["moon"]}, {"end_phrase": "Good night."}], [
        ("follows", "<<Night Sky>>\nThe moon is bright tonight. Good night.", {S: 1.0, F: 1.0}),
        ("two_of_three", "<<Night Sky>>\nThe moon is bright tonight.", {S: 0.0, F: 2 / 3})]),
    (1027, "Wrap your entire response with double quotation marks. Describe snow.", ["startend:quotation"], [{}], [
        ("preamble", 'Sure, here it is:\n"Snow is frozen water falling from the sky."', {S: 0.0, L: 1.0}),
        ("unquoted", "Snow is frozen water falling from the sky.", {S: 0.0, L: 0.0})]),
    (1028, "Answer in JSON format: name two colours.", ["detectable_format:json_format"], [{}], [
        ("preamble", 'Here you go:\n{"colours": ["red", "blue"]}', {S: 0.0, L: 1.0}),
        ("follows", '{"colours": ["red", "blue"]}', {S: 1.0, L: 1.0})]),
    (1029, "Describe rain in one line. End your response with the exact phrase That is all.",
     ["startend:end_checker"], [{"end_phrase": "That is all."}], [
        ("bold_ending", "Rain falls softly on the roof. **That is all.**", {S: 0.0, L: 1.0}),
        ("follows", "Rain falls softly on the roof. That is all.", {S: 1.0, L: 1.0})]),
    # kwargs as the hub's IFEval parquet stores them: every key of every instruction, None where unused
    (1030, "Write about mountains in fewer than 12 words.", ["length_constraints:number_words"],
     [{"relation": "less than", "num_words": 12, "num_sentences": None, "keywords": None, "language": None,
       "end_phrase": None}], [
        ("follows", "Mountains are tall, cold and quiet.", {S: 1.0}),
        ("too_long", "Mountains are tall and cold places where snow stays on the peaks for most of the long year.",
         {S: 0.0})]),
]
ARGS = {S: {}, L: {"mode": "loose"}, F: {"score": "fraction"}}


def build() -> dict[str, list[dict]]:
    files: dict[str, list[dict]] = {"math.jsonl": [], "code_lcb.jsonl": [], "code_leetcode.jsonl": [],
                                    "ifeval.jsonl": [], "ifeval_no_punkt.jsonl": [], "golden.jsonl": []}
    golden = files["golden.jsonl"]
    for i, (q, gt, args, comps) in enumerate(MATH):
        files["math.jsonl"].append({"data_source": "real-mini/math", "prompt": [{"role": "user", "content": q}],
                                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": gt},
                                    "extra_info": {"index": i}})
        golden.append({"set": "math", "row": i, "verifier": "math_verify", "verifier_args": args,
                       "completions": [{"name": n, "text": t, "reward": r} for n, t, r in comps]})
    i, args, comps = MATH_TRUNCATED
    golden.append({"set": "math", "row": i, "verifier": "math_verify", "verifier_args": args,
                   "completions": [{"name": n, "text": t, "reward": r, "truncated": tr} for n, t, r, tr in comps]})

    for qid, title, content, starter, func, tests, correct, wrong, crash, extra in CODE:
        files["code_lcb.jsonl"].append({
            "question_id": qid, "question_title": title, "question_content": content, "platform": "real-mini",
            "difficulty": "easy", "starter_code": starter, "public_test_cases": json.dumps(tests),
            "metadata": json.dumps({"func_name": func} if func else {})})
        loop = LOOP_CALL.format(name=func) if func and starter.startswith("class") else (
            f"def {func}(*args):\n    while True:\n        pass" if func else LOOP_STDIN)
        comps = [("correct", fence(correct), 1.0), ("wrong", fence(wrong), 0.0), ("looping", fence(loop), 0.0),
                 ("crashing", fence(crash), 0.0)]
        comps += [(n, fence(t), 0.0) for n, t in escapes(qid, correct)]
        comps += [(n, fence(t), r) for n, t, r in extra]
        golden.append({"set": "code_lcb", "row": qid, "verifier": "code_tests", "verifier_args": {},
                       "completions": [{"name": n, "text": t, "reward": r} for n, t, r in comps]})
    # scoring and test caps on one row: the case-sensitive program fails only the third test
    golden.append({"set": "code_lcb", "row": "rm-c03", "verifier": "code_tests",
                   "verifier_args": {"scoring": "fraction"},
                   "completions": [{"name": "wrong_two_of_three", "text": fence(CODE[2][7]), "reward": 2 / 3}]})
    golden.append({"set": "code_lcb", "row": "rm-c03", "verifier": "code_tests", "verifier_args": {"max_tests": 2},
                   "completions": [{"name": "wrong_passes_first_two", "text": fence(CODE[2][7]), "reward": 1.0}]})

    for tid, query, entry, check, ref, wrong, crash in LEETCODE:
        files["code_leetcode.jsonl"].append({"task_id": tid, "query": query, "prompt": LEETCODE_PRELUDE,
                                             "entry_point": entry, "test": check, "completion": ref})
        name = entry.split(".")[-1]
        comps = [("correct", fence(ref), 1.0), ("wrong", fence(wrong), 0.0),
                 ("looping", fence(LOOP_CALL.format(name=name)), 0.0), ("crashing", fence(crash), 0.0)]
        comps += [(n, fence(t), 0.0) for n, t in escapes(tid, ref)]
        golden.append({"set": "code_leetcode", "row": tid, "verifier": "code_tests", "verifier_args": {},
                       "completions": [{"name": n, "text": t, "reward": r} for n, t, r in comps]})

    for key, prompt, ids, kwargs, comps in IFEVAL:
        files["ifeval.jsonl"].append({"key": key, "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs})
        if not set(ids) & set(NEEDS_PUNKT):  # the rows a host without NLTK's punkt_tab data can score
            files["ifeval_no_punkt.jsonl"].append(files["ifeval.jsonl"][-1])
        for variant in (S, L, F):
            sel = [{"name": n, "text": t, "reward": rs[variant]} for n, t, rs in comps if variant in rs]
            if sel:
                golden.append({"set": "ifeval", "row": key, "verifier": "ifeval", "verifier_args": ARGS[variant],
                               "completions": sel})
    return files


def main() -> None:
    for name, rows in build().items():
        with open(HERE / name, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
