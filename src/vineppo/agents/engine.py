"""Multi-turn rollouts over any rollout engine: the policy writes a turn, a tool or the environment answers, the
answer goes in as tokens that are not the policy's, and the policy writes on, up to `max_turns` turns,
`max_total_tokens` tokens of the policy's own and `max_inserted_tokens` inserted ones (by default what the model's
context leaves once the policy's are counted); a dialogue never outgrows the model's context.

The dialogues advance in rounds. A round is one engine job over every dialogue whose next turn is due: each row
stops at the tool-call markup's close, at an end-of-turn token or at its token limit. As soon as a row's turn ends
(the engine's per-prefix `more` hook), its tool call or environment step is handed to a thread pool, so it runs while
the other rows keep decoding; the round ends when the job does, and the next one starts once every answer of the
round is in (so the same seed gives the same dialogues). A tool call runs with the reward's time limit: past it, or
when the tool raises, the model reads the error as the tool's result; a call the model writes wrongly (not JSON, or
opened and never closed), or to a tool that does not exist, gets a message back. Every fault is counted on its
dialogue (`Turns.counts`; `counts` sums them), and when most dialogues of a `generate` are cut off by a token cap,
one warning names the flag that sets it. An environment that raises stops the rollout with a `RolloutFault` that
holds the dialogues finished before it.

VinePPO's continuations from a turn (`continuations` with `Request.records`) start from the dialogue as it was
there: its tokens, its messages, and its environment, copied at that turn or rebuilt from its row and replayed with
the earlier turns; they call the tools and the environment for real.
"""

from __future__ import annotations

import concurrent.futures
import copy as copying
import dataclasses
import sys
from collections import Counter
from typing import Any, Callable

from vineppo.agents.dialogue import Dialogue, Record
from vineppo.core import distributed as dist
from vineppo.core.errors import RewardError, RolloutFault, UserError
from vineppo.core.rewards import one_line
from vineppo.engine.api import Request, Sample, SamplingParams
from vineppo.models.causal_lm import context_length
from vineppo.tasks.agent import AgentSpec, env_stop, resumable

WORKERS = 8  # threads for tool calls and environment steps: the calls of a round run in parallel
# why a dialogue was cut off by a token cap -> the flag that sets the cap (a turn limit is a game's own end: not warned)
CAPS = {"turn": "--max-new-tokens (the tokens of one turn)", "tokens": "--max-total-tokens (the model's tokens in "
        "all its turns)", "inserted": "--max-inserted-tokens (the tokens tools and the environment insert)",
        "context": "--max-new-tokens or --max-total-tokens (the dialogue reached the model's context)"}


@dataclasses.dataclass(frozen=True)
class Caps:
    """A dialogue's token limits for one rollout: the policy's tokens in all turns, one turn's, the context."""

    policy: int  # the policy's tokens in all its turns
    turn: int  # one turn's tokens
    context: int  # the model's context: prompt and dialogue together
    inserted: int  # inserted tokens (0: what the context leaves once the policy's are counted)

    def inserted_cap(self, d: Dialogue) -> int:
        """The inserted tokens `d` may hold."""
        return self.inserted or max(0, self.context - len(d.prompt) - self.policy)

    def room(self, d: Dialogue) -> int:
        """The policy's tokens `d`'s next turn may write."""
        return min(self.turn, self.policy - d.policy_tokens(), self.context - len(d.prompt) - len(d.after))


