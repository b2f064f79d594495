"""Rule-based verifiers: response text + reference answer -> scalar reward.

Rewards are `correct` (default +1) for a right final answer and `wrong` (default -1) otherwise, as in the paper's
rule reward. Verifiers never raise and do bounded work per call:

* only the last `MAX_RESPONSE_CHARS` characters of a response are searched (the final answer is at the end), so a
  1 MB response costs the same as a 4 KB one;
* an extracted answer longer than `MAX_ANSWER_CHARS` counts as wrong without being parsed;
* before handing an expression to sympy (via `math_verify`) exponent towers, repeated or nested factorials and
  exponents / factorial arguments with more than `MAX_EXPONENT_DIGITS` digits are refused: sympy evaluates those in
  uninterruptible C big-int code (e.g. `10^{10^{10}}` or `9!!!!!!!!!` never return), and math_verify's own timeouts
  (signal.alarm) cannot stop that and do not work off the main thread, so they are disabled;
* and the sympy comparison itself runs in a worker process with a deadline (`SYMPY_TIMEOUT_S`): an expression the
  guards above miss is killed there and scored wrong, so no answer can stop an RL run. The worker starts on the
  first answer that needs sympy (never for the synthetic task) and is reused.

Final-answer formats:
* synthetic task: the last `Answer:` line, which must read `Answer: <integer>` (see `ANSWER_PREFIX`); the integer
  must equal the reference string exactly.
* math tasks (gsm8k, math, word_problems): the last complete `\\boxed{...}` (nested braces), else the text after the
  last `####`, else the text after the last `Answer:`; equivalence by a cheap string/number check first, then
  `math_verify`.
* word_problems also takes a plain "The answer is 12 apples." when there is no box (`ANSWER_PHRASE_TASKS`): between
  the box and `####`, the last number of the sentence after the last "the answer is" / "the final answer is" (any
  case; see `answer_after_phrase`). gsm8k and math keep the stricter formats: a number pulled out of free text is
  unsafe for MATH's symbolic answers, and changing gsm8k's reward would change its published runs.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import re
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np

ANSWER_PREFIX = 'Answer:'
MAX_RESPONSE_CHARS = 4096
MAX_ANSWER_CHARS = 200
MAX_EXPONENT_DIGITS = 4
SYMPY_TIMEOUT_S = 5.0
TASKS = ('synthetic', 'gsm8k', 'math', 'word_problems')
# Math-style tasks whose final answer may also be a number after "The answer is" (their worked solutions say so).
ANSWER_PHRASE_TASKS = ('word_problems',)

Verifier = Callable[[str, str], float]

_SYNTHETIC_ANSWER_RE = re.compile(r' *(-?\d+) *')
_BOX_RE = re.compile(r'\\(?:boxed|fbox)\s*\{')
_BOX_BARE_RE = re.compile(r'\\boxed +([^\s${}]+)')
_THOUSANDS_RE = re.compile(r'^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$')
_NUMBER_RE = re.compile(r'^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d{1,3})?$')
_FRAC_RE = re.compile(r'^([+-]?)\\[dt]?frac\{([+-]?\d+)\}\{([+-]?\d+)\}$')
_FRAC_SHORT_RE = re.compile(r'^([+-]?)\\[dt]?frac(\d)(\d)$')
_SLASH_RE = re.compile(r'^([+-]?\d+)/([+-]?\d+)$')
_TEXT_RE = re.compile(r'\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}')
_ANSWER_PHRASE_RE = re.compile(r'\bthe (?:final )?answer is\b', re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r'\n|\.(?=\s|$)')
# A number standing on its own: not part of a word, a fraction (`1/2`, `\frac{1}{2}`), a power or an index, so
# "The answer is 1/2" yields no number rather than the 2. A leading '-' is kept: "-12" must not read as 12.
_STANDALONE_NUMBER_RE = re.compile(r'(?<![\w/^{}.,-])-?\d+(?:,\d{3})*(?:\.\d+)?(?![\w/^{}]|\.\d)')
_HUGE_NUMBER_RE = re.compile(r'\d{%d,}\s*!|\d[eE][+-]?\d{%d,}' % ((MAX_EXPONENT_DIGITS + 1,) * 2))


def _tail(text: object, max_chars: int | None) -> str:
    if isinstance(text, bytes):
        text = text.decode('utf-8', errors='replace')
    if not isinstance(text, str):
        return ''
    return text if max_chars is None else text[-max_chars:]


def _braced(text: str, open_pos: int) -> str | None:
    """Content of the brace group whose '{' is at `open_pos`, or None if it never closes."""
    depth = 0
    for i in range(open_pos, len(text)):
        c = text[i]
        if c == '{':
            depth += 1
        elif c == '}':
            depth -= 1
            if depth == 0:
                return text[open_pos + 1:i]
    return None


def last_boxed(text: str, max_chars: int | None = MAX_RESPONSE_CHARS) -> str | None:
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}` (nested braces) or `\\boxed x`; None if absent.

    An unclosed last box (a truncated response) falls back to the previous complete one.
    """
    text = _tail(text, max_chars)
    braced = [(m.start(), m.end() - 1) for m in _BOX_RE.finditer(text)]
    bare = [(m.start(), m.group(1)) for m in _BOX_BARE_RE.finditer(text)]
    for start, item in sorted(braced + bare, key=lambda pair: pair[0], reverse=True):
        content = item if isinstance(item, str) else _braced(text, item)
        if content is not None:
            return content
    return None


