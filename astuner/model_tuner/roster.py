"""Which model serves each named agent of an episode, and the engines that serve the models.

`astuner.agents` maps an agent to a model (`policy`, or a name of `astuner.models`) and says whether its calls
train; an agent not listed, and the episode's main model, are served by `policy`. The roster is shared by every
episode of a runner; a call looks its agent up when it is made, so every front end (AgentScope, the OpenAI and
Anthropic clients, the loopback endpoint) routes the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from astuner.config.schema_models import POLICY
from astuner.engine.base import InferenceEngine

__all__ = ["POLICY", "Roster", "roster_of"]


@dataclass(frozen=True)
class Roster:
    engines: dict[str, InferenceEngine]  # model name -> its engine, the run's first model (astuner.model) first
    agents: dict[str, tuple[str, bool]] = field(default_factory=dict)  # agent -> (model, trainable)
    # model -> its own (temperature, top_p, top_k), each None where the rollout's applies (astuner.models)
    sampling: dict[str, tuple] = field(default_factory=dict)

    @classmethod
    def single(cls, engine: InferenceEngine) -> "Roster":
        """One model, `policy`, serving every agent: a run without astuner.models."""
        return cls({POLICY: engine})

    @property
    def default(self) -> str:
        """The model of agents astuner.agents does not list: the run's first."""
        return next(iter(self.engines))

    def model_of(self, agent: str) -> str:
        return self.agents[agent][0] if agent in self.agents else self.default

    def sampling_of(self, agent: str) -> tuple:
        """(temperature, top_p, top_k) of the model serving `agent`; None where the rollout's settings apply."""
        return self.sampling.get(self.model_of(agent), (None, None, None))

    def trainable(self, agent: str) -> bool:
        """False when astuner.agents says the agent's calls do not train (`for_agent(name, trainable=False)` can
        turn them off too, never on)."""
        return self.agents[agent][1] if agent in self.agents else True


def roster_of(agents, models, engines: dict) -> Roster | None:
    """Which engine serves each named agent (`agents`: the astuner.agents section); `engines`: {model name: its
    engine} over the `ModelSet` `models`, the first model's first. None for a one-model run without named agents."""
    if len(engines) == 1 and not agents:
        return None
    return Roster(dict(engines), {agent: (entry.model, entry.trainable) for agent, entry in agents.items()},
                  {spec.name: spec.own_sampling for spec in models if spec.name in engines})
