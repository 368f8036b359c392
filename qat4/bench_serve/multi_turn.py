"""`qat4 bench serve --multi-turn`: conversations that grow turn by turn, timed against a cold read
of the same prompt and a read of only the new tokens, to show what the prompt cache saves."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from qat4.bench_serve.driver import RequestResult, send_request
from qat4.bench_serve.stats import summarize_ms
from qat4.bench_serve.workload import PROMPT_IDS, WORDS, Workload


@dataclass
class TurnReport:
    """One turn over every conversation (the sessions of every round): time to first token with the
    prompt cache's help, read cold (the same conversation under a fresh system message, so no
    prefix matches) and for a prompt of only the tokens the turn read (random ids, as many as its
    prompt minus its cached tokens), and how much of the previous turn's prompt came back from the
    cache."""

    turn: int
    conversations: int  # timed at this turn: the sessions of every round
    failed: int
    prompt_tokens: float  # mean over the conversations
    cached_tokens: float  # mean over the conversations
    reusable_tokens: float  # mean: the previous turn's prompt, which this one starts with
    ttft_ms: dict[str, float | None]
    cold_ttft_ms: dict[str, float | None]
    new_only_ttft_ms: dict[str, float | None]

    @property
    def over_new_only(self) -> float | None:
        """p50 TTFT over the p50 TTFT of reading only the new tokens."""
        warm, new = self.ttft_ms["p50"], self.new_only_ttft_ms["p50"]
        return warm / new if warm is not None and new else None


def _conversation_turns(workload: Workload, turns: int, turn_len: int, rng: random.Random) -> list[list[str]]:
    """User messages of one conversation: input_len words, then turn_len words each turn."""
    return [" ".join(rng.choices(WORDS, k=workload.input_len if t == 0 else turn_len)) for t in range(turns)]


def run_multi_turn(workload: Workload, turns: int, sessions: int, turn_len: int, seed: int,
                   on_result: Callable[[str, int, int, RequestResult], None] | None = None,
                   rounds: int = 1) -> list[TurnReport]:
    """`sessions` conversations of `turns` turns at once, each client sending its next turn when its
    last reply ended (the history grows by the reply and turn_len words each turn); then the same
    requests again, each under a system message of its own (a cold read), and as completions of
    random token ids as long as what each warm turn read beyond its cached tokens (the time of
    reading only the new tokens). Each phase runs `rounds` times over new conversations, one round
    after the other, so that a turn's percentiles come from sessions x rounds requests, each made
    beside sessions - 1 others. TTFT per turn all three ways and the prompt tokens the server
    reports cached (usage.prompt_tokens_details.cached_tokens)."""
    rng = random.Random(seed)
    waves = [range(r * sessions, (r + 1) * sessions) for r in range(rounds)]
    total = sessions * rounds
    conversations = [_conversation_turns(workload, turns, turn_len, rng) for _ in range(total)]
    tag = lambda: " ".join(rng.choices(WORDS, k=8))  # noqa: E731  (a system message of 8 words)
    sent: list[list[list[dict[str, str]]]] = [[] for _ in range(total)]
    warm: list[list[RequestResult]] = [[] for _ in range(total)]
    cold: list[list[RequestResult | None]] = [[None] * turns for _ in range(total)]
    new_only: list[list[RequestResult | None]] = [[None] * turns for _ in range(total)]
    ids = replace(workload, endpoint="completions")
    done = {"warm": 0, "cold": 0, "new tokens only": 0}

    def counted(phase: str, result: RequestResult) -> None:
        done[phase] += 1
        if on_result is not None:
            on_result(phase, done[phase], total * turns, result)

    async def converse(s: int) -> None:
        messages = [{"role": "system", "content": tag()}]
        for user in conversations[s]:
            messages.append({"role": "user", "content": user})
            sent[s].append(list(messages))
            result = await send_request(workload, list(messages), workload.output_len)
            warm[s].append(result)
            counted("warm", result)
            messages.append({"role": "assistant", "content": result.text})

    async def replay(s: int) -> None:
        for t, messages in enumerate(sent[s]):
            fresh = [{"role": "system", "content": tag()}, *messages[1:]]
            cold[s][t] = await send_request(workload, fresh, workload.output_len)
            counted("cold", cold[s][t])

    async def read_new(s: int) -> None:
        for t, turn in enumerate(warm[s]):
            if turn.ok:
                prompt = rng.choices(PROMPT_IDS, k=max(1, turn.input_tokens - turn.cached_tokens))
                new_only[s][t] = await send_request(ids, prompt, workload.output_len)
                counted("new tokens only", new_only[s][t])

    async def phases() -> None:
        for phase in (converse, replay, read_new):
            for wave in waves:
                await asyncio.gather(*(phase(s) for s in wave))

    asyncio.run(phases())
    reports = []
    for t in range(turns):
        ok = [s for s in range(total) if t < len(warm[s]) and warm[s][t].ok]
        colds = [cold[s][t] for s in range(total) if cold[s][t] is not None and cold[s][t].ok]
        news = [new_only[s][t] for s in range(total) if new_only[s][t] is not None and new_only[s][t].ok]
        per = max(1, len(ok))
        reports.append(TurnReport(
            turn=t + 1, conversations=total, failed=total - len(ok),
            prompt_tokens=sum(warm[s][t].input_tokens for s in ok) / per,
            cached_tokens=sum(warm[s][t].cached_tokens for s in ok) / per,
            reusable_tokens=sum(warm[s][t - 1].input_tokens for s in ok if t) / per,
            ttft_ms=summarize_ms([warm[s][t].ttft_s for s in ok]), cold_ttft_ms=summarize_ms([r.ttft_s for r in colds]),
            new_only_ttft_ms=summarize_ms([r.ttft_s for r in news]),
        ))
    return reports


def hit_rate(turns: Sequence[TurnReport]) -> float | None:
    """Cached tokens over reusable ones (each turn's cached tokens counted up to its reusable ones),
    over the turns after the first; None when nothing was reusable."""
    later = [t for t in turns if t.turn > 1 and t.reusable_tokens]
    reusable = sum(t.reusable_tokens for t in later)
    return sum(min(t.cached_tokens, t.reusable_tokens) for t in later) / reusable if reusable else None

