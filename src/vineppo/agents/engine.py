"""Multi-turn rollouts over any rollout engine: the policy writes a turn, a tool or the environment answers, the
answer goes in as tokens that are not the policy's, and the policy writes on, up to `max_turns` turns and
`max_total_tokens` tokens after the prompt.

The dialogues advance in rounds. A round is one engine job over every dialogue whose next turn is due: each row
stops at the tool-call markup's close, at an end-of-turn token or at its token limit. As soon as a row's turn ends
(the engine's per-prefix `more` hook), its tool call or environment step is handed to a thread pool, so it runs while
the other rows keep decoding; the round ends when the job does, and the next one starts once every answer of the
round is in (so the same seed gives the same dialogues). A tool call runs with the reward's time limit: past it, or
when the tool raises, the model reads the error as the tool's result; a call the model writes wrongly, or to a tool
that does not exist, gets a message back. Every fault is counted on its dialogue (`Turns.counts`; `counts` sums them).

VinePPO's continuations from a turn (`continuations` with `Request.records`) start from the dialogue as it was
there: its tokens, its messages, and its environment, copied at that turn or rebuilt from its row and replayed with
the earlier turns; they call the tools and the environment for real.
"""

from __future__ import annotations

import concurrent.futures
import copy as copying
import dataclasses
from typing import Any, Callable

from vineppo.agents.dialogue import Dialogue, Record
from vineppo.core.errors import RewardError, UserError
from vineppo.core.rewards import one_line
from vineppo.engine.api import Request, Sample, SamplingParams
from vineppo.tasks.agent import AgentSpec, env_stop, resumable

WORKERS = 8  # threads for tool calls and environment steps: the calls of a round run in parallel


