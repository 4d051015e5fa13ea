"""The lookup agent as a tune() function workflow: `run_agent(task, model, auxiliary_models)`.

Two ways to train it:
    astuner --conf agent_quickstart.yaml astuner.rollout.agentscope_workflow='tune_agent.py->run_agent'
    python tune_agent.py          (tune() with the same YAML; the judge is a function here)
Both start from the warm start that `astuner warmstart --conf agent_quickstart.yaml` saves (README.md), run from
this folder.
`model` is the episode's model (an AgentScope chat model, recorded with exact token ids), so the ReAct agent of
react_agent.py runs on it unchanged.
"""

from pathlib import Path

from astuner import JudgeOutput, WorkflowOutput, tune
from lookup_task import BOXED
from react_agent import answer


async def run_agent(task: dict, model, auxiliary_models) -> WorkflowOutput:
    final = await answer(model, task["question"])
    # response: what a function judge receives; final_answer: what the YAML's CodeJudge reads.
    return WorkflowOutput(reward=None, response=final, metadata={"final_answer": final})


async def judge(task: dict, response, auxiliary_models) -> JudgeOutput:
    """1.0 when the last boxed code is the person's code (the YAML's CodeJudge, as a function)."""
    boxed = BOXED.findall(str(response or ""))
    ok = bool(boxed) and boxed[-1] == task["answer"]
    return JudgeOutput(reward=float(ok), is_success=ok)


if __name__ == "__main__":
    tune(workflow_func=run_agent, judge_func=judge, config_path=str(Path(__file__).with_name("agent_quickstart.yaml")),
         overrides=["astuner.model.path=launcher_record/agent_quickstart_warmstart/model"])