def _after_last(text: str, marker: str) -> str | None:
    pos = text.rfind(marker)
    if pos < 0:
        return None
    line = text[pos + len(marker):].strip().split('\n', 1)[0]
    return line.strip() or None


def answer_after_phrase(text: str) -> str | None:
    """The last standalone number in the sentence after the last "the answer is" (any case, "final" optional).

    "The answer is 12 apples." -> '12'; "The answer is $12$." -> '12'; "the answer is 5 + 7 = 12" -> '12'; "The
    answer is 1/2." -> None. The sentence ends at a line break or at a '.' before a space or the end.
    """
    text = _tail(text, MAX_RESPONSE_CHARS)
    matches = list(_ANSWER_PHRASE_RE.finditer(text))
    if not matches:
        return None
    sentence = _SENTENCE_END_RE.split(text[matches[-1].end():], 1)[0]
    numbers = _STANDALONE_NUMBER_RE.findall(_TEXT_RE.sub(r'\1', sentence))
    return numbers[-1] if numbers else None


def extract_math_answer(text: str, *, answer_phrase: bool = False) -> str | None:
    """Final answer of a math response: last `\\boxed{}`, else (answer_phrase) the number after the last "The answer
    is", else after last `####`, else after last `Answer:`."""
    text = _tail(text, MAX_RESPONSE_CHARS)
    boxed = last_boxed(text, max_chars=None)
    if boxed is not None:
        return boxed
    if answer_phrase:
        found = answer_after_phrase(text)
        if found is not None:
            return found
    for marker in ('####', ANSWER_PREFIX):
        found = _after_last(text, marker)
        if found is not None:
            return found
    return None


def extract_synthetic_answer(text: str) -> str | None:
    """The integer on the last `Answer:` line of a synthetic-task response; None if absent or malformed.

    Only the last `Answer:` counts, and its line must be exactly `Answer: <int>` (spaces aside).
    """
    text = _tail(text, MAX_RESPONSE_CHARS)
    pos = text.rfind(ANSWER_PREFIX)
    if pos < 0:
        return None
    m = _SYNTHETIC_ANSWER_RE.fullmatch(text[pos + len(ANSWER_PREFIX):].split('\n', 1)[0])
    return m.group(1) if m else None