class AgentEngine:
    """A rollout engine whose samples are dialogues (the RolloutEngine interface over an inner engine)."""

    def __init__(self, engine, spec: AgentSpec, prompter, row_of: Callable[[Any], dict], timeout_s: float = 60.0):
        self.engine, self.spec, self.prompter, self.row_of = engine, spec, prompter, row_of
        self.tokenizer, self.model = engine.tokenizer, engine.model
        self.logprobs_are_the_policys = engine.logprobs_are_the_policys  # a dialogue's own tokens are the inner's
        self.timeout_s = timeout_s or None
        self.pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="vineppo-tool")
        self.template = prompter.tool_format == "template"  # tool results as the chat template's tool turns

    # ------------------------------------------------------------------ the interface

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, generator=None, progress=None,
                 examples: list | None = None) -> list[list[Sample]]:
        """n dialogues per prompt; `examples` holds each prompt's example (its row resets the environment)."""
        if examples is None:
            raise ValueError("a multi-turn engine needs each prompt's example (examples=)")
        dialogues = [[self._fresh(p, ex) for _ in range(n)] for p, ex in zip(prompts, examples)]
        self._run([d for per in dialogues for d in per], params, generator, progress)
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
        """A new dialogue for `example`; an environment is reset with its row, its first observation joins the prompt."""
        d = Dialogue(example, list(prompt))
        if self.spec.env is not None:
            d.env = self.spec.env()
            first = self._env_call(d, "reset", self.row_of(example))
            if first:
                d.prompt = self.prompter.prompt(example, extra=str(first))
        return d

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
                self._env_call(d, "reset", self.row_of(rec.example))
                for text in d.actions:
                    self._env_call(d, "step", text)
        return d

    def _run(self, dialogues: list[Dialogue], params: SamplingParams, generator, progress) -> None:
        """Advance the dialogues round by round until each has stopped or hit a limit."""
        call = (self.spec.markup.call_close,) if self.spec.tools else ()
        stop = tuple(params.stop) + call + env_stop(self.spec.env)
        turn = dataclasses.replace(params, stop=stop)
        cap = self.spec.max_total_tokens or params.max_new_tokens * self.spec.max_turns
        while live := [d for d in dialogues if d.finish is None]:
            for d in live:
                d.seen = False
                if len(d.actions) >= self.spec.max_turns or len(d.after) >= cap:
                    d.finish = "length"  # still going after its last turn, or out of tokens: cut off
                    d.counts["cut_off"] += 1
                else:
                    d.begin_turn()
            live = [d for d in live if d.finish is None]
            if not live:
                break
            budgets = [[max(1, min(turn.max_new_tokens, cap - len(d.after)))] for d in live]
            hook = lambda i, j, samples: self._turn_done(live[i], samples[0], cap) or 0  # noqa: E731
            out = self.engine.continuations(Request([d.prompt + d.after for d in live],
                                                    [[len(d.prompt) + len(d.after)] for d in live], 1,
                                                    dataclasses.replace(turn, max_new_tokens=max(b[0] for b in budgets)),
                                                    generator, progress, budgets, more=hook))
            for d, ((s,),) in zip(live, out):
                if not d.seen:  # an engine that does not call `more` per row
                    self._turn_done(d, s, cap)
            for d in live:
                if d.pending is not None:
                    self._answer(d, cap)

    def _turn_done(self, d: Dialogue, s: Sample, cap: int) -> None:
        """Take in the policy's turn and start what answers it: a tool call, an environment step, or nothing."""
        d.seen = True
        d.add(list(s.token_ids), True, s.logprobs, s.entropies)
        d.actions.append(s.text)
        d.messages.append({"role": "assistant", "content": s.text})
        d.counts["turns"] += 1
        if s.finish_reason == "length":
            d.finish = "length"
            d.counts["cut_off"] += 1
        elif self.spec.tools and s.text.rstrip().endswith(self.spec.markup.call_close):
            d.pending = ("tool", self.pool.submit(self._tool, s.text, d.counts), self._ended_with(s))
        elif self.spec.env is not None:
            d.pending = ("env", self.pool.submit(self._env_call, d, "step", s.text), self._ended_with(s))
        else:
            d.finish = "stop"  # a turn without a call: the answer

    def _ended_with(self, s: Sample) -> str:
        """The text of the special token that ended a turn (an end-of-turn token the chat template writes too)."""
        last = s.token_ids[-1:] if s.token_ids else []
        return self.tokenizer.decode(last) if last and last[0] in set(self.tokenizer.all_special_ids) else ""

    def _tool(self, text: str, counts) -> tuple[str, str]:
        """Run the call written at the end of `text`, counted in `counts`; (tool name or '', its result or an error)."""
        found = self.spec.call(text)
        if isinstance(found, str):
            counts["bad_calls" if "no tool" not in found else "unknown_tools"] += 1
            return "", found
        name, args = found
        counts["tool_calls"] += 1
        try:
            return name, str(self.spec.tools[name].fn(**args))
        except Exception as e:  # noqa: BLE001 - a tool's error goes back to the model as its result, as TRL does
            counts["tool_errors"] += 1
            return name, f"error: {one_line(e)}"

    def _answer(self, d: Dialogue, cap: int) -> None:
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
            self._observe(d, answer, ended_with, cap)
            return
        name, result = answer
        d.messages.append({"role": "tool", "name": name, "content": result})
        m = self.spec.markup
        inline = f"{m.result_open}{result}{m.result_close}\n"
        self._insert(d, self.prompter.next_turn(d.messages, ended_with) if self.template else inline, cap)

    def _observe(self, d: Dialogue, answer: tuple, ended_with: str, cap: int) -> None:
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
        self._insert(d, self.prompter.next_turn(d.messages, ended_with), cap)

    def _insert(self, d: Dialogue, text: str, cap: int) -> None:
        """Tokens that are not the policy's; past the token cap the dialogue is cut off."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        d.add(ids[: max(0, cap - len(d.after))], False)
        if len(d.after) >= cap:
            d.finish = "length"
            d.counts["cut_off"] += 1

    def _env_call(self, d: Dialogue, method: str, arg):
        """An environment's reset or step; what it raises stops the run with the example's id (RewardError)."""
        try:
            return getattr(d.env, method)(arg)
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
