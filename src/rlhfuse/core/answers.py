"""The built-in checks of a response's final answer, plain functions of strings with no torch (the rule rewards
of `rlhfuse.core.rewards` and the calculator environment of `rlhfuse.agents` use them)."""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_MARKER = re.compile(r"(?:####|\banswer\b\s*(?:is)?\s*[:=]?)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the content of its last `\\boxed{...}`, else the text after its last
    `####` or `answer` marker (`answer:`, `answer is`, `Answer =`), up to the end of that line; None if none."""
    boxed = _BOXED.findall(response)
    if boxed:
        return str(boxed[-1]).strip()
    markers = list(_MARKER.finditer(response))
    if not markers:
        return None
    rest = response[markers[-1].end() :].strip().splitlines()
    return rest[0].strip() if rest and rest[0].strip() else None


def normalize_answer(text: str) -> str:
    """Case-folded, whitespace-collapsed, without surrounding punctuation or `$`: the form exact match compares."""
    return " ".join(text.casefold().split()).strip(" .,;:!$")


def parse_number(text: str) -> float | None:
    """The first number in `text` (thousands commas allowed), or None."""
    found = _NUMBER.search(text)
    if found is None:
        return None
    try:
        return float(found.group(0).replace(",", ""))
    except ValueError:
        return None


def exact_match(response: str, answer: str) -> float:
    """1 if the response's final answer (`extract_answer`) equals `answer` after `normalize_answer`, else 0."""
    got = extract_answer(response)
    return float(got is not None and normalize_answer(got) == normalize_answer(str(answer)))


def numeric_match(response: str, answer: str | float, rel_tol: float = 1e-6) -> float:
    """1 if the number in the response's final answer (or, without an answer marker, the response's last
    number) equals `answer` to within `rel_tol` (relative, absolute below 1), else 0."""
    target = parse_number(str(answer))
    if target is None:
        raise ValueError(f"the reference answer {answer!r} is not a number")
    got_text = extract_answer(response)
    if got_text is None:
        numbers = _NUMBER.findall(response)
        got_text = numbers[-1] if numbers else None
    got = None if got_text is None else parse_number(got_text)
    return float(got is not None and abs(got - target) <= rel_tol * max(1.0, abs(target)))


def has_answer_format(response: str, finished: bool) -> float:
    """1 if the response finished (EOS, not cut at the token limit) and states a final answer, else 0."""
    return float(finished and extract_answer(response) is not None)
