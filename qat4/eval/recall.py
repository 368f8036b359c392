"""Long-context recall: a prompt filled with numbered records, each with a random six-digit code,
asks for the code of the record a quarter of the way in; thinking off.

Each depth is a prompt budget in tokens, counted with Gemma 4's tokenizer and chat template (the
ones qat4 ships), so the same prompts go to any server; the prompt holds as many records as fit in
the depth less the reply's tokens (--max-tokens). A reply is right when the first six-digit number in it is the
asked record's code; a wrong one is told apart by whose code it is (another record's, or none's).
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from qat4.chat import render_prompt
from qat4.errors import Qat4Error
from qat4.eval.client import Reply
from qat4.eval.records import Record, Verdict
from qat4.eval.runner import Question
from qat4.tokenizer import Tokenizer

INTRO = "Below is a list of records. Each record has a number and a six-digit code.\n\n"
_CODE = re.compile(r"(?<!\d)\d{6}(?!\d)")


def parse_depths(text: str) -> list[int]:
    """--depths: comma-separated token counts, with k for 1,024 (4k,32k,128k)."""
    depths = []
    for part in (p.strip().lower() for p in text.split(",")):
        try:
            depths.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
        except ValueError:
            raise Qat4Error(f"--depths takes token counts such as 4k,32k,128k, got {text!r}") from None
    if not depths or min(depths) < 256:
        raise Qat4Error(f"--depths must list token counts of at least 256, got {text!r}")
    return depths


def _record_line(number: int, code: int) -> str:
    return f"Record {number}: the code of record {number} is {code}.\n"


def _question_text(target: int) -> str:
    return f"\nWhat is the code of record {target}? Reply with the six-digit code only."


def _prompt_tokens(tokenizer: Tokenizer, content: str) -> int:
    text = render_prompt([{"role": "user", "content": content}], template=tokenizer.chat_template)
    return len(tokenizer.encode(text))


def build(depth: int, seed: int, tokenizer: Tokenizer, max_tokens: int) -> Question:
    """The question at `depth` for `seed`: records 1..n with distinct random codes, n the most that
    keep the prompt and a reply of `max_tokens` within `depth` tokens."""
    budget = depth - max_tokens
    rng = random.Random(seed)
    overhead = _prompt_tokens(tokenizer, INTRO + _question_text(999_999))
    shortest = len(tokenizer.encode(_record_line(1, 999_999)))
    codes = rng.sample(range(100_000, 1_000_000), max(4, (budget - overhead) // shortest))
    lines = [_record_line(i + 1, code) for i, code in enumerate(codes)]
    count, used = 0, overhead
    for line in lines:  # as many records as fit, counting each line on its own
        used += len(tokenizer.encode(line))
        if used > budget:
            break
        count += 1
    while True:  # the whole prompt counted at once decides
        target = max(1, count // 4)
        content = INTRO + "".join(lines[:count]) + _question_text(target)
        tokens = _prompt_tokens(tokenizer, content)
        if tokens <= budget or count <= 4:
            break
        count -= 1
    if tokens > budget:
        raise Qat4Error(f"a depth of {depth} tokens is too small for four records and a reply of {max_tokens}")
    extra = {"depth": depth, "seed": seed, "records": count, "target": target, "prompt_tokens": tokens,
             "codes": {str(code): i + 1 for i, code in enumerate(codes[:count])}}
    return Question(f"recall_{depth}_{seed}", [{"role": "user", "content": content}], str(codes[target - 1]),
                    max_tokens, thinking=False, extra=extra)


def questions(depths: Sequence[int], seeds: Sequence[int], tokenizer: Tokenizer, max_tokens: int) -> list[Question]:
    """One question per depth and seed, depth by depth."""
    return [build(depth, seed, tokenizer, max_tokens) for depth in depths for seed in seeds]


def score(question: Question, reply: Reply) -> Verdict:
    """Right when the reply's first six-digit number is the asked record's code; a wrong one says whose it was."""
    codes = _CODE.findall(reply.content)
    if not codes:
        return Verdict(None, False, "no six-digit code in the reply")
    code = codes[0]
    if code == question.expected:
        return Verdict(code, True)
    record = question.extra["codes"].get(code)
    return Verdict(code, False, f"the code of record {record}" if record else "the code of no record")


def by_depth(records: Sequence[Record]) -> dict[str, Any]:
    """Per depth: right, wrong, and what each wrong reply gave back."""
    table: dict[int, dict[str, Any]] = defaultdict(lambda: {"right": 0, "wrong": 0, "wrong_replies": []})
    for r in records:
        row = table[r.extra["depth"]]
        row["right" if r.correct else "wrong"] += 1
        if not r.correct:
            row["wrong_replies"].append({"seed": r.extra["seed"], "target": r.extra["target"], "gave": r.reason})
    return {str(depth): row for depth, row in sorted(table.items())}
