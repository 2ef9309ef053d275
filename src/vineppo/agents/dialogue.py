"""One dialogue in progress (`Dialogue`), and what its finished Sample carries (`Turns`): the policy's turns, the tokens
tools and an environment insert between them, the messages, and what resuming it at one of its turns needs.

Tokens are kept as the model reads them: the prompt, then everything after it (`after`), each token marked as the
policy's or inserted (`mask`). A turn starts where the policy writes next; `snapshots` hold, for each turn start,
the dialogue's messages so far and the environment as it was there (a copy, or the earlier turns' texts for a
deterministic environment's replay).
"""

from __future__ import annotations

import copy as copying
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterable

from vineppo.engine.api import Sample


@dataclass
class Snapshot:
    """A dialogue at the start of one of its turns."""

    tokens: int  # len(after) there
    messages: int  # len(messages) there
    env: Any = None  # the environment's copy() there, or None (replayed from `actions`, or no environment)
    actions: int = 0  # policy turns before it (a deterministic environment is replayed with their texts)


@dataclass
class Record:
    """What resuming a dialogue at one of its turns needs (Turns.record)."""

    example: Any
    prompt: list[int]
    after: list[int]
    mask: list[int]
    messages: list[dict]
    actions: list[str]  # the policy's turn texts, in order
    snapshots: list[Snapshot]

    def at(self, offset: int) -> Snapshot:
        """The snapshot of the turn that starts at response offset `offset` (a VinePPO state)."""
        for snap in self.snapshots:
            if snap.tokens == offset:
                return snap
        raise ValueError(f"no turn starts at response offset {offset}")


@dataclass
class Turns:
    """A dialogue's Sample.dialogue: everything a dialogue has that a single-turn sample does not."""

    prompt_ids: list[int]  # the prompt it continues (an environment's first observation joined the given one)
    mask: list[int]  # per token of the sample: 1 the policy's, 0 inserted by a tool or the environment
    starts: list[int]  # offsets in the sample's tokens where the policy's turns start
    messages: list[dict]  # the whole dialogue after the prompt, as chat messages (what rewards read)
    reward: float | None = None  # the environment's reward, when it gives one
    record: Record | None = None  # what resuming the dialogue at one of its turns needs (Request.records)
    counts: dict[str, float] = field(default_factory=dict)  # its turns, tool calls and faults (`counts` sums them)
    env: Any = None  # the environment instance that played it (reward functions in TRL's form get it: `environments`)


def counts(samples: Iterable[Any], prefix: str = "") -> dict[str, float]:
    """The dialogues' counts summed (PREFIX + agent/NAME): turns, tool calls, bad and unknown calls, tool errors and
    time-outs, cut-off dialogues; none for single-turn samples."""
    total: Counter = Counter()
    for s in samples:
        if s.dialogue is not None:
            total.update(s.dialogue.counts)
    return {f"{prefix}agent/{k}": float(v) for k, v in sorted(total.items())}


@dataclass
class Dialogue:
    """A rollout under way, from a prompt or from a turn of an earlier dialogue (`start`: where its own tokens start)."""

    example: Any
    prompt: list[int]
    after: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] | None = None  # per token of `after` when the engine gave them (inserted tokens: 0)
    turns: list[int] = field(default_factory=list)  # offsets in `after` where the policy's turns start
    messages: list[dict] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    env: Any = None
    start: int = 0  # len(after) when this rollout began (a continuation's prefix before it)
    finish: str | None = None  # "stop" or "length" once over
    reward: float | None = None  # the environment's
    pending: tuple[str, Future, str] | None = None  # (tool or env, the call under way, the turn's end token)
    seen: bool = False  # this round's turn has been taken in
    counts: Counter = field(default_factory=Counter)  # turns, tool calls and faults of this rollout (Turns.counts)
    cut_by: str | None = None  # what cut it off: turns, turn, tokens, inserted or context (vineppo.agents.engine)

    def cut(self, why: str) -> None:
        """End the dialogue as cut off (reward 0), counted, by `why` (which limit it reached)."""
        self.finish, self.cut_by = "length", why
        self.counts["cut_off"] += 1

    def policy_tokens(self) -> int:
        """The policy's tokens in the dialogue (a continuation's prefix included)."""
        return sum(self.mask)

    def begin_turn(self) -> None:
        """Mark the start of a policy turn and snapshot the dialogue there."""
        self.turns.append(len(self.after))
        env = self.env.copy() if self.env is not None and callable(getattr(self.env, "copy", None)) else None
        self.snapshots.append(Snapshot(len(self.after), len(self.messages), env, len(self.actions)))

    def add(self, tokens: list[int], policy: bool, logprobs: list[float] | None = None,
            entropies: list[float] | None = None) -> None:
        """Append tokens, the policy's (with their sampling log-probs and entropies) or inserted (masked out)."""
        if entropies is not None and self.entropies is None:  # the tokens before the first turn that had them
            self.entropies = [0.0] * len(self.after)
        self.after += tokens
        self.mask += [int(policy)] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        if self.entropies is not None:
            self.entropies += list(entropies) if entropies is not None else [0.0] * len(tokens)

    def sample(self, tokenizer) -> Sample:
        """This rollout as a Sample: its own tokens (from `start`), and its Turns: their mask and starts, the whole
        dialogue's messages, the record that resumes it, its counts."""
        own = self.after[self.start:]
        record = Record(self.example, self.prompt, list(self.after), list(self.mask), copying.deepcopy(self.messages),
                        list(self.actions), list(self.snapshots))
        turns = Turns(list(self.prompt), self.mask[self.start:], [t - self.start for t in self.turns if t >= self.start],
                      copying.deepcopy(self.messages), self.reward, record, dict(self.counts), self.env)
        entropies = self.entropies[self.start:] if self.entropies is not None else None
        return Sample(own, tokenizer.decode(own, skip_special_tokens=True), self.logprobs[self.start:],
                      self.finish or "length", entropies, dialogue=turns)