def normalize_answer(ans: str) -> str:
    """Cheap canonical string: no math-mode `$`, spacing macros, \\left/\\right, \\text{}, trailing '.'."""
    s = ans.strip().strip('$').strip()
    s = _TEXT_RE.sub(r'\1', s)
    for junk in ('\\$', '\\left', '\\right', '\\!', '\\,', '\\;', '\\:', '\\ ', '\\displaystyle'):
        s = s.replace(junk, '')
    s = s.replace('\\dfrac', '\\frac').replace('\\tfrac', '\\frac')
    s = re.sub(r'\s+', '', s)
    return s.rstrip('.')


def _as_number(s: str) -> Fraction | None:
    """Exact value of a plain number: int/decimal (thousands commas allowed), `a/b`, `\\frac{a}{b}`; else None."""
    if _THOUSANDS_RE.match(s):
        s = s.replace(',', '')
    if _NUMBER_RE.match(s):
        if len(s) > 64:
            return None
        return Fraction(s)
    for regex in (_FRAC_RE, _FRAC_SHORT_RE, _SLASH_RE):
        m = regex.match(s)
        if m:
            groups = m.groups()
            num, den = (groups[0] + groups[1], groups[2]) if len(groups) == 3 else groups
            return Fraction(int(num), int(den)) if int(den) != 0 else None
    return None


def _exponents(s: str) -> list[str]:
    """The exponent operand of every `^` / `**` in s (brace/paren group, else the following number/char)."""
    out = []
    for m in re.finditer(r'\^|\*\*', s):
        rest = s[m.end():].lstrip()
        if rest[:1] in ('{', '('):
            close = {'{': '}', '(': ')'}[rest[0]]
            depth, end = 0, len(rest)
            for i, c in enumerate(rest):
                depth += c == rest[0]
                depth -= c == close
                if depth == 0:
                    end = i
                    break
            out.append(rest[1:end])
        else:
            num = re.match(r'[+-]?\d+', rest)
            out.append(num.group(0) if num else rest[:1])
    return out


def is_safe_for_sympy(s: str) -> bool:
    """False for expressions sympy may take unbounded time on (exponent towers, huge exponents/factorials)."""
    if len(s) > MAX_ANSWER_CHARS or _HUGE_NUMBER_RE.search(s):
        return False
    # Factorial towers (`9!!!!`, `(3!)!`): each level multiplies the digit count, like an exponent tower.
    if s.count('!') > 1 or re.search(r'[)}\]]\s*!', s):
        return False
    for exponent in _exponents(s):
        if '^' in exponent or '**' in exponent:
            return False
        if re.search(r'\d{%d,}' % (MAX_EXPONENT_DIGITS + 1), exponent):
            return False
    return True


def sympy_equal(pred: str, gold: str) -> bool:
    """math_verify's equivalence of two answers, with no time bound of its own (run it through `BoundedCall`)."""
    # Imported lazily: math_verify pulls in sympy (~1 s) and only this slow path needs it.
    from math_verify import parse, verify
    gold_parsed = parse(f'${gold}$', parsing_timeout=None)
    pred_parsed = parse(f'${pred}$', parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _serve(conn, fn) -> None:
    """Worker process loop: receives argument tuples, sends back fn(*args) (False if it raised)."""
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            result = bool(fn(*args))
        except Exception:  # pylint: disable=broad-except
            result = False
        conn.send(result)


class BoundedCall:
    """`call(*args) -> bool`: fn(*args) in a persistent worker process, or False when it takes longer than
    `timeout_s` (the worker is then killed and restarted on the next call) or fails.

    fn must be a module-level (picklable) function. A 'spawn' worker: forking a process that runs XLA's threads is
    unsafe. Not thread-safe: one verifier per thread.
    """

    def __init__(self, fn: Callable[..., bool], timeout_s: float, startup_s: float = 60.0):
        if not timeout_s > 0 or not startup_s >= 0:
            raise ValueError(f'timeout_s must be > 0 and startup_s >= 0, got {timeout_s!r}, {startup_s!r}')
        self.fn, self.timeout_s, self.startup_s = fn, timeout_s, startup_s
        self._proc = self._conn = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context('spawn')
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.fn), daemon=True)
        self._proc.start()
        child.close()

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None

    def __call__(self, *args) -> bool:
        deadline = self.timeout_s
        if self._proc is None or not self._proc.is_alive():
            self.close()
            self._start()
            deadline += self.startup_s  # the worker's start (spawn, imports) is not the answer's time
        try:
            self._conn.send(args)
            if self._conn.poll(deadline):
                return bool(self._conn.recv())
        except (EOFError, OSError):
            pass
        self.close()
        return False


