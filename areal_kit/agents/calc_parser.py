"""vLLM's tool parser for tiny://tool's calculator calls: a reply that is a call and nothing else,
"<tool_call> 4 7 + 3 8 </tool_call>" (as the calculator workflow runs it), becomes an OpenAI
tool_call of the request's first tool with arguments {"expression": "4 7 + 3 8"}, as the hermes
parser reads a real model's JSON calls. The chat endpoint (rl/engine/endpoint.py) uses it.

    agent.tool_parser=calc
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from vllm.entrypoints.generate.base.protocol import (
    DeltaMessage,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.abstract_tool_parser import ToolParser

from areal_kit.agents.calculator import NAME, called


class CalcToolParser(ToolParser):
    def extract_tool_calls(self, model_output: str, request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        expression = called(model_output)
        if expression is None:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        first = self.tools[0] if self.tools else None
        name = getattr(getattr(first, "function", first), "name", None) or NAME
        call = ToolCall(function=FunctionCall(name=name, arguments=json.dumps({"expression": expression})))
        return ExtractedToolCallInformation(tools_called=True, tool_calls=[call], content=None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: ChatCompletionRequest) -> DeltaMessage | None:
        # Streamed, the text passes as it comes; a call is parsed from a whole reply only.
        return DeltaMessage(content=delta_text)