class AgentEngine:
    """A rollout engine whose samples are dialogues (the RolloutEngine interface over an inner engine)."""

    def __init__(self, engine, spec: AgentSpec, prompter, row_of: Callable[[Any], dict], timeout_s: float = 60.0):
        self.engine, self.spec, self.prompter, self.row_of = engine, spec, prompter, row_of
        self.tokenizer, self.model = engine.tokenizer, engine.model
        self.logprobs_are_the_policys = engine.logprobs_are_the_policys  # a dialogue's own tokens are the inner's
        self.timeout_s = timeout_s or None
        self.pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="vineppo-tool")
        self.template = prompter.tool_format == "template"  # tool results as the chat template's tool turns
        self.context = context_length(self.model) if self.model is not None else 1 << 20
        self.warned = False  # the mostly-cut-off warning is said once per engine

    # ------------------------------------------------------------------ the interface

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, generator=None, progress=None,
                 examples: list | None = None) -> list[list[Sample]]:
        """n dialogues per prompt; `examples` holds each prompt's example (its row resets the environment)."""
        if examples is None:
            raise ValueError("a multi-turn engine needs each prompt's example (examples=)")
        dialogues: list[list[Dialogue]] = [[] for _ in prompts]
        try:
            for per, p, ex in zip(dialogues, prompts, examples):
                per.extend(self._fresh(p, ex) for _ in range(n))
            self._run([d for per in dialogues for d in per], params, generator, progress)
        except RewardError as e:  # an environment's fault: what finished before it is kept, nothing else is
            finished = [[d.sample(self.tokenizer) for d in per if d.finish is not None] for per in dialogues]
            raise RolloutFault(str(e), finished) from None
        self._warn_if_cut_off([d for per in dialogues for d in per], params)
        return [[d.sample(self.tokenizer) for d in per] for per in dialogues]

    def continuations(self, req: Request) -> list[list[list[Sample]]]:
        """k dialogues from each state: sequences[i][:boundaries[i][j]] must be the start of a turn of records[i]."""
        if req.records is None:
            raise ValueError("a multi-turn engine continues dialogues from their records (Request.records)")
        made = [[[self._resumed(rec, b - len(rec.prompt)) for _ in range(req.k)] for b in bs]
                for rec, bs in zip(req.records, req.boundaries)]
        self._run([d for per in made for ds in per for d in ds], req.params, req.generator, req.progress)
        return [[[d.sample(self.tokenizer) for d in ds] for ds in per] for per in made]

    def sleep(self) -> None:
        """Before an update: the inner engine frees what it holds."""
        self.engine.sleep()

    def push_weights(self, model) -> None:
        """After an update: the inner engine reloads the weights."""
        self.engine.push_weights(model)

    # ------------------------------------------------------------------ dialogues

    def _fresh(self, prompt: list[int], example) -> Dialogue:
        """A new dialogue for `example`; an environment is reset with its row, its first observation joins the prompt
        (a TRL-form one's as it is, TRL's rule)."""
        d = Dialogue(example, list(prompt))
        if self.spec.env is not None:
            d.env = self.spec.env()
            first = self._reset(d)
            if first:
                d.prompt = self.prompter.prompt(example, extra=str(first), join="" if self.spec.trl else None)
        return d

    def _reset(self, d: Dialogue):
        """The environment's reset with the dialogue's row: `reset(row)`, or `reset(**row)` in TRL's form."""
        row = self.row_of(d.example)
        return self._env_call(d, "reset", **row) if self.spec.trl else self._env_call(d, "reset", row)

    def _resumed(self, rec: Record, offset: int) -> Dialogue:
        """A dialogue continuing `rec` from the turn that starts at response offset `offset`."""
        snap = rec.at(offset)
        d = Dialogue(rec.example, list(rec.prompt), after=list(rec.after[:offset]), mask=list(rec.mask[:offset]),
                     logprobs=[0.0] * offset, messages=copying.deepcopy(rec.messages[:snap.messages]),
                     actions=list(rec.actions[:snap.actions]), start=offset)
        if self.spec.env is not None:
            if snap.env is not None:
                d.env = snap.env.copy()
            else:  # a deterministic environment: rebuilt from its row, replayed with the turns before this one
                d.env = self.spec.env()
                self._reset(d)
                for text in d.actions:
                    self._replay(d, text)
        return d

    def _replay(self, d: Dialogue, text: str) -> None:
        """An earlier turn played again on a rebuilt environment: its step, or in TRL's form the call it wrote."""
        if not self.spec.trl:
            self._env_call(d, "step", text)
        elif self._call_text(text, None) is not None:
            self._tool(d, self._call_text(text, None), Counter())

    def _run(self, dialogues: list[Dialogue], params: SamplingParams, generator, progress) -> None:
        """Advance the dialogues round by round until each has stopped or hit a limit."""
        call = (self.spec.markup.call_close,) if self.spec.tools else ()
        stop = tuple(params.stop) + call + env_stop(self.spec.env)
        turn = dataclasses.replace(params, stop=stop)
        caps = Caps(self.spec.max_total_tokens or params.max_new_tokens * self.spec.max_turns, params.max_new_tokens,
                    self.context, self.spec.max_inserted_tokens)
        while live := [d for d in dialogues if d.finish is None]:
            for d in live:
                d.seen = False
                if len(d.actions) >= self.spec.max_turns:
                    d.cut("turns")  # still going after its last turn
                elif caps.room(d) <= 0:
                    d.cut("tokens" if d.policy_tokens() >= caps.policy else "context")
                else:
                    d.begin_turn()
            live = [d for d in live if d.finish is None]
            if not live:
                break
            budgets = [[caps.room(d)] for d in live]
            hook = lambda i, j, samples: self._turn_done(live[i], samples[0], caps) or 0  # noqa: E731
            out = self.engine.continuations(Request([d.prompt + d.after for d in live],
                                                    [[len(d.prompt) + len(d.after)] for d in live], 1,
                                                    dataclasses.replace(turn, max_new_tokens=max(b[0] for b in budgets)),
                                                    generator, None, budgets, more=hook))
            for d, ((s,),) in zip(live, out):
                if not d.seen:  # an engine that does not call `more` per row
                    self._turn_done(d, s, caps)
            for d in live:
                if d.pending is not None:
                    self._answer(d, caps)
            if progress is not None:  # whole dialogues finished so far, and their tokens (the policy's and inserted)
                ended = [d for d in dialogues if d.finish is not None]
                progress(len(ended), sum(len(d.after) - d.start for d in ended))

    def _turn_done(self, d: Dialogue, s: Sample, caps: Caps) -> None:
        """Take in the policy's turn and start what answers it: a tool call, a message for a call left open, an
        environment step, or nothing (the dialogue's answer)."""
        d.seen = True
        d.add(list(s.token_ids), True, s.logprobs, s.entropies)
        d.actions.append(s.text)
        d.messages.append({"role": "assistant", "content": s.text})
        d.counts["turns"] += 1
        call = self._call_text(s.text, s.token_ids) if self.spec.tools else None
        if s.finish_reason == "length":
            d.cut("tokens" if d.policy_tokens() >= caps.policy else "context" if caps.room(d) <= 0 else "turn")
        elif call is not None:
            d.pending = ("tool", self.pool.submit(self._tool, d, call, d.counts), self._ended_with(s))
        elif self.spec.tools and (problem := self.spec.unclosed(s.text)):
            d.counts["bad_calls"] += 1
            d.pending = ("tool", _done(("", problem)), self._ended_with(s))
        elif self.spec.env is not None and not self.spec.trl:
            d.pending = ("env", self.pool.submit(self._env_call, d, "step", s.text), self._ended_with(s))
        else:
            d.finish = "stop"  # a turn without a call: the answer

    def _call_text(self, text: str, token_ids: list[int] | None) -> str | None:
        """The turn's text up to the CLOSE of the call it ends with, or None: a turn ends with a call when its text
        does (after white space), or when its last token completed CLOSE and holds more text (a tokenizer that merges
        `><`: the turn stops on `</calc><`); what follows CLOSE in that token stays the policy's and is not read.
        Without `token_ids` (an earlier turn replayed) a turn that holds CLOSE was a call: a turn stops at the token
        that completes it."""
        close = self.spec.markup.call_close
        end = text.rfind(close)
        if end < 0:
            return None
        end += len(close)
        if not text[end:].strip() or token_ids is None:
            return text[:end]
        if token_ids:  # the close ends inside the last token when that token raised the count of CLOSEs
            before = self.tokenizer.decode(list(token_ids[:-1]), skip_special_tokens=True)
            if before.count(close) < text.count(close):
                return text[:end]
        return None

    def _ended_with(self, s: Sample) -> str:
        """The text of the special token that ended a turn (an end-of-turn token the chat template writes too)."""
        last = s.token_ids[-1:] if s.token_ids else []
        return self.tokenizer.decode(last) if last and last[0] in set(self.tokenizer.all_special_ids) else ""

    def _tool(self, d: Dialogue, text: str, counts) -> tuple[str, str]:
        """Run the call written at the end of `text`, counted in `counts`; (tool name or '', its result or an error).
        A TRL-form environment's method runs on the dialogue's own instance."""
        found = self.spec.call(text)
        if isinstance(found, str):
            counts["bad_calls" if "no tool" not in found else "unknown_tools"] += 1
            return "", found
        name, args = found
        counts["tool_calls"] += 1
        tool = self.spec.tools[name]
        try:
            return name, str((getattr(d.env, name) if tool.method else tool.fn)(**args))
        except Exception as e:  # noqa: BLE001 - a tool's error goes back to the model as its result, as TRL does
            counts["tool_errors"] += 1
            return name, f"error: {one_line(e)}"

    def _warn_if_cut_off(self, dialogues: list[Dialogue], params: SamplingParams) -> None:
        """One warning, once, when most of the dialogues were cut off by a token cap: which one, and its flag."""
        why = Counter(d.cut_by for d in dialogues if d.cut_by in CAPS)
        if self.warned or not why or sum(why.values()) * 2 <= len(dialogues) or not dist.is_main():
            return
        self.warned = True
        cause, n = why.most_common(1)[0]
        sizes = {"turn": params.max_new_tokens, "tokens": self.spec.max_total_tokens or params.max_new_tokens *
                 self.spec.max_turns, "inserted": self.spec.max_inserted_tokens or "the context's room",
                 "context": self.context}
        print(f"warning: {sum(why.values())} of {len(dialogues)} dialogues were cut off by a token cap ({n} by "
              f"{CAPS[cause]}, now {sizes[cause]}): a cut-off dialogue gets reward 0; raise {CAPS[cause].split()[0]}",
              file=sys.stderr)

    def _answer(self, d: Dialogue, caps: Caps) -> None:
        """Wait for the dialogue's tool call or environment step (within the time limit) and insert its answer."""
        (kind, future, ended_with), d.pending = d.pending, None
        try:
            answer = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            if kind == "env":
                raise RewardError(f"{getattr(d.example, 'id', '?')}: the environment's step ran past its "
                                  f"{self.timeout_s:g} s limit (--reward-timeout-s)") from None
            d.counts["tool_timeouts"] += 1
            answer = ("", f"error: the call ran past its {self.timeout_s:g} s limit")
        if kind == "env":
            self._observe(d, answer, ended_with, caps)
            return
        name, result = answer
        d.messages.append({"role": "tool", "name": name, "content": result})
        m = self.spec.markup
        inline = f"{m.result_open}{result}{m.result_close}\n"
        self._insert(d, self.prompter.next_turn(d.messages, ended_with) if self.template else inline, caps)

    def _observe(self, d: Dialogue, answer: tuple, ended_with: str, caps: Caps) -> None:
        """An environment's (observation, done[, reward]) after a turn: the dialogue ends, or the observation goes in."""
        if not isinstance(answer, tuple) or len(answer) not in (2, 3):
            raise RewardError(f"{getattr(d.example, 'id', '?')}: the environment's step returned {answer!r}; expected "
                              f"(observation, done) or (observation, done, reward)")
        observation, done, *reward = answer
        if reward:
            d.reward = float(reward[0])
        if done:
            d.finish = "stop"
            return
        d.messages.append({"role": "user", "content": str(observation)})
        self._insert(d, self.prompter.next_turn(d.messages, ended_with), caps)

    def _insert(self, d: Dialogue, text: str, caps: Caps) -> None:
        """Tokens that are not the policy's, within the inserted tokens' cap and the context; past either the dialogue
        is cut off."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        by_cap = caps.inserted_cap(d) - (len(d.after) - d.policy_tokens())
        by_context = caps.context - len(d.prompt) - len(d.after)
        room = max(0, min(by_cap, by_context))
        d.add(ids[:room], False)
        if len(ids) > room:
            d.cut("inserted" if by_cap <= by_context else "context")

    def _env_call(self, d: Dialogue, method: str, *args, **kwargs):
        """An environment's reset or step; what it raises stops the run with the example's id (RewardError)."""
        try:
            return getattr(d.env, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a user's environment: one line naming the example and the call
            raise RewardError(f"{getattr(d.example, 'id', '?')}: the environment's {method} raised "
                              f"{one_line(e)}") from None


def for_task(engine, task, prompter, timeout_s: float, resume: bool):
    """`engine` itself, or for a task with tools or an environment an AgentEngine over it; `resume`: the estimator
    continues dialogues from their turns (VinePPO), which needs an environment it can rebuild there."""
    if task.agent is None:
        return engine
    if resume and not resumable(task.agent.env):
        raise UserError(f"environment {task.agent.env.__name__}: VinePPO continues dialogues from their turns and needs "
                        f"the environment there: give the class `deterministic = True` (rebuilt from its row and "
                        f"replayed with the earlier turns) or a copy() method")
    return AgentEngine(engine, task.agent, prompter, task.row, timeout_s)


def _done(value) -> concurrent.futures.Future:
    """A future that already holds `value` (an answer that needs no call)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future