def math_equal(pred: str, gold: str, sympy_call: Callable[[str, str], bool] = sympy_equal) -> bool:
    """Whether a predicted final answer equals the reference (string, then number, then `sympy_call`: math_verify,
    by default in this process; `make_verifier` passes a `BoundedCall` of it)."""
    if len(pred) > MAX_ANSWER_CHARS:
        return False
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p:
        return False
    if p == g:
        return True
    p_num, g_num = _as_number(p), _as_number(g)
    if p_num is not None and g_num is not None:
        return p_num == g_num
    if not (is_safe_for_sympy(p) and is_safe_for_sympy(g)):
        return False
    return sympy_call(pred, gold)


def _check_reward_values(correct: float, wrong: float) -> None:
    for name, value in (('correct', correct), ('wrong', wrong)):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f'{name} must be a finite number, got {value!r}')
    if correct <= wrong:
        raise ValueError(f'correct ({correct}) must be greater than wrong ({wrong})')


def answer_extractor(task_name: str) -> Callable[[str], str | None]:
    """`extract(response_text) -> final answer or None`, as the task's verifier reads it (module docstring). A
    response it finds an answer in is well formatted, right or wrong: the format rate counts these."""
    if task_name not in TASKS:
        raise ValueError(f'task_name must be one of {TASKS}, got {task_name!r}')
    if task_name == 'synthetic':
        return extract_synthetic_answer
    return functools.partial(extract_math_answer, answer_phrase=task_name in ANSWER_PHRASE_TASKS)


def make_verifier(task_name: str, *, correct: float = 1.0, wrong: float = -1.0) -> Verifier:
    """Returns `verify(response_text, answer) -> float` for a task in `TASKS`; never raises."""
    if task_name not in TASKS:
        raise ValueError(f'task_name must be one of {TASKS}, got {task_name!r}')
    _check_reward_values(correct, wrong)
    correct, wrong = float(correct), float(wrong)

    extract = answer_extractor(task_name)
    if task_name == 'synthetic':
        def is_correct(response: str, answer: str) -> bool:
            pred = extract(response)
            return pred is not None and pred == str(answer).strip()
    else:
        bounded = BoundedCall(sympy_equal, SYMPY_TIMEOUT_S)

        def is_correct(response: str, answer: str) -> bool:
            pred = extract(response)
            return pred is not None and math_equal(pred, str(answer), bounded)

    def verifier(response_text: str, answer: str) -> float:
        try:
            return correct if is_correct(response_text, answer) else wrong
        except Exception:  # pylint: disable=broad-except
            # Garbage output (or a sympy corner case) is a wrong answer, never a crash of the RL loop.
            return wrong

    return verifier


def score_batch(verifier: Verifier, responses: Sequence[str], answers: Sequence[str]) -> np.ndarray:
    """Rewards for a batch. responses, answers: [batch] -> float32 [batch]."""
    if len(responses) != len(answers):
        raise ValueError(f'responses ({len(responses)}) and answers ({len(answers)}) must have the same length')
    return np.asarray([verifier(r, a) for r, a in zip(responses, answers)], dtype=np.float32)
