"""AgentScope Tuner's tune() example, unchanged but for its import line.

    cd tutorial/tune_api && python react_tune.py

It names Qwen/Qwen3-0.6B, which must be in the local Hugging Face cache (there is no hub at run time here); on
a CPU machine try quickstart_tune.py, the quick-start on the embedded demo model.
"""
from typing import Dict

from astuner import tune, WorkflowOutput, JudgeOutput, DatasetConfig, TunerModelConfig, AlgorithmConfig
from agentscope.agent import ReActAgent
from agentscope.model import OpenAIChatModel
from agentscope.formatter import OpenAIChatFormatter
from agentscope.message import Msg

async def run_react_agent(task: Dict, model: OpenAIChatModel,
                          auxiliary_models: Dict[str, OpenAIChatModel]) -> WorkflowOutput:
    agent = ReActAgent(name="react_agent", sys_prompt="You are a helpful math problem solving agent.",
                       model=model, formatter=OpenAIChatFormatter())
    response = await agent.reply(msg=Msg("user", task["question"], role="user"))
    return WorkflowOutput(response=response)

async def judge_function(task: Dict, response: Msg,
                         auxiliary_models: Dict[str, OpenAIChatModel]) -> JudgeOutput:
    ground_truth = task["answer"]
    reward = 1.0 if ground_truth in response.get_text_content() else 0.0
    return JudgeOutput(reward=reward)

if __name__ == "__main__":
    dataset = DatasetConfig(path="my_dataset", split="train")   # my_dataset/train.jsonl: {"question", "answer"}
    model = TunerModelConfig(model_path="Qwen/Qwen3-0.6B", max_model_len=16384)
    algorithm = AlgorithmConfig(algorithm_type="multi_step_grpo", group_size=8, batch_size=32, learning_rate=1e-6)
    tune(workflow_func=run_react_agent, judge_func=judge_function, model=model, train_dataset=dataset,
         algorithm=algorithm)
    # or: tune(workflow_func=run_react_agent, judge_func=judge_function, config_path="config.yaml")
