"""Agent frameworks' default tool paths against both front ends, with the embedded model (a chat template
without a tool format, so ``tool_choice: auto`` is served in the generic form): the OpenAI Agents SDK's
default loop with a function tool (its Responses and chat-completions model classes, run and streamed)
must finish with a text answer, and LangChain's ``bind_tools`` (no ``tool_choice``) and
``with_structured_output`` must get answers of their shapes. With the generic form's nudges the embedded
model calls the weather tool for a weather question and then answers from its result in text: the Agents
SDK's loops and LangChain's ``bind_tools`` are held to that (greedy); pydantic-ai's and instructor's runs
must end with an output of their type (instructor is installed by scripts/setup.sh without its
dependencies: its jiter pin excludes our openai's)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

# (the SDK imported in the tests: ~1.9 s, which every xdist worker would pay at collection)
pytestmark = [pytest.mark.server, pytest.mark.skipif(importlib.util.find_spec("agents") is None,
                                                     reason="needs the openai-agents SDK")]
QUESTION = "What is the weather in Paris?"
MAX_TOKENS = 48  # (the embedded model's answers are cut short: the loop, not the prose, is under test)


def _weather(city: str) -> str:
    return f"Sunny and 24 degrees Celsius in {city}."


@pytest.mark.parametrize("model_class", ["responses", "chat"])
def test_agents_sdk_default_loop_finishes(async_frontend, model_class):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # (no traces sent to OpenAI's servers)
    client = AsyncOpenAI(base_url=async_frontend.openai_base, api_key=async_frontend.key(), max_retries=0)
    model = (OpenAIResponsesModel if model_class == "responses" else OpenAIChatCompletionsModel)(
        model="smollm2", openai_client=client)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        calls.append(city)
        return _weather(city)

    agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0))

    async def run_both():
        result = await Runner.run(agent, QUESTION, max_turns=4)
        streamed = Runner.run_streamed(agent, QUESTION, max_turns=4)
        events = [event async for event in streamed.stream_events()]
        return result, streamed, events

    result, streamed, events = asyncio.run(run_both())
    # The whole loop, run and streamed: one call of the tool, then an answer in text from its result (the
    # generic form's nudges, llm_api.text.tools.GenericPrompt; greedy, so the same both times).
    assert calls == ["Paris", "Paris"], calls
    assert isinstance(result.final_output, str) and "sunny" in result.final_output.lower(), result.final_output
    assert isinstance(streamed.final_output, str) and streamed.final_output == result.final_output
    assert any(e.type == "raw_response_event" for e in events)


def test_langchain_bind_tools_and_structured_output(async_frontend):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return _weather(city)

    llm = langchain_openai.ChatOpenAI(base_url=async_frontend.openai_base, api_key=async_frontend.key(),
                                      model="smollm2", temperature=0, max_tokens=MAX_TOKENS, max_retries=0)
    answer = llm.bind_tools([get_weather]).invoke(QUESTION)
    assert [(call["name"], call["args"]) for call in answer.tool_calls] == [("get_weather", {"city": "Paris"})], answer
    city = llm.with_structured_output(City).invoke("Which city is the capital of France? Answer in JSON.")
    assert isinstance(city, City)


@pytest.mark.parametrize("model_class", ["chat", "responses"])
def test_pydantic_ai_output_type_and_a_tool(async_frontend, model_class):
    """pydantic-ai's default: an agent with an output type and a tool. Its default output mode is a tool
    (``final_result``) beside the function tool, with ``tool_choice`` auto or required as it decides; the run
    must end with an output of the type (retries allowed, as pydantic-ai does)."""
    pytest.importorskip("pydantic_ai")
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Weather(BaseModel):  # (bounded strings: the grammar ends the call within max_tokens)
        city: str = Field(max_length=24)
        summary: str = Field(max_length=48)

    provider = OpenAIProvider(base_url=async_frontend.openai_base, api_key=async_frontend.key())
    model = (OpenAIChatModel if model_class == "chat" else OpenAIResponsesModel)("smollm2", provider=provider)
    agent = Agent(model, output_type=Weather, retries=3,
                  model_settings={"max_tokens": MAX_TOKENS * 2, "temperature": 0})

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return _weather(city)

    result = agent.run_sync(QUESTION)
    assert isinstance(result.output, Weather)


@pytest.mark.parametrize("mode", ["TOOLS", "RESPONSES_TOOLS"])
def test_instructor_default_and_responses_modes(async_frontend, mode):
    """instructor's default mode for the openai client (``TOOLS``: chat completions with the output model
    as a forced function) and its Responses mode (``RESPONSES_TOOLS``: a forced function tool beside
    ``text.format``) must give an instance of the model (retries allowed, as instructor does)."""
    instructor = pytest.importorskip("instructor")
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):  # (bounded strings: the grammar ends the call within max_tokens)
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)

    openai_client = OpenAI(base_url=async_frontend.openai_base, api_key=async_frontend.key(), max_retries=0)
    client = instructor.from_openai(openai_client, mode=getattr(instructor.Mode, mode))
    asked = [{"role": "user", "content": "Which city is the capital of France?"}]
    if mode == "TOOLS":
        city = client.chat.completions.create(model="smollm2", response_model=City, messages=asked, max_retries=2,
                                              temperature=0, max_tokens=MAX_TOKENS * 2)
    else:
        city = client.responses.create(model="smollm2", response_model=City, input=asked, max_retries=2,
                                       temperature=0, max_output_tokens=MAX_TOKENS * 2)
    assert isinstance(city, City) and city.name
