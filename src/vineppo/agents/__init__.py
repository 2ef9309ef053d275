"""Multi-turn rollouts: tools and environments answer the policy's turns (vineppo.tasks.agent says what they are).

`engine.py` runs the dialogues over any rollout engine (`AgentEngine`, `for_task`); `dialogue.py` holds one
dialogue's tokens, mask, turns and the snapshots that resume it at a turn (VinePPO's states over turns), and `Turns`,
what a dialogue's Sample carries (`Sample.dialogue`), with `counts` summing the dialogues' turns, calls and faults.
"""

from vineppo.agents.dialogue import Turns, counts
from vineppo.agents.engine import AgentEngine, for_task

__all__ = ["AgentEngine", "Turns", "counts", "for_task"]
