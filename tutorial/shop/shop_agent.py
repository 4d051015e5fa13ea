"""The shop assistant: an AgentScope ReActAgent with two tools, as the README's "Your own agent" writes one."""

from typing import Literal

from agentscope.agent import ReActAgent
from agentscope.formatter import OpenAIChatFormatter
from agentscope.memory import InMemoryMemory
from agentscope.message import Msg, TextBlock
from agentscope.tool import Toolkit, ToolResponse

from astuner import ModelTuner, Workflow, WorkflowOutput, WorkflowTask
from shop_task import SYSTEM
from shop_task import price as price_text
from shop_task import stock as stock_text


def stock(item: str) -> ToolResponse:
    """How many of an item the shop has in stock.

    Args:
        item (str): The item's name, in the singular.
    """
    return ToolResponse(content=[TextBlock(type="text", text=stock_text(item))])


def price(item: str, currency: Literal["EUR", "USD", "GBP"]) -> ToolResponse:
    """The price of one item in a currency.

    Args:
        item (str): The item's name, in the singular.
        currency (str): The currency of the price.
    """
    return ToolResponse(content=[TextBlock(type="text", text=price_text(item, currency))])


class ShopAgent(Workflow):
    async def execute(self, workflow_task: WorkflowTask, model_tuner: ModelTuner) -> WorkflowOutput:
        toolkit = Toolkit()
        toolkit.register_tool_function(stock)
        toolkit.register_tool_function(price)
        agent = ReActAgent(name="shop", sys_prompt=SYSTEM, model=model_tuner, formatter=OpenAIChatFormatter(),
                           toolkit=toolkit, memory=InMemoryMemory(), max_iters=4)
        agent.set_console_output_enabled(False)
        reply = await agent.reply(Msg("user", workflow_task.task.main_query, role="user"))
        return WorkflowOutput(reward=None, metadata={"final_answer": reply.get_text_content() or ""})
