"""An agent from "another framework": it only knows an OpenAI-compatible URL and a key, and speaks plain HTTP
(streaming server-sent events, as many frameworks do by default).

astuner serves `model_tuner.base_url` on 127.0.0.1 with a key per episode (`model_tuner.api_key`, revoked when
the episode ends). Any framework configured with that base URL and key trains unchanged: LangChain's
`ChatOpenAI(base_url=..., api_key=...)`, the OpenAI Agents SDK, or code in another process.
"""

import json

import httpx

from astuner import Workflow, WorkflowOutput

SYSTEM = "Solve the math problem. Think step by step and give the final answer within \\boxed{}."


async def ask(base_url: str, api_key: str, question: str) -> str:
    body = {"model": "policy", "stream": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    parts = []
    async with httpx.AsyncClient(timeout=600) as http:
        async with http.stream("POST", f"{base_url}/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {api_key}"}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


class HttpMathWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        answer = await ask(model_tuner.base_url, model_tuner.api_key, workflow_task.task.main_query)
        return WorkflowOutput(reward=None, metadata={"final_answer": answer})
